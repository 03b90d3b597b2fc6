"""One request and its response on a connection, and the one place an error becomes what the
client sees (`fail`).

An `Exchange` is made for each request (as h11 starts a new cycle for each): the request, the
error shape of its endpoint family (ours, or an API's wire format), the CORS fields every head of
its response carries, whether the connection may stay open after it, and how far the response
has got. Its head is decided as data: `respond()` writes a whole response whose head says
keep-alive or close (http11.response); `start_stream()` an event stream's head (close: its body
ends with the connection); `upgrade()` a WebSocket's 101. Before any of them an error is an HTTP
response in the family's shape; after a stream's head or a 101 it is the stream's own ending
(`ending`: an error event in the stream's format, an error message and a close code), never a
status. Leaves out: HTTP/2, trailers, and chunked responses (a stream ends with its connection).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from streaming.server.connection import Connection
from streaming.wire.apis import Format
from streaming.wire.errors import InvalidRequest, ProtocolError, error_body
from streaming.wire.http11 import Request, head, json_response, response

Ending = Callable[[ProtocolError], Awaitable[None]]  # how a begun stream says an error


class Progress(enum.Enum):
    NOTHING = "nothing"  # no byte of the response yet: an error can still be a status
    WHOLE = "whole"  # a whole response went out
    STREAMING = "streaming"  # an event stream's head went out: errors are its own events
    UPGRADED = "upgraded"  # the WebSocket's 101 went out: errors are its close


class Exchange:
    def __init__(
        self, conn: Connection, request: Request, *, keep_alive: bool = False, write_timeout: float = 30.0
    ) -> None:
        self.conn, self.request, self.write_timeout = conn, request, write_timeout
        # The client and the server's limits allow the connection to stay open after this
        # response (HTTP/1.1 without Connection: close, under --keepalive-requests); only a whole
        # response, whose body has a length, keeps it open (RFC 9112 §9.3).
        self.keep_alive = keep_alive
        self.format: Format | None = None  # the route's wire format (the /v1/ family): errors in its shape
        self.cors: list[tuple[str, str]] = []  # added to every head of this response
        self.progress = Progress.NOTHING
        self.ending: Ending | None = None

    @property
    def reusable(self) -> bool:
        """Whether the connection may carry the next request after this one."""
        return self.stays_open and self.progress is Progress.WHOLE

    def respond(
        self,
        status: int,
        body: bytes = b"",
        content_type: str | None = "application/json",
        fields: Iterable[tuple[str, str]] = (),
    ) -> None:
        """A whole response; its head says whether the connection stays open."""
        self.conn.write(response(status, body, content_type, [*self.cors, *fields], self.stays_open))
        self.progress = Progress.WHOLE

    def respond_json(self, status: int, value: Any, fields: Iterable[tuple[str, str]] = ()) -> None:
        self.conn.write(json_response(status, value, [*self.cors, *fields], self.stays_open))
        self.progress = Progress.WHOLE

    @property
    def stays_open(self) -> bool:
        """What a whole response's head says: keep-alive, unless what followed the request was no
        request (connection.PIPELINED_KEEP) or the client left."""
        return self.keep_alive and not self.conn.spoilt and not self.conn.gone

    def start_stream(self, fields: Iterable[tuple[str, str]], ending: Ending | None, prelude: bytes = b"") -> None:
        """An event stream's head (and `prelude`, its first bytes): after it an error is
        `ending(err)`, or nothing if the stream has none (a resumable stream's errors are its
        recording's events)."""
        self.keep_alive = False
        self.conn.no_more_requests()  # a stream's connection closes after it
        self.conn.write(head(200, [*fields, *self.cors], keep_alive=False) + prelude)
        self.conn.stream_buffers()
        self.progress, self.ending = Progress.STREAMING, ending

    def upgrade(self, switching: bytes, ending: Ending) -> None:
        """A WebSocket's 101 (websocket.handshake's bytes): after it an error is `ending(err)`."""
        self.keep_alive = False
        self.conn.write(switching)
        self.conn.stream_buffers()
        self.progress, self.ending = Progress.UPGRADED, ending

    def end_stream(self) -> None:
        """The stream's end is being sent: after it no error is said (it would follow [DONE])."""
        self.ending = None

    async def send(self, data: bytes) -> bool:
        """Write a stream's bytes within --write-timeout; False if the reader cannot take them."""
        return await self.conn.send(data, self.write_timeout)

    @property
    def behind(self) -> bool:
        """The reader has not yet taken what the stream sent it (adaptive merging: answer.py)."""
        return self.conn.behind

    async def settle(self) -> bool:
        """Wait, within --write-timeout, for the reader to take what the stream sent it."""
        return await self.conn.settle(self.write_timeout)

    def problem(self, err: ProtocolError | InvalidRequest) -> ProtocolError:
        """A failed request check as this endpoint family says it (the APIs say 400; ours 422 or
        400; a WebSocket closes with 1008)."""
        if isinstance(err, ProtocolError):
            return err
        return err.problem(400 if self.format is not None else None)

    def error_body(self, err: ProtocolError) -> dict[str, Any]:
        return self.format.error_body(err) if self.format is not None else error_body(err)

    async def fail(self, err: ProtocolError | InvalidRequest) -> None:
        """The one place an error becomes what the client sees: before the response has begun,
        an HTTP response in the family's error shape (and the connection closes: the request may
        be half read); after a stream's head or a 101, the stream's own ending, if the reader is
        still there."""
        err = self.problem(err)
        self.keep_alive = False
        try:
            if self.progress is Progress.NOTHING:
                self.conn.write(json_response(err.status, self.error_body(err), [*self.cors, *err.headers]))
                await self.conn.drain(self.write_timeout)
            elif self.ending is not None and not self.conn.gone:
                await self.ending(err)
        except ConnectionError:
            pass
