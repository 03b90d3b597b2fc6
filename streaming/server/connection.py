"""One client's connection: reading its request, writing with a deadline, noticing it leave,
and the one place an error becomes what the client sees (`fail`).

Every write of a stream goes through `send`: write, and if the transport's buffer is over its
high-water mark wait for it to drain for at most the write timeout, then drop the reader.
A connection carries requests one after another (keep-alive, and pipelined ones in order): `begin`
starts each, `next_bytes` waits for the next, and `finish_head` says in each response whether the
connection stays open. Leaves out: TLS.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from streaming.wire.errors import InvalidRequest, ProtocolError, error_body
from streaming.wire.http11 import MAX_BODY, MAX_HEAD, Request, RequestParser, head, json_response

READ_SIZE = 65536
# A stream's kernel send buffer (Linux doubles it): with the reader's own ~100 KB, what a reader
# who reads nothing absorbs before a write waits (unset, the kernel grows it to megabytes).
STREAM_SNDBUF = 16 * 1024
STREAM_HIGH_WATER = 16 * 1024  # a stream's transport buffer past which a write waits (asyncio's is 64 KiB)


class Budget:
    """Bytes that all connections together may hold for one purpose (bodies still arriving)."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def take(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.gone = False  # the watcher saw end-of-file: the client left
        self.trailing = b""  # bytes read past the request: the next one's (pipelined), or a WebSocket's frames
        self.begin(keep_alive=False)

    def begin(self, keep_alive: bool) -> None:
        """A new request on this connection: the per-request state, and whether the connection
        may stay open after its response (HTTP/1.1 keep-alive, RFC 9112 §9.3)."""
        self.keep_alive = keep_alive
        self.started = False  # the response has begun: an error can no longer be an HTTP status
        self.head_sent = False
        self.ws: Any = None  # the WebSocket once upgraded: errors become its close
        # The endpoint family's error shape, and the status of a failed request check there
        # (None: the check's own, 422 or 400, as our endpoints answer; the APIs say 400).
        self.error_body: Callable[[ProtocolError], Any] = error_body
        self.invalid_status: int | None = None
        self.api: Any = None  # the /v1/ family: the route's wire format object
        self.extra_headers: list[tuple[str, str]] = []  # added to the response's head (CORS)

    async def next_bytes(self, timeout: float) -> bool:
        """Wait up to `timeout` for the first bytes of another request; False if the client
        closed or stayed silent (an idle keep-alive connection is then closed, without a 408)."""
        if self.trailing:
            return True
        try:
            data = await asyncio.wait_for(self.reader.read(READ_SIZE), timeout)
        except asyncio.TimeoutError:
            return False
        self.trailing = data
        return bool(data)

    async def read_request(self, timeout: float, bodies: Budget) -> Request | None:
        """The request, or None if the client left first; 408 if it takes over `timeout`; 503 if
        its body does not fit what `bodies` has left (it is reserved while the body arrives)."""
        parser, continued, reserved = RequestParser(), False, 0
        parser.feed(self.trailing)

        async def read() -> Request | None:
            nonlocal continued, reserved
            while (request := parser.next_request()) is None:
                if parser.head is not None and not reserved:
                    reserved = int(parser.head.headers.get("content-length", "0")) or -1
                    if reserved > 0 and not bodies.take(reserved):
                        reserved = -1
                        raise ProtocolError(
                            "too many request bodies are arriving; try again", 503, headers=[("Retry-After", "1")]
                        )
                if parser.expects_continue() and not continued:
                    self.writer.write(head(100))
                    continued = True
                data = await self.reader.read(READ_SIZE)
                if not data:
                    return None
                parser.feed(data)
            return request

        try:
            request = await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"the request took over {timeout:g} s to arrive", 408) from None
        finally:
            if reserved > 0:
                bodies.give(reserved)
        self.trailing = parser.trailing
        return request

    def finish_head(self, data: bytes) -> bytes:
        """A response head as this connection sends it: with `extra_headers`, and `Connection:
        keep-alive` instead of the head writer's `close` if the connection stays open, which it
        can only when the body has a length (a stream's body ends with the connection)."""
        end = data.find(b"\r\n\r\n")
        head = data[:end].lower()
        framed = b"\r\ncontent-length:" in head or head.startswith((b"http/1.1 204", b"http/1.1 304"))
        self.keep_alive = self.keep_alive and framed and b"\r\nconnection: close" in head
        if self.keep_alive:
            data = data.replace(b"\r\nConnection: close\r\n", b"\r\nConnection: keep-alive\r\n", 1)
        if self.extra_headers:
            at = data.index(b"\r\n") + 2  # after the status line
            fields = "".join(f"{k}: {v}\r\n" for k, v in self.extra_headers).encode("latin-1")
            data = data[:at] + fields + data[at:]
        return data

    def start_stream(self, head: bytes) -> None:
        """Begin a stream's response (an event stream's head, a WebSocket's 101): after it an
        error can no longer be a status. Its buffers are small, so that a reader who reads nothing
        fills them soon and the write timeout drops it (else the kernel grows the send buffer to
        megabytes, and no write ever waits)."""
        self.write(head)
        self.started = True
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
        transport = self.writer.transport
        transport.set_write_buffer_limits(high=min(STREAM_HIGH_WATER, transport.get_write_buffer_limits()[1]))

    async def backpressure(self, timeout: float) -> bool:
        """Before reading more from a peer: if what we owe it is over the mark, wait for it to read
        (at most `timeout`, then drop it). Answers to a flood of pings cannot pile up unread."""
        transport = self.writer.transport
        if transport.get_write_buffer_size() < transport.get_write_buffer_limits()[1]:
            return True
        return await self.drain(timeout)

    def problem(self, err: ProtocolError | InvalidRequest) -> ProtocolError:
        """A failed request check as this endpoint family says it (close 1008 on a WebSocket)."""
        if isinstance(err, ProtocolError):
            return err
        status = self.invalid_status or err.status
        return ProtocolError(err.message, status, close_code=1008, kind="invalid_request", param=err.param)

    async def fail(self, err: ProtocolError | InvalidRequest) -> None:
        """The one place an error becomes what the client sees: a WebSocket close, or an HTTP
        response in the endpoint's error shape if the response has not begun."""
        err = self.problem(err)
        self.keep_alive = False  # after an error the connection closes: the request may be half read
        try:
            if self.ws is not None:
                await self.ws.close(err.close_code, err.message)
            elif not self.started and not self.head_sent:
                self.write(json_response(err.status, self.error_body(err), err.headers))
                await self.writer.drain()
        except ConnectionError:
            pass

    def write(self, data: bytes) -> None:
        """Write bytes; the first write is the response's head, which gets `extra_headers`."""
        if not self.head_sent:
            data = self.finish_head(data)
        self.head_sent = True
        if not self.writer.transport.is_closing():
            self.writer.write(data)

    async def send(self, data: bytes, timeout: float) -> bool:
        """Write and drain; False if the client is gone or cannot take it for `timeout` s."""
        if self.writer.transport.is_closing():
            return False
        self.writer.write(data)
        transport = self.writer.transport
        if transport.get_write_buffer_size() < transport.get_write_buffer_limits()[1]:
            return True  # under the high-water mark drain() would not wait: skip its timer (per event)
        return await self.drain(timeout)

    async def drain(self, timeout: float) -> bool:
        """Wait for the written bytes to go; drop a reader that takes none for `timeout` s."""
        try:
            await asyncio.wait_for(self.writer.drain(), timeout)
        except asyncio.TimeoutError:
            self.writer.transport.abort()  # a reader that stopped reading: drop it
            return False
        except ConnectionError:
            return False
        return not self.writer.transport.is_closing()

    async def watch(self, job: Any = None) -> None:
        """End-of-file on the request side means the client closed: stop its job at once.
        (A client that half-closes after its request looks the same: see the README.) Bytes
        that arrive meanwhile are the next request's, pipelined: kept, up to a request's size."""
        try:
            while data := await self.reader.read(READ_SIZE):
                self.trailing += data
                if len(self.trailing) > MAX_HEAD + MAX_BODY:
                    self.keep_alive = False  # not a request any more: keep reading only for the end
                    self.trailing = b""
        except ConnectionError:
            pass
        self.gone = True
        if job is not None:
            job.stop.set()
