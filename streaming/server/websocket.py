"""GET /ws: a WebSocket per request (RFC 6455), over the sans-I/O session of the wire layer.

The first message is the request ({"prompt", "max_tokens", ...}); then the server sends {"text"}
messages, {"done": true} and a close 1000. The client may send {"stop": true} at any time; that,
a close frame or end-of-file stops generation at once. `WebSocket` only moves bytes: it feeds
what it reads to `Session` (which answers pings and echoes closes) and writes what the session
has to send. Leaves out: several requests on one socket, binary messages (closed with 1003).
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from streaming.generation.prompts import Prompt
from streaming.server.connection import READ_SIZE, Connection
from streaming.wire import websocket as frames
from streaming.wire.errors import InvalidRequest, ProtocolError, error_body
from streaming.wire.http11 import Request, json_object, json_value
from streaming.wire.params import plain_request
from streaming.wire.session import Closed, Session

if TYPE_CHECKING:
    from streaming.server.app import Server

CLOSE_WAIT = 2.0  # seconds to wait for the peer's close frame before closing TCP anyway (RFC 6455 §7.1.1)


class WebSocket:
    def __init__(self, conn: Connection, trailing: bytes = b"", write_timeout: float = 30.0) -> None:
        self.conn, self.write_timeout = conn, write_timeout
        self.session = Session(client=False)
        self.session.receive_data(trailing)
        self.peer_closed = asyncio.Event()  # the client's close frame (or end-of-file) arrived
        self.listening = False  # listen() is reading frames, so it will see the client's close

    def flush(self) -> None:
        if data := self.session.data_to_send():
            self.conn.write(data)

    async def receive(self) -> str | None:
        """The next text message, or None when the client closed. Raises ProtocolError."""
        while True:
            event = self.session.next_event()
            self.flush()  # a pong, or the echo of the client's close
            if event is None:
                if not await self.conn.backpressure(self.write_timeout):  # answers to pings, unread
                    raise ConnectionError("the peer reads nothing of what it is sent")
                data = await self.conn.reader.read(READ_SIZE)
                if data:
                    self.session.receive_data(data)
                else:
                    self.session.receive_eof()
            elif isinstance(event, Closed):
                self.peer_closed.set()
                return None
            elif isinstance(event, frames.Frame):
                continue  # a ping (the session queued its pong) or a pong
            elif event.opcode == frames.BINARY:
                raise ProtocolError("binary messages are not supported; send JSON text", close_code=1003)
            else:
                return event.text()

    async def listen(self, job: Any) -> None:
        """While the server streams: {"stop": true}, a close frame or end-of-file stop the job."""
        self.listening = True
        try:
            while (message := await self.receive()) is not None:
                value = json_value(message, "a message")  # ProtocolError: a close 1008
                if isinstance(value, dict) and value.get("stop"):
                    job.stop.set()
        except ProtocolError as e:
            job.stop.set()
            await self.close(e.close_code, e.message)
        except ConnectionError:
            pass
        finally:
            self.listening = False
        job.stop.set()

    def send_text(self, text: str) -> None:
        self.session.send_text(text)
        self.flush()

    def send_ping(self) -> bool:
        if self.conn.writer.transport.is_closing() or not self.session.send_ping():
            return False
        self.flush()
        return True

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send our close frame (once) and close TCP. After a normal end (1000) or at shutdown
        (1001), first wait briefly for the client's close frame, which listen() reads (§7.1.1);
        after a protocol error the connection is failed at once (§7.1.7)."""
        self.session.close(code, reason)
        self.flush()
        await self.conn.drain(CLOSE_WAIT)
        if self.listening and code in (1000, 1001) and not self.peer_closed.is_set():
            try:
                await asyncio.wait_for(self.peer_closed.wait(), CLOSE_WAIT)
            except asyncio.TimeoutError:
                pass
        self.conn.writer.close()


async def websocket(srv: Server, conn: Connection, request: Request) -> None:
    conn.start_stream(frames.handshake(request, srv.config.allow_origin))  # ProtocolError: an HTTP answer
    conn.ws = WebSocket(conn, conn.trailing, srv.config.write_timeout)
    await session(srv, conn.ws)


async def first_request(srv: Server, ws: WebSocket) -> Any:
    """The first message's job, started, or a close 1008 (an upstream's failure: 1011)."""
    try:
        first = await asyncio.wait_for(ws.receive(), srv.config.request_timeout)
    except asyncio.TimeoutError:
        raise ProtocolError("no request message arrived in time", close_code=1008) from None
    if first is None:
        return None  # the client left before asking anything
    body = json_object(first, "the first message")  # ProtocolError: a close 1008
    try:
        prompt, params = plain_request(body)
        return await srv.runner.open(Prompt(prompt), params)
    except InvalidRequest as e:
        err = ws.conn.problem(e)
        ws.send_text(json.dumps(error_body(err)))  # the details, then the close code
        raise err from None
    except ProtocolError as e:  # an upstream's failure before any text: the details, then 1011
        ws.send_text(json.dumps(error_body(e)))
        raise


async def session(srv: Server, ws: WebSocket) -> None:
    job = await first_request(srv, ws)
    if job is None:
        return
    listener = asyncio.create_task(ws.listen(job))

    async def ping() -> bool:
        return ws.send_ping()

    try:
        async for piece in srv.pieces(job, on_silence=ping):
            ws.send_text(json.dumps({"text": piece}))
            if not await ws.conn.drain(srv.config.write_timeout):
                job.stop.set()
        stopped = job.stop.is_set()
        if cut := srv.cut_short(job):
            await ws.close(cut.close_code, cut.message)
        else:
            ws.send_text(json.dumps({"done": True}))
            await ws.close(1000)
    except ProtocolError as e:
        stopped = job.stop.is_set()
        ws.send_text(json.dumps(error_body(e)))
        await ws.close(1011, "generation failed")
    finally:
        job.stop.set()
        listener.cancel()
    srv.record("/ws", job, await job.done, stopped, "client said stop")
