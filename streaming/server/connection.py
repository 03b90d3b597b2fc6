"""One client's connection as bytes: reading its requests, writing with a deadline, and noticing
it leave. What a response says (its head, its errors) is the exchange's (exchange.py).

Every write of a stream goes through `send`: write, and if the transport's buffer is over its
high-water mark wait for it to drain for at most the write timeout, then drop the reader;
`behind` and `settle` are the same mark seen from adaptive merging (server/merging.py). A
connection carries requests one after another (keep-alive, and pipelined ones in order):
`next_bytes` waits for the next, `read_request` reads it whole (bodies arriving on all
connections together are bounded by one `BodyBudget`), and bytes read past a request are kept in
`trailing`, the next one's. Leaves out: TLS.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from streaming.generation.job import Job
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Request, RequestParser, head

READ_SIZE = 65536
# A stream's kernel send buffer (Linux doubles it): with the reader's own ~100 KB, what a reader
# who reads nothing absorbs before a write waits (unset, the kernel grows it to megabytes).
STREAM_SNDBUF = 16 * 1024
STREAM_HIGH_WATER = 16 * 1024  # a stream's transport buffer past which a write waits (asyncio's is 64 KiB)
IDLE_EMPTY_LINES = 8  # bytes of CR and LF between requests that still leave a connection idle
# Bytes of the next, pipelined request kept while an answer is generated (and no body budget is
# charged): past it the connection closes after this answer, unanswered requests and all, which a
# pipelining client retries (RFC 9112 §9.3.2). A whole request's size (1 MiB) each was a megabyte
# a connection that nothing bounded (a client sending junk under a long answer).
PIPELINED_KEEP = 64 * 1024
# A closing connection's lingering read (close()): what a client still sending its body gets to
# send, dropped, before the socket closes; past it, the reset it would have got anyway (nginx
# lingers up to 30 s; a client that has read its answer closes at once, on our half-close). The
# bytes bound the CPU a client can make it spend (reading 16 MiB takes a few ms); no memory is kept.
LINGER = 2.0
LINGER_BYTES = 16 * 1024 * 1024


class BodyBudget:
    """Bytes that the request bodies still arriving on all connections may hold together."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0

    def reserve(self, n: int) -> bool:
        if self.used + n > self.total:
            return False
        self.used += n
        return True

    def release(self, n: int) -> None:
        self.used -= n


class Connection:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bodies: BodyBudget | None = None
    ) -> None:
        self.reader, self.writer = reader, writer
        self.bodies = bodies  # the server's: a WebSocket's messages still arriving count there too (ws.py)
        self.gone = False  # the watcher saw end-of-file: the client left
        self.spoilt = False  # no more requests on it: a stream began, or what followed a request passed PIPELINED_KEEP
        self.trailing = b""  # bytes read past the request: the next one's (pipelined), or a WebSocket's frames
        self.unfinished: Request | None = None  # the head of a request refused while read (401, 413, 408, 503)

    async def next_bytes(self, timeout: float) -> bool:
        """Wait up to `timeout` for the first bytes of another request; False if the client
        closed or stayed silent (an idle keep-alive connection is then closed, without a 408).
        A few empty lines between requests (a CRLF after a body, RFC 9112 §2.2) leave it idle."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not self.trailing.strip(b"\r\n") and len(self.trailing) <= IDLE_EMPTY_LINES:
            self.trailing = b""
            try:
                data = await asyncio.wait_for(self.reader.read(READ_SIZE), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return False
            if not data:
                return False
            self.trailing = data
        return True

    async def read_request(
        self, timeout: float, bodies: BodyBudget, vet: Callable[[Request], object] = lambda _: None
    ) -> Request | None:
        """The request, or None if the client left first; 408 if it takes over `timeout`; 503 if
        its body does not fit what `bodies` has left (it is reserved while the body arrives).
        `vet(head)` raises for a request refused on its head alone, before its body is read or
        any of the budget spent on it."""
        parser, continued, reserved = RequestParser(), False, 0
        parser.feed(self.trailing)
        self.unfinished = None

        async def read() -> Request | None:
            nonlocal continued, reserved
            while (request := parser.next_request()) is None:
                if parser.head is not None and not reserved:
                    self.unfinished = parser.head
                    vet(parser.head)
                    reserved = int(parser.head.headers.get("content-length", "0")) or -1
                    if reserved > 0 and not bodies.reserve(reserved):
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
            if not reserved:  # (whole in the first read)
                self.unfinished = request
                vet(request)
            return request

        try:
            request = await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"the request took over {timeout:g} s to arrive", 408) from None
        finally:
            if reserved > 0:
                bodies.release(reserved)
            self.unfinished = self.unfinished or parser.head  # (a head whose framing was refused: 413, 411)
        self.trailing, self.unfinished = parser.trailing, None
        return request

    def stream_buffers(self) -> None:
        """For a stream's response (an event stream, a WebSocket): small buffers, so that a reader
        who reads nothing fills them soon and the write timeout drops it (else the kernel grows
        the send buffer to megabytes, and no write ever waits)."""
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
            except OSError:  # the client reset the connection already: the writes will fail, quietly
                pass
        transport = self.writer.transport
        transport.set_write_buffer_limits(high=min(STREAM_HIGH_WATER, transport.get_write_buffer_limits()[1]))

    @property
    def closing(self) -> bool:
        return self.writer.transport.is_closing()

    def write(self, data: bytes) -> None:
        if not self.closing:
            self.writer.write(data)

    async def send(self, data: bytes, timeout: float) -> bool:
        """Write and drain; False if the client is gone or cannot take it for `timeout` s."""
        if self.closing:
            return False
        self.writer.write(data)
        transport = self.writer.transport
        if transport.get_write_buffer_size() < transport.get_write_buffer_limits()[1]:
            return True  # under the high-water mark drain() would not wait: skip its timer (per event)
        return await self.drain(timeout)

    @property
    def behind(self) -> bool:
        """The reader is behind: the transport holds more than its low mark of what was written
        (the kernel's buffers are full), so bytes written now would only queue behind those."""
        transport = self.writer.transport
        return transport.get_write_buffer_size() > transport.get_write_buffer_limits()[0]

    async def settle(self, timeout: float, mark: int | None = None) -> bool:
        """Wait until the transport holds its low mark or less (the reader has taken what came
        before), or `mark` bytes; False, as drain(), if the client is gone or takes nothing for
        `timeout` s."""
        transport = self.writer.transport
        low, high = transport.get_write_buffer_limits()
        mark = low if mark is None else mark
        if self.closing or transport.get_write_buffer_size() <= mark:
            return not self.closing
        transport.set_write_buffer_limits(high=mark, low=mark)  # past the mark now: the writer pauses
        try:  # ... and drain() waits until the transport is back at the mark
            return await self.drain(timeout)
        finally:
            transport.set_write_buffer_limits(high=high, low=low)

    async def backpressure(self, timeout: float) -> bool:
        """Before reading more from a peer: if what we owe it is over the mark, wait for it to read
        (at most `timeout`, then drop it). Answers to a flood of pings cannot pile up unread."""
        transport = self.writer.transport
        if transport.get_write_buffer_size() < transport.get_write_buffer_limits()[1]:
            return True
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
        return not self.closing

    async def close(self, timeout: float) -> None:
        """Close in stages (RFC 9112 §9.6): what is owed goes out within `timeout` (else the
        connection is dropped), then our side is half-closed and what the client still sends is
        read and dropped, up to LINGER_BYTES for LINGER s (closed with bytes unread, the kernel
        answers with a reset, and the client may lose the response it had not read yet: a 413
        for a body it was still sending). The socket is then closed, within `timeout` too: a
        closed writer waits for what it holds, which a client that reads nothing never takes."""
        transport = self.writer.transport
        if not self.closing and transport.can_write_eof() and await self.settle(timeout, 0):
            try:
                transport.write_eof()
            except OSError:  # reset by a client that had closed (ENOTCONN): nothing to linger for
                pass
            else:
                await self.linger()
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), timeout)
        except asyncio.TimeoutError:
            transport.abort()
        except ConnectionError:
            pass

    async def linger(self) -> None:
        """Read and drop what the client sends until its end-of-file, LINGER_BYTES or LINGER s."""
        loop, left = asyncio.get_running_loop(), LINGER_BYTES
        deadline = loop.time() + LINGER
        try:
            while left > 0 and (wait := deadline - loop.time()) > 0:
                data = await asyncio.wait_for(self.reader.read(READ_SIZE), wait)
                if not data:
                    return
                left -= len(data)
        except (asyncio.TimeoutError, ConnectionError):
            pass

    def no_more_requests(self) -> None:
        """This connection closes after the present response: what was read past it is dropped."""
        self.spoilt = True
        self.trailing = b""

    async def watch(self, job: Job | None = None) -> None:
        """End-of-file on the request side means the client closed: stop its job at once.
        (A client that half-closes after its request looks the same: see the README.) Bytes
        that arrive meanwhile are the next request's, pipelined: kept, up to PIPELINED_KEEP
        (none after a stream's head: its connection carries no more requests)."""
        try:
            while data := await self.reader.read(READ_SIZE):
                if self.spoilt:  # no more requests on it: keep reading only for the end
                    continue
                self.trailing += data
                if len(self.trailing) > PIPELINED_KEEP:
                    self.no_more_requests()
        except ConnectionError:
            pass
        self.gone = True
        if job is not None:
            job.stop.set()
