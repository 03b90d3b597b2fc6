"""RFC 6455 WebSocket over bytes: the opening handshake, frames, messages and close codes.

In the manner of the `websockets` library's frames.py: `Frame` with one `check()` for its
invariants, `serialize()` and an incremental `Parser` with no I/O. The parser takes the bytes a
peer sent and returns control frames and whole messages (fragments reassembled); anything the
RFC forbids raises `ProtocolError` carrying the close code to send (§7.4.1): 1002 protocol
error, 1007 invalid UTF-8, 1009 too big. A server's parser requires masked frames, a client's
refuses them (§5.1). session.py holds the protocol state above the frames (pings, the close
handshake) for both sides.

Leaves out: extensions (permessage-deflate is not negotiated, so any RSV bit is an error) and
subprotocols.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import hashlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Request, head, request_head

GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # §1.3: proves the server understood the handshake
MAX_MESSAGE = 1024 * 1024  # bytes in one message, all fragments together: 1009. Same as an HTTP body.
MAX_CONTROL = 125  # §5.5: control frame payloads fit a 7-bit length
# Fragments of one message: 1009 past it. The bytes are bounded by MAX_MESSAGE, but a million
# one-byte fragments cost a frame header and a parse each; real clients send a handful.
MAX_FRAGMENTS = 1024

CONT, TEXT, BINARY, CLOSE, PING, PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
DATA_OPCODES, CONTROL_OPCODES = {CONT, TEXT, BINARY}, {CLOSE, PING, PONG}

# §7.4.1 and the IANA registry: codes an endpoint may send in a close frame.
SENDABLE = {1000, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 1014}


def accept_key(key: str) -> str:
    """Sec-WebSocket-Accept for a Sec-WebSocket-Key (§4.2.2): base64(SHA-1(key + GUID))."""
    return base64.b64encode(hashlib.sha1((key + GUID).encode()).digest()).decode()


def handshake(request: Request, allowed_origins: Iterable[str] = ()) -> bytes:
    """Check an upgrade request (§4.2.1) and return the 101 response's bytes.

    Raises ProtocolError: 400 for a malformed request, 426 for another protocol version, 403 for
    a browser page from a foreign Origin: browsers apply no CORS to WebSockets and do send the
    user's cookies, so without this check any page could open a socket as the user (§10.2).
    Requests without Origin come from non-browser clients and are accepted.
    """
    h = request.headers
    if request.method != "GET":
        raise ProtocolError("a WebSocket handshake must be a GET", 405, headers=[("Allow", "GET")])
    if request.version == "HTTP/1.0":  # §4.1: "the HTTP version MUST be at least 1.1"
        raise ProtocolError("a WebSocket handshake needs HTTP/1.1", 400)
    if "websocket" not in [v.strip().lower() for v in h.get("upgrade", "").split(",")]:
        raise ProtocolError("missing Upgrade: websocket", 426, headers=[("Upgrade", "websocket")])
    if "upgrade" not in [v.strip().lower() for v in h.get("connection", "").split(",")]:
        raise ProtocolError("missing Connection: Upgrade", 400)
    if h.get("sec-websocket-version", "").strip() != "13":
        raise ProtocolError(
            "unsupported WebSocket version; this server speaks 13", 426, headers=[("Sec-WebSocket-Version", "13")]
        )
    key = h.get("sec-websocket-key", "").strip()
    try:
        valid_key = len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        valid_key = False
    if not valid_key:
        raise ProtocolError("Sec-WebSocket-Key must be 16 bytes in base64", 400)
    origin = h.get("origin")
    if origin is not None and not origin_allowed(origin, h.get("host", ""), allowed_origins):
        raise ProtocolError(f"origin {origin} is not allowed", 403)
    fields = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Accept", accept_key(key))]
    return head(101, fields)


def client_handshake(host: str, key: str, path: str = "/ws", headers: Iterable[tuple[str, str]] = ()) -> bytes:
    """A client's opening handshake (§4.1) with its Sec-WebSocket-Key (`new_key()`)."""
    fields = [("Upgrade", "websocket"), ("Connection", "Upgrade"), ("Sec-WebSocket-Key", key)]
    return request_head("GET", path, host, [*fields, ("Sec-WebSocket-Version", "13"), *headers])


def new_key() -> str:
    return base64.b64encode(os.urandom(16)).decode()


def origin_allowed(origin: str, host: str, allowed: Iterable[str]) -> bool:
    """Our own origin (the page this server serves: same host and port) or one listed. An Origin
    that does not parse (a port past 65535 or not a number, an unclosed IPv6 address) is foreign."""
    if "*" in allowed or origin in allowed:
        return True
    try:
        url = urlsplit(origin)
        if url.scheme not in ("http", "https") or not url.hostname or url.path or url.query:
            return False
        default = 443 if url.scheme == "https" else 80
        return (url.hostname, url.port or default) == authority(host, default)
    except ValueError:
        return False


def authority(host: str, default: int) -> tuple[str, int] | None:
    """(host name, port) of a Host header's value, lower-case, IPv6 without brackets; None if it
    does not parse. Raises nothing."""
    try:
        url = urlsplit("//" + host)
        if not url.hostname or url.username is not None or url.path or url.query or url.fragment:
            return None
        return url.hostname, url.port or default
    except ValueError:
        return None


@dataclass
class Frame:
    opcode: int
    data: bytes = b""
    fin: bool = True
    rsv: int = 0  # the three reserved bits, as a number 0-7

    def check(self) -> None:
        """The invariants of §5.2 and §5.5; raises ProtocolError(1002)."""
        if self.rsv:
            raise ProtocolError("reserved bits set without a negotiated extension", close_code=1002)
        if self.opcode not in DATA_OPCODES | CONTROL_OPCODES:
            raise ProtocolError(f"unknown opcode {self.opcode:#x}", close_code=1002)
        if self.opcode in CONTROL_OPCODES:
            if len(self.data) > MAX_CONTROL:
                raise ProtocolError("control frame over 125 bytes", close_code=1002)
            if not self.fin:
                raise ProtocolError("fragmented control frame", close_code=1002)


def serialize(frame: Frame, mask: bytes | None = None) -> bytes:
    """Frame bytes: FIN, RSV, opcode; MASK bit and a 7-, 16- or 64-bit length (§5.2); the
    masking key and masked payload when `mask` is given (clients must mask, servers must not)."""
    frame.check()
    n = len(frame.data)
    head = bytes([(0x80 if frame.fin else 0) | frame.rsv << 4 | frame.opcode])
    bit = 0x80 if mask is not None else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 1 << 16:
        head += bytes([bit | 126]) + struct.pack("!H", n)
    else:
        head += bytes([bit | 127]) + struct.pack("!Q", n)
    if mask is None:
        return head + frame.data
    return head + mask + apply_mask(frame.data, mask)


def apply_mask(data: bytes, mask: bytes) -> bytes:
    """XOR with the 4-byte key, repeated (§5.3). Done on big integers: fast in pure Python."""
    if not data:
        return b""
    key = (mask * (len(data) // 4 + 1))[: len(data)]
    return (int.from_bytes(data, "big") ^ int.from_bytes(key, "big")).to_bytes(len(data), "big")


def new_mask() -> bytes:
    return os.urandom(4)


def text_frame(message: str, mask: bytes | None = None) -> bytes:
    return serialize(Frame(TEXT, message.encode()), mask)


def close_frame(code: int = 1000, reason: str = "", mask: bytes | None = None) -> bytes:
    return serialize(Frame(CLOSE, close_payload(code, reason)), mask)


def close_payload(code: int, reason: str = "") -> bytes:
    data = reason.encode()[:123]  # 125 bytes of control payload, 2 of them the code
    return struct.pack("!H", code) + data.decode("utf-8", "ignore").encode()


def parse_close(data: bytes) -> tuple[int, str]:
    """(code, reason) of a close frame's payload (§5.5.1, §7.4); 1005 means no code given."""
    if not data:
        return 1005, ""
    if len(data) == 1:
        raise ProtocolError("close frame with a 1-byte payload", close_code=1002)
    (code,) = struct.unpack("!H", data[:2])
    if not (code in SENDABLE or 3000 <= code <= 4999):
        raise ProtocolError(f"invalid close code {code}", close_code=1002)
    try:
        reason = data[2:].decode()
    except UnicodeDecodeError:
        raise ProtocolError("close reason is not UTF-8", close_code=1007) from None
    return code, reason


@dataclass
class Message:
    opcode: int  # TEXT or BINARY
    data: bytes

    def text(self) -> str:
        return self.data.decode()


class Parser:
    """Bytes from a peer in; control Frames and whole Messages out, in order.

    `mask_required` is True on a server: §5.1 says a server MUST close on an unmasked frame.
    """

    def __init__(self, mask_required: bool = True, max_message: int = MAX_MESSAGE) -> None:
        self.buffer = bytearray()
        self.mask_required, self.max_message = mask_required, max_message
        self.fragments = bytearray()  # the message so far: its bytes, never more than max_message
        self.fragment_opcode: int | None = None
        self.fragment_count = 0
        self.utf8: codecs.IncrementalDecoder | None = None  # validates the text message being reassembled

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next_frame(self) -> Frame | None:
        """One frame off the buffer, unmasked, or None if it is not all here yet."""
        b = self.buffer
        if len(b) < 2:
            return None
        fin, rsv, opcode = bool(b[0] & 0x80), (b[0] >> 4) & 0x7, b[0] & 0x0F
        masked, n, i = bool(b[1] & 0x80), b[1] & 0x7F, 2
        Frame(opcode, fin=fin, rsv=rsv).check()  # fail on the header, before any payload arrives
        if n == 126:
            if len(b) < 4:
                return None
            (n,) = struct.unpack_from("!H", b, 2)
            i = 4
        elif n == 127:
            if len(b) < 10:
                return None
            (n,) = struct.unpack_from("!Q", b, 2)
            if n >> 63:
                raise ProtocolError("64-bit length with its top bit set", close_code=1002)
            i = 10
        if opcode in CONTROL_OPCODES and n > MAX_CONTROL:
            raise ProtocolError("control frame over 125 bytes", close_code=1002)
        if opcode in DATA_OPCODES and len(self.fragments) + n > self.max_message:
            raise ProtocolError(f"message over {self.max_message} bytes", close_code=1009)
        if self.mask_required and not masked:
            raise ProtocolError("client frames must be masked", close_code=1002)
        if not self.mask_required and masked:
            raise ProtocolError("server frames must not be masked", close_code=1002)
        if len(b) < i + (4 if masked else 0) + n:
            return None
        mask = bytes(b[i : i + 4]) if masked else None
        i += 4 if masked else 0
        data = bytes(b[i : i + n])
        del b[: i + n]
        return Frame(opcode, apply_mask(data, mask) if mask is not None else data, fin, rsv)

    def next(self) -> Frame | Message | None:
        """The next control Frame or whole Message, or None if more bytes are needed."""
        while (frame := self.next_frame()) is not None:
            if frame.opcode in CONTROL_OPCODES:
                if frame.opcode == CLOSE:
                    parse_close(frame.data)  # validate now: a bad close is a protocol error
                return frame
            if frame.opcode == CONT:
                if self.fragment_opcode is None:
                    raise ProtocolError("continuation frame without a message to continue", close_code=1002)
            elif self.fragment_opcode is not None:
                raise ProtocolError("new data frame in the middle of a fragmented message", close_code=1002)
            else:
                self.fragment_opcode = frame.opcode
                self.utf8 = codecs.getincrementaldecoder("utf-8")() if frame.opcode == TEXT else None
            self.fragment_count += 1
            if self.fragment_count > MAX_FRAGMENTS:
                raise ProtocolError(f"message in over {MAX_FRAGMENTS} fragments", close_code=1009)
            self.fragments += frame.data
            if self.utf8 is not None:
                try:  # fail fast on invalid UTF-8, even before the last fragment (§8.1)
                    self.utf8.decode(frame.data, final=frame.fin)
                except UnicodeDecodeError:
                    raise ProtocolError("text message is not valid UTF-8", close_code=1007) from None
            if frame.fin:
                message = Message(self.fragment_opcode, bytes(self.fragments))
                self.fragments, self.fragment_opcode, self.fragment_count, self.utf8 = bytearray(), None, 0, None
                return message
        return None
