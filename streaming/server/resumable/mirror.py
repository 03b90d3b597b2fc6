"""The generating replica's side of --store redis://: each of its streams copied to Redis as it
grows, with what a stranger needs to continue the answer, under a lease it renews.

`own(rec)` starts a mirror task for a recording this replica generates: it writes each event as
it is added (one command a round trip: an XADD, or one script call for events that piled up), the
prompt and parameters with the first, and releases the lease after the last. Every RENEW seconds
`renew()` renews the leases of the live streams (with their keys' time to live). A write refused
because the entry is there already, or a lease found taken, means another replica took the
stream over: `lost()` stops it here without an end, so its readers reconnect and are served there.
But an entry that is there already with this replica's own bytes is this replica's: a write that
timed out (Redis paused) and ran when Redis woke. Those are taken as written, and the mirror goes
on; only a different entry, or a lease in another's name, is a rival.
At shutdown `hand_off()` stops every live stream the same way, for another replica to take over.

Redis going away stops nothing that is live: the mirror retries every RETRY seconds and catches
up from what Redis holds when it is back (even an emptied Redis: the stream again from the start);
leases are renewed again. A stream that ended longer ago than Redis keeps one is given up.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from typing import Any

from redis.exceptions import RedisError, ResponseError

from streaming.generation.job import Job
from streaming.server.resumable.recordings import Recording
from streaming.server.resumable.store import (
    APPEND_SCRIPT,
    LEASE_MS,
    MAX_EVENTS,
    RELEASE_SCRIPT,
    RENEW,
    RENEW_SCRIPT,
    RETRY,
    Gap,
    RedisStore,
    entry_number,
    key,
)

RIVAL = object()  # agreed(): another replica's entry stands where this replica's would


def meta_fields(job: Job) -> dict[Any, str]:  # (Any: the keys hset() takes, in an invariant Mapping)
    """What a stranger needs to continue a job's answer: its prompt's ids, its parameters (the
    fields set only, a cache_salt where there is one: a replica from before a field can still
    take the stream over, its GenerationParams(**...) reading the rest as defaults), its prompt."""
    params = json.dumps({k: v for k, v in asdict(job.params).items() if v is not None})
    prompt = job.prompt.dumps() if job.prompt is not None else "null"
    return {"ids": " ".join(map(str, job.ids)), "params": params, "prompt": prompt}


class Mirror:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.owned: dict[str, Recording] = {}  # streams this replica generates (or writes the end of)

    def start(self) -> None:
        self.store.spawn(self.renew(), name="renew")

    def generating(self) -> int:
        return sum(not rec.ended for rec in self.owned.values())

    def own(self, rec: Recording, written: int = 0) -> None:
        """Mirror a recording this replica generates to Redis, from event `written` on (a stream
        taken over has its first events there already)."""
        self.owned[rec.id] = rec
        fields = meta_fields(rec.job) if rec.job is not None else None  # (the job lets go of its prompt at its end)
        self.store.spawn(self.mirror(rec, written, fields), name=f"mirror {rec.id}")

    async def mirror(self, rec: Recording, written: int, fields: dict[Any, str] | None) -> None:
        store = self.store
        meta = written == 0  # a new stream: its prompt and parameters go first
        while written < len(rec.events) or not rec.ended:
            grew = rec.grew
            if written == len(rec.events):
                await grew.wait()
                continue
            try:
                written = await self.write(rec, written, fields if meta else None)
                meta = False
                continue
            except ResponseError as e:  # event `written` may be there already: ours (a late write), or a rival's
                verdict = await self.agreed(rec, written)
                if verdict is RIVAL:
                    print(f"stream {rec.id}: another replica took it over ({e}): stopping here", flush=True)
                    self.lost(rec)
                    return
                if isinstance(verdict, int):
                    written = verdict
                    continue
                store.failed(f"writing stream {rec.id}", e)  # refused for another reason (OOM, READONLY, BUSY)
            except (RedisError, OSError) as e:
                store.failed(f"writing stream {rec.id}", e)
                await store.forget_connections()
            # Write nothing more until Redis says what it holds: it may have come back empty
            # (then the stream again from the start, prompt and lease first). Asked at once the
            # first time: a write that met a connection Redis closed (it restarted) goes again on
            # a new one within a round trip, before a reader can move to another replica.
            pause = 0.0
            while True:
                await asyncio.sleep(pause)
                if (held := await self.held(rec.id)) is not None:
                    break
                if rec.ended_at is not None and time.monotonic() - rec.ended_at > store.keep_ms / 1000:
                    # Redis would have forgotten it by now: kept on, every stream of a long outage
                    # would be held here whole (and written all at once when Redis came back)
                    print(f"stream {rec.id}: not written to Redis, gone for longer than it keeps one", flush=True)
                    self.owned.pop(rec.id, None)
                    return
                pause = RETRY
            written, has_meta = held
            meta = meta or not has_meta
        self.owned.pop(rec.id, None)
        try:
            await store.redis.eval(RELEASE_SCRIPT, 1, key("l", rec.id), store.name)
        except (RedisError, OSError) as e:  # it expires by itself
            store.failed(f"releasing the lease of {rec.id}", e)

    async def write(self, rec: Recording, written: int, meta: dict[Any, str] | None) -> int:
        """Write events `written`.. in one round trip (with `meta` first: a new stream's prompt
        and parameters); return how many are written now."""
        store, end = self.store, len(rec.events)
        stream, meta_key = key("s", rec.id), key("m", rec.id)
        args: list[Any] = [MAX_EVENTS]
        for k in range(written, end):
            last = "1" if rec.last and k == end - 1 else ""
            args += [f"0-{k + 1}", rec.events[k], " ".join(map(str, rec.tokens[k])), last]
        ending = rec.last  # (the last event is among these)
        if meta is None and not ending:  # the usual case: one command, whatever piled up
            await store.append(keys=[stream], args=args)  # refused unless right after what Redis holds
            return end
        pipe = store.redis.pipeline(transaction=False)
        if meta is not None:  # its prompt and parameters, and its lease
            pipe.hset(meta_key, mapping=meta)
            pipe.set(key("l", rec.id), store.name, px=LEASE_MS)
        pipe.eval(APPEND_SCRIPT, 1, stream, *args)
        ttl = store.keep_ms if ending else store.live_ms  # (while it lives, renew() keeps the keys alive)
        pipe.pexpire(stream, ttl)
        pipe.pexpire(meta_key, ttl)
        await pipe.execute()
        return end

    async def agreed(self, rec: Recording, written: int) -> int | object | None:
        """After Redis refused event `written`: how many events it holds if every entry from there
        on is this recording's own, byte for byte (writes of ours that ran late); RIVAL if one is
        not (another replica writes this stream); None if Redis holds none there, or cannot be
        read (it refused for another reason: the write is tried again after a pause)."""
        try:
            entries = await self.store.entries(rec.id, written)
        except (RedisError, OSError):
            return None
        k = written
        try:
            for entry_id, fields in entries:
                if entry_number(entry_id) != k + 1 or k >= len(rec.events) or fields.get(b"e") != rec.events[k]:
                    return RIVAL
                k += 1
        except Gap:
            return RIVAL
        return k if k > written else None

    async def held(self, stream_id: str) -> tuple[int, bool] | None:
        """How many events of a stream Redis holds, and whether it holds its prompt (after a
        failed write some may be there, or none: a Redis restarted empty); None if it cannot say."""
        try:
            last = await self.store.last_entry(stream_id)
            has_meta = bool(await self.store.redis.exists(key("m", stream_id)))
            return (entry_number(last[0]) if last else 0), has_meta
        except Gap:
            return 0, False
        except (RedisError, OSError):
            return None

    def lost(self, rec: Recording) -> None:
        """Another replica generates this stream now: stop here without an end, so the readers
        here reconnect and are served there."""
        self.owned.pop(rec.id, None)
        if rec.job is not None:
            rec.job.hand_off()

    async def renew(self) -> None:
        """Every RENEW seconds: renew the leases of the streams this replica generates."""
        store = self.store
        while True:
            await asyncio.sleep(RENEW)
            live = [rec for rec in self.owned.values() if not rec.ended]
            if not live:
                continue
            try:
                pipe = store.redis.pipeline(transaction=False)
                for rec in live:
                    keys = (key("l", rec.id), key("s", rec.id), key("m", rec.id))
                    pipe.eval(RENEW_SCRIPT, 3, *keys, store.name, LEASE_MS, store.live_ms)
                held = await pipe.execute()
            except (RedisError, OSError) as e:
                store.failed("renewing leases", e)
                continue
            for rec, ok in zip(live, held, strict=True):
                if not ok:
                    print(f"stream {rec.id}: its lease went to another replica: stopping here", flush=True)
                    self.lost(rec)

    def hand_off(self) -> int:
        """At shutdown: stop generating every live stream without an end, so that its readers
        reconnect and another replica takes it over (the mirror writes what was made first, then
        releases the lease). Returns how many."""
        live = [rec.job for rec in self.owned.values() if not rec.ended and rec.job is not None]
        for job in live:
            job.hand_off()
        return len(live)
