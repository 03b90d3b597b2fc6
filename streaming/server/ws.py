"""GET /ws: a WebSocket per request (RFC 6455), over the sans-I/O session of the wire layer.

The first message is the request ({"prompt", "max_tokens", ..., "stream_interval"}); then the
server sends {"text"} messages (a piece each, or several as merging.py says), {"done": true} and
a close 1000. The client may send {"stop": true} at any time; that, a close frame or end-of-file
stops generation at once. `WebSocket` only moves bytes: it feeds what it reads to `Session`
(which answers pings and echoes closes) and writes what the session has to send. An error after
the 101 (`fail`, the exchange's ending) is a message with its details then a close with its code:
1008 a bad request, 1003 a binary message, 1011 a failed generation, 1001 the shutdown. Leaves
out: several requests on one socket, binary messages.
"""

from __future__ import annotations

import asyncio
import json

from streaming.generation.job import Job
from streaming.generation.prompts import Prompt
from streaming.server.answer import Answer, Early
from streaming.server.connection import READ_SIZE, Connection
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.wire import websocket as frames
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.http11 import json_object, json_value
from streaming.wire.params import plain_request, stream_interval
from streaming.wire.session import Closed, Session

CLOSE_WAIT = 2.0  # seconds to wait for the peer's close frame before closing TCP anyway (RFC 6455 §7.1.1)


class WebSocket:
    def __init__(self, conn: Connection, trailing: bytes = b"", write_timeout: float = 30.0) -> None:
        self.conn, self.write_timeout = conn, write_timeout
        self.session = Session(client=False)
        self.session.receive_data(trailing)
        self.peer_closed = asyncio.Event()  # the client's close frame (or end-of-file) arrived
        self.listener: asyncio.Task[None] | None = None  # reading frames while the server streams
        self.bodies, self.reserved = conn.bodies, 0  # what the session holds of messages arriving, reserved there
        self.interval: int | None = None  # the request's pieces per message (None: the server's)

    def flush(self) -> None:
        if data := self.session.data_to_send():
            self.conn.write(data)

    async def receive(self) -> str | None:
        """The next text message, or None when the client closed. Raises ProtocolError."""
        while True:
            event = self.session.next_event()
            self.charge()
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

    def charge(self) -> None:
        """What the session holds of messages still arriving counts in the request bodies' budget,
        which all connections share (a message is a request, of up to MAX_MESSAGE bytes): past it,
        a close 1013, as an HTTP body gets a 503. Each connection's megabyte was bounded alone."""
        bodies = self.bodies
        if bodies is None:
            return
        held = self.session.held()
        if held > self.reserved and not bodies.reserve(held - self.reserved):
            raise ProtocolError("too many messages are arriving; try again", close_code=1013)
        if held < self.reserved:
            bodies.release(self.reserved - held)
        self.reserved = held

    def release(self) -> None:
        """At the connection's end: its share of the budget back, and no more charged."""
        if self.bodies is not None:
            self.bodies.release(self.reserved)
            self.bodies, self.reserved = None, 0

    def listen(self, job: Job) -> None:
        """While the server streams: {"stop": true}, a close frame or end-of-file stop the job."""
        self.listener = asyncio.create_task(self.reading(job))

    async def reading(self, job: Job) -> None:
        try:
            while (message := await self.receive()) is not None:
                value = json_value(message, "a message")  # ProtocolError: a close 1008
                if isinstance(value, dict) and value.get("stop"):
                    job.stop.set()
        except ProtocolError as e:
            job.stop.set()
            await self.fail(e)
        except ConnectionError:
            pass
        job.stop.set()

    def send_text(self, text: str) -> None:
        self.session.send_text(text)
        self.flush()

    async def deliver(self, text: str) -> bool:
        """A piece as a {"text"} message; False if the reader takes nothing for --write-timeout."""
        self.send_text(json.dumps({"text": text}))
        return await self.conn.drain(self.write_timeout)

    @property
    def behind(self) -> bool:
        """The reader has not yet taken what it was sent (adaptive merging: answer.py)."""
        return self.conn.behind

    async def settle(self) -> bool:
        return await self.conn.settle(self.write_timeout)

    async def ping(self) -> bool:
        if self.conn.closing or not self.session.send_ping():
            return False
        self.flush()
        return True

    async def fail(self, err: ProtocolError) -> None:
        """An error after the 101: its details as a message (our error body), then its close code."""
        self.send_text(json.dumps(error_body(err)))
        await self.close(err.close_code, err.message)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        """Send our close frame (once) and close TCP. After a normal end (1000) or at shutdown
        (1001), first wait briefly for the client's close frame, which the listener reads
        (§7.1.1); after a protocol error the connection is failed at once (§7.1.7)."""
        self.session.close(code, reason)
        self.flush()
        await self.conn.drain(CLOSE_WAIT)
        listener = self.listener
        if listener is not None and not listener.done() and code in (1000, 1001) and not self.peer_closed.is_set():
            try:
                await asyncio.wait_for(self.peer_closed.wait(), CLOSE_WAIT)
            except asyncio.TimeoutError:
                pass
        if listener is not None and listener is not asyncio.current_task():
            listener.cancel()
        self.conn.writer.close()


async def websocket(ctx: Context, ex: Exchange) -> None:
    switching = frames.handshake(ex.request, ctx.config.allow_origin)  # ProtocolError: an HTTP answer
    ws = WebSocket(ex.conn, ex.conn.trailing, ctx.config.write_timeout)
    ex.upgrade(switching, ws.fail)
    try:
        job = await first_request(ctx, ws)
        if job is None:
            return  # the client left before asking anything
        ws.listen(job)
        async with Answer(ctx.answers, job, "/ws", early=Early.SAID_STOP, naive=False) as answer:
            await answer.relay(ws.deliver, ws.ping, merging=ctx.config.merging(ws.interval), outlet=ws)
        ex.end_stream()
        ws.send_text(json.dumps({"done": True}))
        await ws.close(1000)
    finally:
        ws.release()


async def first_request(ctx: Context, ws: WebSocket) -> Job | None:
    """The first message's job, started; its errors are the exchange's to say (a close 1008, or
    an upstream's failure: 1011)."""
    try:
        first = await asyncio.wait_for(ws.receive(), ctx.config.request_timeout)
    except asyncio.TimeoutError:
        raise ProtocolError("no request message arrived in time", close_code=1008) from None
    if first is None:
        return None
    body = json_object(first, "the first message")  # ProtocolError: a close 1008
    prompt, params = plain_request(body)  # InvalidRequest: a close 1008 with the status our endpoints give
    ws.interval = stream_interval(body)
    return await ctx.backend.open(Prompt(prompt), params)
