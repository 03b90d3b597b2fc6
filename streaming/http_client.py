"""An HTTP/1.1 client on asyncio over the wire layer: the upstream relay's and client.py's.

`connect(url)` opens a connection (TLS for https), `request_bytes` writes a request with
`http11.request_head`, and `Reply` reads the response as it arrives through
`http11.ResponseReader`: its head, then its body's data (Content-Length, chunked, or until the
connection closes), then the end, counting every byte received (headers included, for the
article's figures), each read within `read_timeout` if one is given. Errors are the caller's to
name: a broken answer raises the parser's ProtocolError, silence asyncio.TimeoutError, a broken
connection OSError (`failure(e)` says it in words). Leaves out: keep-alive (one request a
connection: every request here says `Connection: close`), redirects, proxies and HTTP/2.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator, Iterable
from urllib.parse import SplitResult

from streaming.wire import http11
from streaming.wire.http11 import END, Response, ResponseReader

READ_SIZE = 65536


def failure(e: OSError) -> str:
    """What went wrong with a connection (or a listening socket), in the system's words for its
    errno ("Connection refused", "Address already in use"): asyncio's own message names the
    address ("Connect call failed ('10.0.0.5', 8000)", "error while attempting to bind on ...").
    A name that does not resolve and a TLS failure have errnos of their own kind, which strerror
    does not know ("Unknown error -2", "Operation not permitted")."""
    if isinstance(e, socket.gaierror):
        return f"its name does not resolve ({e.strerror})"
    if isinstance(e, ssl.SSLError):
        return f"TLS failed ({e.reason or type(e).__name__})"
    return os.strerror(e.errno) if e.errno else type(e).__name__


async def connect(url: SplitResult, timeout: float | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the URL's host and port (TLS for https), within `timeout` seconds."""
    tls = ssl.create_default_context() if url.scheme == "https" else None
    port = url.port or (443 if tls else 80)
    opening = asyncio.open_connection(url.hostname, port, ssl=tls, server_hostname=url.hostname if tls else None)
    return await asyncio.wait_for(opening, timeout)


def request_bytes(
    method: str, target: str, host: str, fields: Iterable[tuple[str, str]] = (), body: bytes | None = None
) -> bytes:
    """A whole request: its head (with Connection: close and, for a body, its length), then the body."""
    fields = [*fields, ("Connection", "close")]
    if body is not None:
        fields.append(("Content-Length", str(len(body))))
    return http11.request_head(method, target, host, fields) + (body or b"")


class Reply:
    """One response as it arrives on a connection (see the module's docstring)."""

    def __init__(self, reader: asyncio.StreamReader, read_timeout: float | None = None) -> None:
        self.reader, self.read_timeout = reader, read_timeout
        self.parser, self.received = ResponseReader(), 0

    async def next(self) -> Response | bytes | object:
        """The parser's next event (the head, body data, or END), reading as needed."""
        while (event := self.parser.next_event()) is None:
            chunk = await asyncio.wait_for(self.reader.read(READ_SIZE), self.read_timeout)
            self.received += len(chunk)
            if chunk:
                self.parser.feed(chunk)
            else:
                self.parser.feed_eof()
        return event

    async def read_head(self) -> Response:
        event = await self.next()
        assert isinstance(event, Response)  # the reader gives the head first
        return event

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's data as it arrives, until its end."""
        while (event := await self.next()) is not END:
            assert isinstance(event, bytes)
            yield event

    async def body(self, limit: int | None = None) -> bytes:
        """The body, or its first `limit` bytes (then reading stops)."""
        out = b""
        async for data in self.chunks():
            out += data
            if limit is not None and len(out) >= limit:
                return out[:limit]
        return out
