"""A WebSocket connection after the handshake, for either side, with no I/O (RFC 6455 §5-7).

In the manner of the `websockets` library's protocol.py: the I/O side feeds the bytes it read
(`receive_data`, and `receive_eof` at end-of-file), takes events (`next_event`: a whole `Message`, a ping or
pong `Frame`, or `Closed` once the peer's close frame or end-of-file arrived), and writes
`data_to_send()`. On the way the session answers each ping with a pong carrying the same payload
(§5.5.3) and echoes the peer's close code in a close frame of its own unless it sent one first
(§5.5.1), so a consumer may ignore every Frame event. A client masks every
frame with a fresh random key (§5.3); a server requires masked frames and sends none. The server,
client.py and the tests' raw client all drive this one object.

Leaves out: timeouts (the I/O side decides how long to wait for the peer's close).
"""

from __future__ import annotations

from dataclasses import dataclass

from streaming.wire.websocket import (
    CLOSE,
    MAX_MESSAGE,
    PING,
    PONG,
    Frame,
    Message,
    Parser,
    close_frame,
    close_payload,
    new_mask,
    parse_close,
    serialize,
    text_frame,
)

ABNORMAL = 1006  # §7.1.5: the connection closed without a close frame (never sent on the wire)


@dataclass(frozen=True)
class Closed:
    """The peer's close frame arrived (its code, 1005 if it gave none), or end-of-file (1006)."""

    code: int
    reason: str = ""


class Session:
    def __init__(self, client: bool = False, max_message: int = MAX_MESSAGE) -> None:
        self.client = client
        self.parser = Parser(mask_required=not client, max_message=max_message)
        self.outgoing = bytearray()
        self.close_sent = False
        self.closed: Closed | None = None  # set once the peer closed (frame or end-of-file)
        self.eof = False

    # --- bytes in, events out ------------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the peer."""
        self.parser.feed(data)

    def held(self) -> int:
        """Bytes held of what the peer sends: frames not yet whole, and a message's fragments."""
        return len(self.parser.buffer) + len(self.parser.fragments)

    def receive_eof(self) -> None:
        """The peer's end of the connection closed."""
        self.eof = True

    def next_event(self) -> Message | Frame | Closed | None:
        """The next whole message or ping/pong frame, or Closed once (then None); None: more
        bytes are needed. Raises ProtocolError with the close code to fail the connection with
        (§7.1.7)."""
        if self.closed is not None:
            return None
        while (item := self.parser.next()) is not None:
            if isinstance(item, Message):
                return item
            if item.opcode == PING:
                if not self.close_sent:  # (after our close frame nothing goes out: the pong would follow it)
                    self._write(Frame(PONG, item.data))
                return item
            if item.opcode == CLOSE:
                code, reason = parse_close(item.data)
                if not self.close_sent:  # echo the code (an empty close if the peer gave none)
                    self.close_sent = True
                    self._write(Frame(CLOSE, b"" if code == 1005 else close_payload(code)))
                self.closed = Closed(code, reason)
                return self.closed
            return item  # a pong
        if self.eof:
            self.closed = Closed(ABNORMAL)
            return self.closed
        return None

    # --- what we send --------------------------------------------------------------------------

    def send_text(self, text: str) -> bool:
        """Queue a text message; False once our close frame is sent (§5.5.1: nothing after it)."""
        if self.close_sent:
            return False
        self.outgoing += text_frame(text, self._mask())
        return True

    def send_ping(self, payload: bytes = b"keep-alive") -> bool:
        if self.close_sent:
            return False
        self._write(Frame(PING, payload))
        return True

    def close(self, code: int = 1000, reason: str = "") -> None:
        """Queue our close frame, once."""
        if not self.close_sent:
            self.close_sent = True
            self.outgoing += close_frame(code, reason, self._mask())

    def data_to_send(self) -> bytes:
        data = bytes(self.outgoing)
        self.outgoing.clear()
        return data

    def _write(self, frame: Frame) -> None:
        self.outgoing += serialize(frame, self._mask())

    def _mask(self) -> bytes | None:
        return new_mask() if self.client else None
