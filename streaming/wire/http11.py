"""HTTP/1.1 requests and responses over bytes, with limits, and the one error type.

`RequestParser` is an incremental reader in the manner of h11: feed it bytes, ask for the next
request, and it answers a `Request` or None ("need more data"); what follows the request stays in
`trailing`. It parses the request line and headers (RFC 9112 §2-5), reads a Content-Length body
(§6.3), and raises `ProtocolError` with the status a client should get: 400 malformed, 411 for
Transfer-Encoding, 413 too large, 431 headers too large, 505 another HTTP version.
`head()` writes every response head and `response()` a whole response, each saying whether the
connection stays open (the caller decides: the server's exchange.py keeps a connection open after
a response with a length; what follows a request in the parser's `trailing` is the next,
pipelined); `request_head()` writes a request's. The client side mirrors it: `ResponseReader`
takes a response's bytes and returns its head, then its body's data, framed by Content-Length,
chunked transfer coding (`ChunkedDecoder`) or the end of the connection, then `END`.

No I/O here: the server and the clients read and write. Leaves out: chunked
request bodies (411 asks for a Content-Length instead), absolute-form targets and obsolete line
folding (both 400).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from streaming.wire.errors import ProtocolError

# Limits, each with the status a client gets past it.
MAX_HEAD = 16 * 1024  # request line + headers: 431. Browsers send 1-2 KB; 16 KiB leaves room for cookies.
MAX_BODY = 1024 * 1024  # Content-Length body: 413. A prompt of 1 MiB is ~250k tokens, past any context here.
REQUEST_TIMEOUT = 10.0  # seconds to receive a whole request: 408. Stops slow-loris clients holding sockets.
EMPTY_LINES = 8  # empty lines ignored before a request line (RFC 9112 §2.2: at least one): past it, 400

DIGITS = re.compile(r"[0-9]{1,15}")  # a Content-Length: ASCII digits (str.isdigit takes "²"), 15 is past any limit
TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 §5.6.2: method and field names
HEAD_END = re.compile(rb"\r?\n\r?\n")  # a bare LF is accepted as a line end (RFC 9112 §2.2)


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]  # lower-case name -> value; repeated fields joined with ", " (RFC 9110 §5.3)
    body: bytes = b""
    path: str = ""
    query: dict[str, str] = field(default_factory=dict)  # name -> last value

    def json(self) -> dict[str, Any]:
        """The body as a JSON object, or a 400 that says what is wrong with it."""
        return json_object(self.body, "the body")


def json_object(data: bytes | str, what: str) -> dict[str, Any]:
    """`data` as a JSON object, or a ProtocolError (400; close 1008 on a WebSocket) that says what
    is wrong: not UTF-8, not JSON, nested too deeply, a number of too many digits."""
    value = json_value(data, what)
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object", 400, close_code=1008, kind="invalid_json")
    return value


def json_value(data: bytes | str, what: str) -> Any:
    """Any JSON value, with json_object's errors."""

    def fail(problem: str) -> ProtocolError:
        return ProtocolError(f"{what} is not valid JSON: {problem}", 400, close_code=1008, kind="invalid_json")

    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError:
            raise fail("it is not UTF-8") from None
    try:
        return json.loads(data)
    except json.JSONDecodeError as e:
        raise fail(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # the parser recurses once per level of [ and {
        raise fail("arrays or objects nested too deeply") from None
    except ValueError:  # Python's limit on the digits of an integer (4,300)
        raise fail("a number has too many digits") from None


class RequestParser:
    """Bytes in, one Request out. After it, `trailing` holds any bytes that followed."""

    def __init__(self, max_head: int = MAX_HEAD, max_body: int = MAX_BODY) -> None:
        self.buffer = bytearray()
        self.max_head, self.max_body = max_head, max_body
        self.head: Request | None = None  # the Request once its head is parsed, before its body is complete
        self.trailing = b""
        self.scanned = 0  # where the search for the blank line resumes: feeding byte by byte stays linear
        self.empty_lines = 0  # skipped before this request's line

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next_request(self) -> Request | None:
        """A complete Request, or None if more bytes are needed. Raises ProtocolError."""
        if self.head is None:
            if not self.skip_empty_lines():
                return None
            end = HEAD_END.search(self.buffer, self.scanned, self.max_head + 4)
            if end is None:
                if len(self.buffer) > self.max_head:
                    raise ProtocolError(f"request head over {self.max_head} bytes", 431)
                self.scanned = max(0, len(self.buffer) - 3)
                return None
            self.scanned = 0
            self.head = parse_fields(bytes(self.buffer[: end.start()]))  # (kept if its framing is refused:
            framing(self.head, self.max_body)  # the error is said in its endpoint's shape)
            del self.buffer[: end.end()]
        length = int(self.head.headers.get("content-length", "0"))
        if len(self.buffer) < length:
            return None
        request, self.head = self.head, None
        request.body, self.trailing = bytes(self.buffer[:length]), bytes(self.buffer[length:])
        self.buffer.clear()
        return request

    def skip_empty_lines(self) -> bool:
        """Drop the empty lines a client may send before a request line (a CRLF after the last
        request's body, RFC 9112 §2.2); whether something else has arrived."""
        while self.buffer and self.buffer[0] in b"\r\n":
            if self.buffer.startswith(b"\r\n"):
                del self.buffer[:2]
            elif self.buffer[0] == 0x0A:  # a bare LF ends a line too (§2.2)
                del self.buffer[:1]
            elif len(self.buffer) == 1:
                return False  # a lone CR: its LF may follow
            else:
                raise ProtocolError("malformed request line", 400)
            self.empty_lines += 1
            if self.empty_lines > EMPTY_LINES:
                raise ProtocolError("empty lines instead of a request", 400)
        return bool(self.buffer)

    def expects_continue(self) -> bool:
        """Whether the client waits for `100 Continue` before sending its body (RFC 9110 §10.1.1:
        an HTTP/1.0 client's expectation is ignored, as it knows no interim responses)."""
        head = self.head
        return (
            head is not None and head.version == "HTTP/1.1" and head.headers.get("expect", "").lower() == "100-continue"
        )


def parse_head(head: bytes, max_body: int = MAX_BODY) -> Request:
    """Parse a request line and header fields (without the blank line) into a Request."""
    return framing(parse_fields(head), max_body)


def parse_fields(head: bytes) -> Request:
    """A Request of the request line and header fields, their framing not yet checked."""
    lines = head.replace(b"\r\n", b"\n").split(b"\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not TOKEN.match(parts[0]) or not parts[1]:
        raise ProtocolError("malformed request line", 400)
    method, target, version = parts
    if not re.fullmatch(rb"HTTP/\d\.\d", version):
        raise ProtocolError("malformed HTTP version", 400)
    if version not in (b"HTTP/1.1", b"HTTP/1.0"):
        raise ProtocolError(f"{version.decode()} is not supported; speak HTTP/1.1", 505)
    if not target.startswith(b"/") or any(c < 0x21 or c == 0x7F for c in target):
        raise ProtocolError("the request target must be a path (origin-form)", 400)
    headers: dict[str, str] = {}
    hosts = 0
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t"):
            raise ProtocolError("obsolete line folding in a header field", 400)
        name, colon, value = line.partition(b":")
        if not colon or not TOKEN.match(name):  # includes whitespace before the colon (§5.1)
            raise ProtocolError(f"malformed header field {line[:40]!r}", 400)
        if any(c < 0x20 and c != 0x09 or c == 0x7F for c in value):
            raise ProtocolError("control character in a header value", 400)
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        hosts += key == "host"
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if version == b"HTTP/1.1" and "host" not in headers:
        raise ProtocolError("HTTP/1.1 requires a Host header", 400)  # RFC 9112 §3.2
    if hosts > 1:
        raise ProtocolError("more than one Host header", 400)  # RFC 9112 §3.2: a 400
    try:
        url = urlsplit(target.decode("latin-1"))
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
    except ValueError:  # e.g. "//[" reads as an unclosed IPv6 authority
        raise ProtocolError("malformed request target", 400) from None
    return Request(
        method.decode("ascii"), target.decode("latin-1"), version.decode(), headers, path=url.path, query=query
    )


def framing(request: Request, max_body: int) -> Request:
    """The request, its body's framing checked: a Content-Length (normalized) within max_body."""
    headers = request.headers
    if "transfer-encoding" in headers:
        if "content-length" in headers:  # the classic request-smuggling ambiguity (RFC 9112 §6.3)
            raise ProtocolError("both Transfer-Encoding and Content-Length", 400)
        raise ProtocolError("send the body with a Content-Length, not Transfer-Encoding", 411)
    if "content-length" in headers:
        lengths = {v.strip() for v in headers["content-length"].split(",")}
        given = lengths.pop() if len(lengths) == 1 else ""
        if given.isascii() and given.isdigit() and len(given) > 15:
            raise ProtocolError(f"a Content-Length of {len(given)} digits is over the limit of {max_body} bytes", 413)
        if not DIGITS.fullmatch(given):
            raise ProtocolError("invalid Content-Length", 400)
        length = int(given)
        if length > max_body:
            raise ProtocolError(f"body of {length} bytes is over the limit of {max_body}", 413)
        headers["content-length"] = str(length)
    return request


def head(status: int, headers: Iterable[tuple[str, str]] = (), keep_alive: bool | None = None) -> bytes:
    """A response's status line and header fields, ended by the blank line (RFC 9112 §4, §5).
    `keep_alive` says what becomes of the connection after it: True `Connection: keep-alive`,
    False `Connection: close`, None neither (a 101 names its own: Upgrade)."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{k}: {v}" for k, v in headers)]
    if keep_alive is not None:
        lines.append(f"Connection: {'keep-alive' if keep_alive else 'close'}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def request_head(method: str, target: str, host: str, headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """A request's line and header fields (RFC 9112 §3): every request head the clients here
    send (streaming/http_client.py, client.py, and websocket.client_handshake's upgrade)."""
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def response(
    status: int,
    body: bytes = b"",
    content_type: str | None = "application/json",
    headers: Iterable[tuple[str, str]] = (),
    keep_alive: bool = False,
) -> bytes:
    """A whole response, its body framed by its length, so the connection may stay open
    (`keep_alive`, decided by the server's exchange) or close (the default, as the article's)."""
    fields = [("Content-Type", content_type)] if content_type else []
    if status != 204:  # a 204 has no body and must not say how long it is (RFC 9110 §8.6)
        fields.append(("Content-Length", str(len(body))))
    return head(status, [*fields, *headers], keep_alive) + body


def json_response(status: int, value: Any, headers: Iterable[tuple[str, str]] = (), keep_alive: bool = False) -> bytes:
    return response(status, json.dumps(value).encode(), headers=headers, keep_alive=keep_alive)


MAX_CHUNK_LINE = 4096  # a chunk-size line with extensions, or a trailer line: past it the peer is broken


class ChunkedDecoder:
    """A chunked body (RFC 9112 §7.1) in, its data out, incrementally: `feed(bytes)` returns the
    data those bytes completed; `done` once the last chunk and trailer section have arrived, and
    `trailing` holds whatever followed. Proxies such as nginx send a stream to an HTTP/1.1 client
    this way. Raises ProtocolError on a malformed chunk. Trailer fields are read and dropped."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.remaining: int | None = None  # data bytes left in the current chunk; None: a size line is next
        self.crlf = False  # the CRLF after a chunk's data is next
        self.trailer = False  # after the last chunk: trailer lines until an empty one
        self.done = False
        self.trailing = b""

    def feed(self, data: bytes) -> bytes:
        if self.done:
            self.trailing += data
            return b""
        self.buffer += data
        out = bytearray()
        while not self.done:
            if self.remaining:
                take = bytes(self.buffer[: self.remaining])
                del self.buffer[: len(take)]
                out += take
                self.remaining -= len(take)
                if self.remaining:
                    break
                self.crlf = True
            line = self.line()
            if line is None:
                break
            if self.crlf:
                if line:
                    raise ProtocolError("chunk data longer than its size", 400)
                self.crlf, self.remaining = False, None
            elif self.trailer:
                if not line:
                    self.done, self.trailing = True, bytes(self.buffer)
                    self.buffer.clear()
            else:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or not all(c in b"0123456789abcdefABCDEF" for c in size) or len(size) > 15:
                    shown = line[:40].decode("latin-1")  # told as text, not as Python's b'...'
                    raise ProtocolError(f"malformed chunk size {shown!r}", 400)
                self.remaining = int(size, 16)
                self.trailer = self.remaining == 0
        return bytes(out)

    def line(self) -> bytes | None:
        """The next line without its CRLF (a bare LF is accepted), or None if it has not arrived."""
        end = self.buffer.find(b"\n")
        if end < 0:
            if len(self.buffer) > MAX_CHUNK_LINE:
                raise ProtocolError("chunk line too long", 400)
            return None
        line = bytes(self.buffer[:end]).removesuffix(b"\r")
        del self.buffer[: end + 1]
        return line


# --- the client side: one response's head and body ---------------------------------------------


@dataclass(frozen=True)
class Response:
    """A response's head: status and lower-case header fields (repeated ones joined)."""

    status: int
    headers: dict[str, str]


class _End:
    def __repr__(self) -> str:
        return "END"


END = _End()  # the body is complete (ResponseReader.next_event)
MAX_RESPONSE_HEAD = 64 * 1024  # a response head past this is a broken or hostile peer
MAX_INTERIM = 16  # interim (1xx) responses read past before the final one: more is a hostile peer


class ResponseReader:
    """Bytes of one response in; events out, in the manner of h11's readers: `next_event()`
    returns the `Response` head, then body data (`bytes`) as it arrives, then `END`; None means
    "need more data". The body is framed by chunked transfer coding, a Content-Length, or the end
    of the connection (`feed_eof()`); a 101, 204 or 304 has none (RFC 9112 §6.3). `trailing`
    holds whatever followed the response (a WebSocket's first frames after a 101). Interim
    responses (100 Continue, 103 Early Hints) are read past (RFC 9110 §15.2: a client MUST)."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.interim = 0
        self.response: Response | None = None
        self.chunked: ChunkedDecoder | None = None
        self.remaining: int | None = None  # Content-Length bytes still to come; None: until close
        self.eof = self.ended = False
        self.trailing = b""
        self.scanned = 0  # where the search for the head's end resumes (RequestParser's reason)

    def feed(self, data: bytes) -> None:
        if self.ended:
            self.trailing += data
        else:
            self.buffer += data

    def feed_eof(self) -> None:
        self.eof = True

    def next_event(self) -> Response | bytes | _End | None:
        if self.ended:
            return None
        if self.response is None:
            return self._head()
        if self.chunked is not None:
            data = self.chunked.feed(bytes(self.buffer))
            self.buffer.clear()
            if self.chunked.done:
                return self._end(self.chunked.trailing) if not data else data
            if not data and self.eof:
                raise ProtocolError("the connection closed inside a chunked body")
            return data or None
        if self.remaining is not None:
            data = bytes(self.buffer[: self.remaining])
            del self.buffer[: len(data)]
            self.remaining -= len(data)
            if data:
                return data
            if self.remaining == 0:
                return self._end(bytes(self.buffer))
            if self.eof:
                raise ProtocolError("the connection closed before the whole body arrived")
            return None
        if self.buffer:
            data = bytes(self.buffer)
            self.buffer.clear()
            return data
        return self._end(b"") if self.eof else None

    def _head(self) -> Response | _End | None:
        end = HEAD_END.search(self.buffer, self.scanned, MAX_RESPONSE_HEAD + 4)
        if end is None:
            if len(self.buffer) > MAX_RESPONSE_HEAD:
                raise ProtocolError(f"response head over {MAX_RESPONSE_HEAD} bytes")
            if self.eof:
                raise ProtocolError("the connection closed before a response")
            self.scanned = max(0, len(self.buffer) - 3)  # (a blank line may straddle this read and the next)
            return None
        self.scanned = 0
        lines = bytes(self.buffer[: end.start()]).decode("latin-1").replace("\r\n", "\n").split("\n")
        del self.buffer[: end.end()]
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not re.fullmatch("[0-9]{3}", parts[1]):
            raise ProtocolError(f"malformed status line {lines[0][:40]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon:
                raise ProtocolError(f"malformed header field {line[:40]!r}")
            key = name.strip().lower()
            headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
        status = int(parts[1])
        if 100 <= status < 200 and status != 101:  # interim: the final response follows
            self.interim += 1
            if self.interim > MAX_INTERIM:
                raise ProtocolError(f"more than {MAX_INTERIM} interim responses")
            return self._head()
        self.response = Response(status, headers)
        if status in (101, 204, 304):
            self.remaining = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self.chunked = ChunkedDecoder()
        elif DIGITS.fullmatch(headers.get("content-length", "")):
            self.remaining = int(headers["content-length"])
        return self.response

    def _end(self, rest: bytes) -> _End:
        self.ended, self.trailing = True, rest + self.trailing
        self.buffer.clear()
        return END
