"""`Streams`: the resumable streams one server holds, in memory or shared through Redis.

The endpoints (endpoints.py) see only this: `open(job)` makes a new stream's recording (event 0
names it, for /stop), starts its pump (pump.py) and, with --store redis://, its mirror;
`find(last_event_id)` is the recording and event to resume after, here or (a view) from Redis;
`stop(id)` stops a stream here or on the replica that generates it; `hand_off()` and `close()`
serve the shutdown. With --store memory a restart forgets every stream; with --store redis://
any replica can resume, follow, stop and take over any stream (store.py, mirror.py, control.py,
takeover.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from streaming.generation.backend import Backend
from streaming.generation.job import Job
from streaming.server.answer import Answers
from streaming.server.resumable.control import Control
from streaming.server.resumable.encodings import Article, Encoding
from streaming.server.resumable.mirror import Mirror
from streaming.server.resumable.pump import pump
from streaming.server.resumable.recordings import Recording, Recordings, parse_event_id
from streaming.server.resumable.store import RedisStore
from streaming.server.resumable.takeover import Takeover


class Replication:
    """The Redis side of a server's streams: one store, and the three jobs done with it."""

    def __init__(
        self,
        url: str,
        keep: float,
        grace: float,
        recordings: Recordings,
        backend: Backend,
        pump: Callable[[Recording, Encoding], None],
        on_error: Callable[[], None] | None = None,
        on_takeover: Callable[[], None] | None = None,
    ) -> None:
        self.store = RedisStore(url, keep, on_error=on_error)
        self.mirror = Mirror(self.store)
        self.control = Control(self.store, recordings, grace)
        self.takeover = Takeover(self.store, recordings, self.mirror, self.control, backend, pump, on_takeover)


class Streams:
    def __init__(self, recordings: Recordings, answers: Answers) -> None:
        self.recordings, self.answers = recordings, answers
        self.replication: Replication | None = None

    def replicate(
        self,
        url: str,
        keep: float,
        grace: float,
        backend: Backend,
        on_error: Callable[[], None] | None = None,
        on_takeover: Callable[[], None] | None = None,
    ) -> None:
        """--store redis://: share these streams with the other replicas through Redis (a stream
        taken over here gets its job from `backend`)."""
        self.replication = Replication(url, keep, grace, self.recordings, backend, self.pump, on_error, on_takeover)

    def start(self, port: int) -> None:
        """Once the server listens: this replica's name gets its port, and the Redis tasks begin."""
        if self.replication is not None:
            store = self.replication.store
            store.name = f"{store.name}:{port}"
            self.replication.control.start()
            self.replication.mirror.start()

    def open(self, job: Job, encoding: Callable[[str], Encoding] | None = None, path: str = "/stream") -> Recording:
        """A new stream of `job`, recorded in GET /stream's format or `encoding(stream_id)`'s."""
        rec = self.recordings.create(job)
        enc = encoding(rec.id) if encoding is not None else Article()
        enc.open(rec)
        if self.replication is not None:
            self.replication.mirror.own(rec)
        self.pump(rec, enc, path)
        return rec

    def pump(self, rec: Recording, enc: Encoding, path: str = "/stream") -> None:
        """Start moving a recording's job into it, in `enc`'s format, in a task that outlives its
        readers (a stream taken over: the encoding its taker rebuilt from its events)."""
        self.answers.state.spawn(pump(self.answers, rec, enc, path), name=f"pump {rec.id}")

    def detach(self, rec: Recording, grace: float | None) -> None:
        """A reader of `rec` left: its grace period may begin (None: never stop it, --naive), and
        past --resume-orphans streams nobody reads, the oldest stops now."""
        rec.detach(grace)
        if grace is not None:
            self.recordings.limit_orphans()

    async def find(self, event_id: str) -> tuple[Recording, int] | None:
        """(recording, k) to resume after event k, or None: unknown, forgotten or complete (a
        503 if the stream may be on another replica and Redis cannot be reached)."""
        found = self.recordings.find(event_id)
        if found is None and self.replication is not None:  # perhaps generated on another replica
            parsed = parse_event_id(event_id)
            rec = self.recordings.get(parsed[0]) if parsed is not None else None
            if rec is not None and rec.ended and not rec.last:
                # Handed off or lost here, unfinished: its rest is (or will be) another
                # replica's, in Redis. Never 204 for a stream that has not ended.
                self.recordings.drop(rec.id)
            found = await self.replication.takeover.find(event_id)
        return found

    async def stop(self, stream_id: str) -> bool | None:
        """Stop a stream's generation now: whether it was live; None if no replica knows it."""
        rec = self.recordings.get(stream_id)
        if rec is not None and rec.job is not None:
            rec.job.stop.set()
            return not rec.ended
        if self.replication is not None:  # generated on another replica, if at all: Redis says
            return await self.replication.control.stop(stream_id)
        return None

    def hand_off(self) -> int:
        """At shutdown: the live streams go on on other replicas (Redis only), and this one takes
        none over (it would stop it at once, with an error for its readers); how many."""
        if self.replication is None:
            return 0
        self.replication.takeover.closing = True
        return self.replication.mirror.hand_off()

    async def close(self, timeout: float) -> None:
        if self.replication is not None:
            await self.replication.store.close(timeout)

    def status(self) -> dict[str, Any]:
        """For /metrics.json."""
        if self.replication is None:
            return {"kind": "memory"}
        s = self.replication
        return {
            "kind": "redis",
            "replica": s.store.name,
            "generating": s.mirror.generating(),
            "views_served": s.takeover.views,
            "taken_over": s.takeover.taken_over,
            "errors": s.store.errors,
        }
