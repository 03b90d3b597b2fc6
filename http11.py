"""HTTP/1.1 requests and responses over bytes, with limits, and the one error type.

`RequestParser` is an incremental reader in the manner of h11: feed it bytes, ask for the next
request, and it answers a `Request` or None ("need more data"); what follows the request stays in
`trailing`. It parses the request line and headers (RFC 9112 §2-5), reads a Content-Length body
(§6.3), and raises `ProtocolError` with the status a client should get: 400 malformed, 411 for
Transfer-Encoding, 413 too large, 431 headers too large, 505 another HTTP version.
`response()` and `error_response()` serialize answers; every error body is JSON.

No I/O here: server.py reads and writes. Leaves out: chunked request bodies (411 asks for a
Content-Length instead), keep-alive and pipelining (every response closes the connection, as the
article's does), absolute-form targets and obsolete line folding (both 400).
"""

import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

# Limits, each with the status a client gets past it.
MAX_HEAD = 16 * 1024  # request line + headers: 431. Browsers send 1-2 KB; 16 KiB leaves room for cookies.
MAX_BODY = 1024 * 1024  # Content-Length body: 413. A prompt of 1 MiB is ~250k tokens, past any context here.
REQUEST_TIMEOUT = 10.0  # seconds to receive a whole request: 408. Stops slow-loris clients holding sockets.

TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")  # RFC 9110 §5.6.2: method and field names
HEAD_END = re.compile(rb"\r?\n\r?\n")  # a bare LF is accepted as a line end (RFC 9112 §2.2)


class ProtocolError(Exception):
    """Anything a client got wrong (or we failed at), carrying how to say so.

    `status` is the HTTP status for a response; `close_code` the WebSocket close code (RFC 6455
    §7.4.1) once the connection is a WebSocket. `kind` names the error in the JSON body.
    """

    def __init__(self, message, status=400, close_code=1002, kind=None, headers=()):
        super().__init__(message)
        self.message, self.status, self.close_code = message, status, close_code
        self.kind = kind or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
        self.headers = list(headers)


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict  # lower-case name -> value; repeated fields joined with ", " (RFC 9110 §5.3)
    body: bytes = b""
    path: str = ""
    query: dict = field(default_factory=dict)  # name -> last value

    def json(self):
        """The body as a JSON object, or a 400 that says what is wrong with it."""
        try:
            value = json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProtocolError(f"the body is not valid JSON: {e}", 400, kind="invalid_json") from None
        if not isinstance(value, dict):
            raise ProtocolError("the body must be a JSON object", 400, kind="invalid_json")
        return value


class RequestParser:
    """Bytes in, one Request out. After it, `trailing` holds any bytes that followed."""

    def __init__(self, max_head=MAX_HEAD, max_body=MAX_BODY):
        self.buffer = bytearray()
        self.max_head, self.max_body = max_head, max_body
        self.head = None  # the Request once its head is parsed, before its body is complete
        self.trailing = b""
        self.scanned = 0  # where the search for the blank line resumes: feeding byte by byte stays linear

    def feed(self, data):
        self.buffer += data

    def next_request(self):
        """A complete Request, or None if more bytes are needed. Raises ProtocolError."""
        if self.head is None:
            end = HEAD_END.search(self.buffer, self.scanned, self.max_head + 4)
            if end is None:
                if len(self.buffer) > self.max_head:
                    raise ProtocolError(f"request head over {self.max_head} bytes", 431)
                self.scanned = max(0, len(self.buffer) - 3)
                return None
            self.scanned = 0
            self.head = parse_head(bytes(self.buffer[: end.start()]), self.max_body)
            del self.buffer[: end.end()]
        length = int(self.head.headers.get("content-length", "0"))
        if len(self.buffer) < length:
            return None
        request, self.head = self.head, None
        request.body, self.trailing = bytes(self.buffer[:length]), bytes(self.buffer[length:])
        self.buffer.clear()
        return request

    def expects_continue(self):
        """Whether the client waits for `100 Continue` before sending its body (RFC 9110 §10.1.1)."""
        return self.head is not None and self.head.headers.get("expect", "").lower() == "100-continue"


def parse_head(head, max_body=MAX_BODY):
    """Parse a request line and header fields (without the blank line) into a Request."""
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
    headers = {}
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
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if version == b"HTTP/1.1" and "host" not in headers:
        raise ProtocolError("HTTP/1.1 requires a Host header", 400)  # RFC 9112 §3.2
    if "transfer-encoding" in headers:
        if "content-length" in headers:  # the classic request-smuggling ambiguity (RFC 9112 §6.3)
            raise ProtocolError("both Transfer-Encoding and Content-Length", 400)
        raise ProtocolError("send the body with a Content-Length, not Transfer-Encoding", 411)
    if "content-length" in headers:
        values = {v.strip() for v in headers["content-length"].split(",")}
        if len(values) != 1 or not values.pop().isdigit():
            raise ProtocolError("invalid Content-Length", 400)
        length = int(headers["content-length"].split(",")[0])
        if length > max_body:
            raise ProtocolError(f"body of {length} bytes is over the limit of {max_body}", 413)
        headers["content-length"] = str(length)
    url = urlsplit(target.decode("latin-1"))
    query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
    return Request(
        method.decode("ascii"), target.decode("latin-1"), version.decode(), headers, path=url.path, query=query
    )


def response(status, body=b"", content_type="application/json", headers=()):
    """A whole response that closes the connection (no keep-alive, as the article's server)."""
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if status != 204:  # a 204 has no body and must not say how long it is (RFC 9110 §8.6)
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_response(status, value, headers=()):
    return response(status, json.dumps(value).encode(), headers=headers)


def error_body(err):
    return {"error": {"status": err.status, "type": err.kind, "message": err.message}}


def error_response(err):
    """The one place a ProtocolError becomes an HTTP response: its status, a JSON body (the
    error's own `body` when an API gives errors its own shape, else ours)."""
    return json_response(err.status, getattr(err, "body", None) or error_body(err), headers=err.headers)


MAX_CHUNK_LINE = 4096  # a chunk-size line with extensions, or a trailer line: past it the peer is broken


class ChunkedDecoder:
    """A chunked body (RFC 9112 §7.1) in, its data out, incrementally: `feed(bytes)` returns the
    data those bytes completed; `done` once the last chunk and trailer section have arrived, and
    `trailing` holds whatever followed. Proxies such as nginx send a stream to an HTTP/1.1 client
    this way. Raises ProtocolError on a malformed chunk. Trailer fields are read and dropped."""

    def __init__(self):
        self.buffer = bytearray()
        self.remaining = None  # data bytes left in the current chunk; None: a size line is next
        self.crlf = False  # the CRLF after a chunk's data is next
        self.trailer = False  # after the last chunk: trailer lines until an empty one
        self.done = False
        self.trailing = b""

    def feed(self, data):
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
                    raise ProtocolError(f"malformed chunk size {line[:40]!r}", 400)
                self.remaining = int(size, 16)
                self.trailer = self.remaining == 0
        return bytes(out)

    def line(self):
        """The next line without its CRLF (a bare LF is accepted), or None if it has not arrived."""
        end = self.buffer.find(b"\n")
        if end < 0:
            if len(self.buffer) > MAX_CHUNK_LINE:
                raise ProtocolError("chunk line too long", 400)
            return None
        line = bytes(self.buffer[:end]).removesuffix(b"\r")
        del self.buffer[: end + 1]
        return line
