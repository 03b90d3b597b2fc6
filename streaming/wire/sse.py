"""Server-sent events over bytes: the encoder the server uses and the parser clients use.

The text/event-stream format (WHATWG HTML, §9.2 "Server-sent events"): an event is `field: value`
lines ended by a blank line; `data` lines are joined with newlines; `event` names the type, `id`
sets the last event id, `retry` the reconnection time; a line starting with `:` is a comment (the
keep-alive ping). Lines end in CRLF, LF or CR.

`EventParser` is incremental, as the spec's own algorithm: feed it any slice of the stream (byte
by byte if you like) and it returns the events completed so far. No I/O here. Every event any
endpoint sends is built by `event()`; `RESPONSE_FIELDS` are the header fields of every stream's
response. Leaves out the EventSource reconnection behaviour, which is the client's business.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

from streaming.wire.errors import ProtocolError

# The head of every event-stream response: no caching, and `X-Accel-Buffering: no`, which nginx
# (and proxies that copy it) honor to pass each event on at once instead of buffering.
RESPONSE_FIELDS = [
    ("Content-Type", "text/event-stream"),
    ("Cache-Control", "no-cache"),
    ("X-Accel-Buffering", "no"),
]  # (and `Connection: close`, which head() writes: a stream's body ends with its connection)


def event(data: str, event: str | None = None, id: str | None = None) -> bytes:
    """One event. Multi-line data becomes several data lines, which the parser joins back."""
    out = []
    if event is not None:
        out.append(f"event: {event}\n")
    if id is not None:
        out.append(f"id: {id}\n")
    out += [f"data: {line}\n" for line in data.split("\n")]
    return ("".join(out) + "\n").encode()


DONE = b"data: [DONE]\n\n"  # the end of our streams and OpenAI's: event("[DONE]")


def comment(text: str = "ping") -> bytes:
    """A comment line: ignored by parsers, it keeps idle proxies from closing the connection."""
    return f": {text}\n\n".encode()


@dataclass
class Event:
    data: str
    event: str = "message"
    id: str = ""  # the last event id seen, as EventSource reports it
    retry: int | None = None


MAX_EVENT = 1024 * 1024  # characters of one line, and of one event's data: past either, the peer is broken


class EventParser:
    """Bytes of an event stream in, Events out (WHATWG's "interpret an event stream"), each byte
    looked at once however the stream is split. A line or an event's data longer than `max_event`
    characters is a ProtocolError (`status`: what the caller's peer is told, 502 for an upstream's
    stream): a stream must not make its reader hold more than that."""

    def __init__(self, max_event: int = MAX_EVENT, status: int = 502) -> None:
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.max_event, self.status = max_event, status
        self.pending: list[str] = []  # the pieces of an unfinished line
        self.pending_size = 0
        self.after_cr = False  # the last chunk ended in CR: an LF next belongs to it
        self.first = True  # a leading byte-order mark is dropped
        self.data: list[str] = []
        self.data_size = 0
        self.type, self.last_id = "", ""
        self.retry: int | None = None

    def feed(self, data: bytes) -> list[Event]:
        """Feed bytes; return the list of events they completed."""
        text = self.decoder.decode(data)
        if self.first and text:
            text, self.first = text.removeprefix("\ufeff"), False
        if self.after_cr and text:
            text = text.removeprefix("\n")  # (the LF of a CRLF split across two chunks)
            self.after_cr = False
        if not text:
            return []
        self.after_cr = text.endswith("\r")
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        last = lines.pop()  # the unfinished line (or "" after a line end)
        events: list[Event] = []
        for line in lines:
            self.check(self.pending_size + len(line), "a line")
            if self.pending:
                line = "".join(self.pending) + line
                self.pending, self.pending_size = [], 0
            ev = self.line(line)
            if ev is not None:
                events.append(ev)
        if last:
            self.check(self.pending_size + len(last), "a line")
            self.pending.append(last)
            self.pending_size += len(last)
        return events

    def check(self, size: int, what: str) -> None:
        if size > self.max_event:
            raise ProtocolError(f"{what} of an event stream over {self.max_event} characters", self.status)

    def line(self, line: str) -> Event | None:
        if line == "":  # dispatch
            if not self.data:
                self.type = ""
                return None
            ev = Event("\n".join(self.data), self.type or "message", self.last_id, self.retry)
            self.data, self.data_size, self.type = [], 0, ""
            return ev
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self.check(self.data_size + len(value) + 1, "the data of an event")
            self.data.append(value)
            self.data_size += len(value) + 1
        elif name == "event":
            self.type = value
        elif name == "id":
            if "\0" not in value:
                self.last_id = value
        elif name == "retry":
            if value.isascii() and value.isdigit() and len(value) < 10:
                self.retry = int(value)
        return None  # other field names are ignored

    def close(self) -> None:
        """The stream ended: an event without its blank line is discarded, per the spec."""
        self.data, self.data_size, self.type = [], 0, ""
        self.pending, self.pending_size = [], 0
