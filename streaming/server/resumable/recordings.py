"""Streams kept for resuming: what `Last-Event-ID` needs a server to remember.

The article's server forgets a stream the moment its connection ends, so a reader whose network
blinks loses the answer (and, without a disconnect check, the server generates it for nobody).
A resumable stream instead records every event it sends, numbered: event k of stream S carries
`id: S.k` (event 0 names the stream, events 1.. are text, the last is `[DONE]` or an error). A
reader that comes back with `Last-Event-ID: S.k` gets events k+1.. from the record, then the live
rest, from the same generation: no token is generated twice.

The record outlives its readers for a while: generation goes on for `grace` seconds after the last
reader left (then it stops, as for any reader who left), and an ended stream is kept for `keep`
seconds, at most `count` of them and `size` bytes of their events. At most `orphans` live streams
may have no reader: past that the oldest stops at once (never a background one), and the engine
admits streams with a reader before those without. An id we never issued, or one forgotten, is
unknown: the server answers 204, which tells EventSource to stop reconnecting, never a silent new
generation.

No I/O here: the pump (pump.py) appends events, the endpoints read them. A recording may also be
a *view*: a stream another replica generates (job None), filled from Redis (takeover.py), which
this replica may take over (`adopt`: then it has a job and grows as its own).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Iterable

from streaming.generation.job import Job
from streaming.wire import sse

KEEP_COUNT = 256  # ended streams kept (and at most KEEP_BYTES of them)
# Ended streams' events kept, all together: an event is its encoded bytes (a Responses API text
# delta ~217, GET /stream's ~60 and more) and EVENT_OVERHEAD besides, so 256 answers of 4,096
# tokens held ~350 MB for --resume-keep; at this bound the oldest ended ones go first.
KEEP_BYTES = 64 * 1024 * 1024
EVENT_OVERHEAD = 125  # sys.getsizeof: a bytes object's header 33, a tuple of one id 48 and the id 28, two list slots 16
KEEP_SECONDS = 300.0  # how long an ended stream can still be resumed: longer than any reconnect
GRACE_SECONDS = 10.0  # how long generation waits for a reader to come back (EventSource retries in ~3 s)
ORPHANS = 16  # live streams without a reader: past it the oldest stops now, not after the grace
RETRY_MS = 1000  # sent as `retry:`: how soon EventSource reconnects after a drop
# A stream id as new_id() makes them (URL-safe base64), or a longer one of the same letters; any
# other value is not one of ours, and is answered as unknown without asking the store.
STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EVENT_NUMBER = re.compile(r"[0-9]{1,9}")  # ASCII digits only: str.isdigit() takes "²", which int() refuses


def new_id() -> str:
    """72 random bits: the id is also what lets a client read or stop the stream, so unguessable."""
    return secrets.token_urlsafe(9)


def valid_id(stream_id: object) -> bool:
    """Whether a value from a request could be one of our stream ids."""
    return isinstance(stream_id, str) and STREAM_ID.fullmatch(stream_id) is not None


def parse_event_id(value: str) -> tuple[str, int] | None:
    """(stream id, event number) from 'S.k', or None if it is not one of ours."""
    stream, dot, number = value.strip().rpartition(".")
    if not dot or not valid_id(stream) or not EVENT_NUMBER.fullmatch(number):
        return None
    return stream, int(number)


class Recording:
    """One resumable stream: its numbered events, whether it ended, and who is reading it."""

    def __init__(self, stream_id: str, job: Job | None) -> None:
        self.id, self.job = stream_id, job  # job None: a view of a stream generated elsewhere
        self.events: list[bytes] = []  # encoded SSE events; events[k] carries `id: {self.id}.{k}`
        self.tokens: list[tuple[int, ...]] = []  # tokens[k]: the token ids event k's text came from
        self.last = False  # the last event is in `events` (it may not be written to Redis yet)
        self.ended_at: float | None = None  # time.monotonic() of the last event
        self.grew = asyncio.Event()  # set (and replaced) whenever an event is added
        self.readers = 0
        self.grace: asyncio.TimerHandle | None = None  # stops generation when nobody came back
        self.read_to = 0  # events any reader has been sent: the furthest one's count
        self.moved = asyncio.Event()  # set (and replaced) whenever read_to grows
        self.background = False  # goes on to its end with no reader (the Responses API's background mode)
        self.size = 0  # bytes its events hold, EVENT_OVERHEAD each included

    def add(self, data: str, event: str | None = None, ids: Iterable[int] = (), last: bool = False) -> None:
        self.append(sse.event(data, event=event, id=f"{self.id}.{len(self.events)}"), ids, last)

    def append(self, encoded: bytes, ids: Iterable[int] = (), last: bool = False) -> None:
        """An event as encoded (a view copies them from Redis)."""
        self.events.append(encoded)
        self.tokens.append(tuple(ids))
        self.size += len(encoded) + EVENT_OVERHEAD
        self.last = self.last or last
        self.grew.set()
        self.grew = asyncio.Event()

    def sent(self, k: int) -> None:
        """A reader has been sent events 0..k-1."""
        if k > self.read_to:
            self.read_to = k
            self.moved.set()
            self.moved = asyncio.Event()

    @property
    def unread(self) -> int:
        """Events no reader has been sent yet."""
        return len(self.events) - self.read_to

    def end(self) -> None:
        self.ended_at = time.monotonic()
        self.grew.set()
        if self.grace is not None:
            self.grace.cancel()

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def answer(self) -> list[int]:
        """The token ids of the answer so far, as its events carry them."""
        return [t for ids in self.tokens for t in ids]

    def adopt(self, job: Job, grace: float | None) -> None:
        """A view becomes this replica's own stream: it generates the rest (takeover.py). If its
        last reader left while it was being taken over, the grace period starts now."""
        self.job = job
        job.orphaned = self.readers == 0
        self.orphaned(grace)

    def attach(self) -> None:
        self.readers += 1
        if self.job is not None:
            self.job.orphaned = False
        if self.grace is not None:
            self.grace.cancel()
            self.grace = None

    def read_elsewhere(self, grace: float, sent: int) -> None:
        """A reader follows this stream on another replica (control.py says so every second,
        with how many events it has been sent): not orphaned, and the grace period counts from now."""
        self.sent(min(sent, len(self.events)))
        if self.job is None or self.ended:
            return
        self.job.orphaned = False
        if self.readers == 0 and self.grace is not None:
            self.grace.cancel()
            self.grace = asyncio.get_running_loop().call_later(grace, self.job.stop.set)

    def detach(self, grace: float | None) -> None:
        """A reader left. If it was the last and the stream is live, stop generating after `grace`
        seconds unless a reader comes back (None: never stop, the naive server)."""
        self.readers -= 1
        if self.job is None:
            return
        self.job.orphaned = self.readers == 0  # the engine serves streams with a reader first
        self.orphaned(grace)

    def orphaned(self, grace: float | None) -> None:
        """Nobody reads it: unless it is a background stream, generation stops after `grace` s."""
        if self.job is not None and self.readers == 0 and not self.ended and grace is not None and not self.background:
            self.grace = asyncio.get_running_loop().call_later(grace, self.job.stop.set)


class Recordings:
    """The recordings by stream id, bounded in count and age (only ended ones are dropped: a live
    stream is bounded by its generation). Nobody else touches the dict: these are its methods."""

    def __init__(
        self, count: int = KEEP_COUNT, seconds: float = KEEP_SECONDS, orphans: int = ORPHANS, size: int = KEEP_BYTES
    ) -> None:
        self.count, self.seconds, self.orphans, self.size = count, seconds, orphans, size
        self._by_id: OrderedDict[str, Recording] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, stream_id: str) -> bool:
        return stream_id in self._by_id

    def create(self, job: Job) -> Recording:
        self.purge()
        rec = Recording(new_id(), job)
        self._by_id[rec.id] = rec
        return rec

    def get(self, stream_id: str) -> Recording | None:
        return self._by_id.get(stream_id)

    def add_view(self, rec: Recording) -> None:
        """A view of a stream another replica generates (takeover.py)."""
        self._by_id[rec.id] = rec

    def drop(self, stream_id: str) -> None:
        self._by_id.pop(stream_id, None)

    def find(self, event_id: str) -> tuple[Recording, int] | None:
        """(recording, k) for a Last-Event-ID we can resume after, or None: unknown, forgotten,
        or naming the stream's last event (nothing follows it)."""
        self.purge()
        parsed = parse_event_id(event_id)
        if parsed is None or (rec := self._by_id.get(parsed[0])) is None:
            return None
        k = parsed[1]
        if k >= len(rec.events) or (rec.ended and k == len(rec.events) - 1):
            return None
        return rec, k

    def limit_orphans(self) -> None:
        """Stop the oldest live streams that nobody reads, past `orphans` of them: a burst of
        abandoned streams must not delay the streams people are reading."""
        # (a background stream goes on to its end, read or not: the engine's admission bounds those)
        live = [
            r for r in self._by_id.values() if not r.ended and r.readers == 0 and r.job is not None and not r.background
        ]
        for rec in live[: max(0, len(live) - self.orphans)]:
            assert rec.job is not None
            rec.job.stop.set()

    def purge(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        ended = [(s, rec.ended_at, rec.size) for s, rec in self._by_id.items() if rec.ended_at is not None]
        held = sum(size for _, _, size in ended)
        for i, (s, at, size) in enumerate(ended):  # (in the order they were made: the oldest first)
            if i < len(ended) - self.count or now - at > self.seconds or held > self.size:
                del self._by_id[s]
                held -= size
