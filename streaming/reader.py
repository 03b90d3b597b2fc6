"""A reader of a resumable stream that comes back after a drop, as EventSource does, measured.

`read(port, target)` sends GET target (a /stream?prompt=... query), reads the SSE events, and
whenever the connection ends without the stream's end ([DONE] or an error event) connects again
with `Last-Event-ID` set to the last event's id, until the end, a 204 (nothing to resume), or
`patience` seconds without an event (EventSource would try for ever). It records every event with its number, so a caller can check that the
pieces joined have no gap and no repeat, and how long each reconnection left the reader waiting
(from the drop to the next event). Blocking sockets, one reader a thread: the experiments run
16 of them at once. Built on the project's own parsers (ResponseReader, sse.EventParser).

`drop_after(n)` as `on_event` makes the reader itself drop the connection after n events, once.
Leaves out: TLS, redirects, and `retry:` (it reconnects after RETRY seconds).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import END, ResponseReader, request_head
from streaming.wire.sse import Event, EventParser

RETRY = 0.2  # seconds before connecting again (EventSource waits the server's `retry:`, 1 s here)
READ_TIMEOUT = 60.0  # a connection silent this long is dropped (the server pings well within it)


@dataclass
class Reading:
    """What one reader got: events as (number, Event), in arrival order."""

    stream: str | None = None
    events: list[tuple[int, Event]] = field(default_factory=list)
    connections: int = 0
    waits: list[float] = field(default_factory=list)  # seconds from each drop to the next event
    ended: str | None = None  # "done", "error", "204" or "gave up"
    statuses: list[int] = field(default_factory=list)

    @property
    def numbers(self) -> list[int]:
        return [k for k, _ in self.events]

    @property
    def text(self) -> str:
        return "".join(
            json.loads(e.data)["text"] for _, e in self.events if e.event == "message" and e.data != "[DONE]"
        )

    @property
    def lost(self) -> int:
        """Event numbers that never arrived, before the last one that did."""
        got = set(self.numbers)
        return sum(k not in got for k in range(max(got) + 1)) if got else 0

    @property
    def repeated(self) -> int:
        return len(self.numbers) - len(set(self.numbers))


def drop_after(n: int) -> Callable[[Reading], bool]:
    """An on_event that drops the connection once, after the n-th event."""
    dropped: list[bool] = []

    def check(reading: Reading) -> bool:
        if not dropped and len(reading.events) >= n:
            dropped.append(True)
            return True
        return False

    return check


def read(
    port: int,
    target: str,
    patience: float = 30.0,
    on_event: Callable[[Reading], bool] | None = None,
    host: str = "127.0.0.1",
    resume: int | None = None,
    last: str | None = None,
) -> Reading:
    """Follow a resumable stream through drops; `on_event(reading)` returning True drops the
    connection then (a test's network blink). `resume`: the port to come back to (another
    replica; default `port`); `last`: begin as a reader coming back after that event id."""
    r = Reading()
    dropped_at: float | None = None
    while dropped_at is None or time.monotonic() - dropped_at < patience:
        r.connections += 1
        at = port if r.connections == 1 else (resume or port)
        fields = [("Accept", "text/event-stream"), *([("Last-Event-ID", last)] if last else [])]
        try:
            with socket.create_connection((host, at), timeout=READ_TIMEOUT) as s:
                s.sendall(request_head("GET", target, f"{host}:{at}", fields))
                status, last, dropped_at = follow(s, r, last, dropped_at, on_event)
        except OSError:
            status = 0
        if r.ended is not None:
            return r
        if status == 204:
            r.ended = "204"
            return r
        dropped_at = dropped_at or time.monotonic()
        time.sleep(RETRY)
    r.ended = "gave up"
    return r


def follow(s, r: Reading, last, dropped_at, on_event):
    """One connection: its status, the last event id, and when the stream dropped (None if an
    event came since)."""
    reader, parser, status = ResponseReader(), EventParser(), 0
    while True:
        try:
            item = reader.next_event()
        except ProtocolError:  # closed before a response, a body cut short, bytes not HTTP: a drop
            return status, last, dropped_at
        if item is None:
            if reader.eof:
                return status, last, dropped_at
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if data:
                reader.feed(data)
            else:
                reader.feed_eof()
            continue
        if item is END:
            return status, last, dropped_at
        if not isinstance(item, bytes):
            status = item.status  # type: ignore[union-attr]  # (END was handled above)
            r.statuses.append(status)
            continue
        for ev in parser.feed(item):
            if ev.id is None:
                continue
            stream, _, number = ev.id.rpartition(".")
            if dropped_at is not None:
                r.waits.append(time.monotonic() - dropped_at)
                dropped_at = None
            r.stream, last = stream, ev.id
            r.events.append((int(number), ev))
            if ev.event == "error" or ev.data == "[DONE]":
                r.ended = "done" if ev.data == "[DONE]" else "error"
                return status, last, None
            if on_event is not None and on_event(r):
                return status, last, time.monotonic()
