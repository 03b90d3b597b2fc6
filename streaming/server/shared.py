"""Resumable streams in Redis (--store redis://HOST:PORT/DB), so that any replica can serve them.

The generating replica keeps its own recording (streams.py) for its own readers, and a *mirror*
task copies each event to a Redis Stream as it is added, with what a stranger needs to continue
the answer. Per stream S (every key lives --resume-keep seconds after its last write):

    streaming:s:S   the events: entry 0-(k+1) is event k: e (the SSE bytes as sent), t (its
                    token ids, space-separated), x ("1" on the last event). Explicit entry ids
                    also fence writers: a second writer of event k is refused by Redis.
    streaming:m:S   a hash: the prompt's token ids and the request's parameters (JSON)
    streaming:l:S   the generator's lease: its replica's name, for LEASE_MS, renewed every RENEW
    streaming:k:S   set by POST /stop on any replica: a taker must not go on generating

and a channel per replica, streaming:ctl:NAME, that only it subscribes to: "stop S" (the
generator stops within a step) and "read S" (a reader follows S on another replica: do not stop it
for want of readers) go to the channel of the replica that S's lease names (NOTE_SCRIPT: one
round trip), so no replica hears of streams it does not generate, however many replicas there are. takeover.py is the other side: views of streams generated elsewhere, and taking over
one whose lease expired.

Redis going away stops nothing that is live: the mirror retries every RETRY seconds and catches
up from what Redis holds when it is back; leases are renewed again; only a resume on a replica
that does not generate the stream fails (503, store_unavailable) meanwhile, counted in
streaming_store_errors_total. Leaves out Redis Cluster and Sentinel (one Redis, or a proxy).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from streaming.server.streams import Recording
from streaming.wire.errors import ProtocolError
from streaming.wire.params import MAX_TOKENS

if TYPE_CHECKING:
    from streaming.server.app import Server

PREFIX = "streaming:"
LEASE_MS = 3000  # a generator's lease: a survivor takes a stream over within ~3 s of its generator dying
RENEW = 1.0  # seconds between lease renewals (and "read" notes): a third of the lease, so one late renewal is fine
RETRY = 0.5  # seconds between tries while Redis is away
TIMEOUT = 2.0  # seconds a Redis command may take before it counts as failed (blocking reads take less)
MAX_EVENTS = MAX_TOKENS + 16  # a stream's cap in Redis: never trims an answer, bounds a runaway writer
# Every second, for each live stream: set the lease if it is free or already ours, and keep the
# stream's keys alive (so an event's write is one XADD, without a PEXPIRE after it); else say 0
# (someone took the stream over). KEYS: lease, stream, hash; ARGV: name, lease ms, keep ms.
RENEW_SCRIPT = """local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  redis.call('PEXPIRE', KEYS[3], ARGV[3])
  return 1
end
return 0"""
RELEASE_SCRIPT = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# Several events in one command: the client's cost is per command (about 15 us each in redis-py,
# bench_store.py), so events that piled up go as one. ARGV: the cap, then per event its entry id,
# SSE bytes, token ids, and "1" if it is the last.
APPEND_SCRIPT = """for i = 2, #ARGV, 4 do
  if ARGV[i + 3] == '1' then
    redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], ARGV[i], 'e', ARGV[i + 1], 't', ARGV[i + 2], 'x', '1')
  else
    redis.call('XADD', KEYS[1], 'MAXLEN', ARGV[1], ARGV[i], 'e', ARGV[i + 1], 't', ARGV[i + 2])
  end
end
return 1"""
# Publish a note to the channel of the replica holding the lease, if one does (else nobody generates).
NOTE_SCRIPT = """local owner = redis.call('GET', KEYS[1])
if owner then return redis.call('PUBLISH', ARGV[1] .. owner, ARGV[2]) end
return 0"""
CONTROL = f"{PREFIX}ctl:"  # + a replica's name: its control channel


def key(kind: str, stream_id: str) -> str:
    return f"{PREFIX}{kind}:{stream_id}"


def unavailable() -> ProtocolError:
    return ProtocolError(
        "the stream store (Redis) cannot be reached: streams generated on other replicas cannot be resumed now",
        503,
        close_code=1011,
        kind="store_unavailable",
        headers=[("Retry-After", "2")],
    )


class Shared:
    def __init__(self, url: str, keep: float, grace: float, name: str | None = None) -> None:
        self.redis = aioredis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)
        self.keep_ms, self.grace = int(keep * 1000), grace
        self.live_ms = max(self.keep_ms, LEASE_MS)  # a live stream's keys outlive a renewal missed or two
        self.append = self.redis.register_script(APPEND_SCRIPT)  # EVALSHA, loaded on first use
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"  # this replica, in leases and logs
        self.owned: dict[str, Recording] = {}  # streams this replica generates (or writes the end of)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.errors = 0  # Redis commands that failed (the metric)
        self.taken_over = 0  # streams this replica took over from a replica that died
        self.views = 0  # resumes of streams generated elsewhere that this replica served
        self.srv: Server | None = None

    def start(self, srv: Server) -> None:
        self.srv = srv
        self.spawn(listen(self))
        self.spawn(self.renew())

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def status(self) -> dict[str, Any]:
        """For /metrics.json."""
        return {
            "kind": "redis",
            "replica": self.name,
            "generating": sum(not rec.ended for rec in self.owned.values()),
            "views_served": self.views,
            "taken_over": self.taken_over,
            "errors": self.errors,
        }

    def failed(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if self.srv is not None:
            self.srv.metrics.store_errors.inc()
        print(f"store: {what} failed: {e!r}", file=sys.stderr, flush=True)

    async def close(self, timeout: float) -> None:
        """At shutdown: let the mirrors finish writing (and release their leases), then stop."""
        mirrors = [t for t in self.tasks if t.get_name().startswith("mirror")]
        if mirrors:
            await asyncio.wait(mirrors, timeout=timeout)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.redis.aclose()

    # --- the generating replica ----------------------------------------------------------------

    def own(self, rec: Recording, written: int = 0) -> None:
        """Mirror a recording this replica generates to Redis, from event `written` on (a stream
        taken over has its first events there already)."""
        self.owned[rec.id] = rec
        self.spawn(self.mirror(rec, written)).set_name(f"mirror {rec.id}")

    async def mirror(self, rec: Recording, written: int) -> None:
        meta = written == 0  # a new stream: its prompt and parameters go first
        while written < len(rec.events) or not rec.ended:
            grew = rec.grew
            if written == len(rec.events):
                await grew.wait()
                continue
            try:
                written = await self.write(rec, written, meta)
                meta = False
            except ResponseError as e:  # event `written` is there already: another replica writes it
                print(f"stream {rec.id}: another replica took it over ({e}): stopping here", flush=True)
                self.lost(rec)
                return
            except (RedisError, OSError) as e:
                self.failed(f"writing stream {rec.id}", e)
                await asyncio.sleep(RETRY)
                written = await self.written(rec.id, written)
                meta = meta or written == 0  # a Redis that came back empty: the stream again from the start
        self.owned.pop(rec.id, None)
        try:
            await self.redis.eval(RELEASE_SCRIPT, 1, key("l", rec.id), self.name)
        except (RedisError, OSError) as e:  # it expires by itself
            self.failed(f"releasing the lease of {rec.id}", e)

    async def write(self, rec: Recording, written: int, meta: bool) -> int:
        """Write events `written`.. in one round trip; return how many are written now."""
        job, end = rec.job, len(rec.events)
        stream, meta_key = key("s", rec.id), key("m", rec.id)
        args: list[Any] = [MAX_EVENTS]
        for k in range(written, end):
            last = "1" if rec.last and k == end - 1 else ""
            args += [f"0-{k + 1}", rec.events[k], " ".join(map(str, rec.tokens[k])), last]
        new, ending = meta and job is not None, rec.last  # (the last event is among these)
        if not new and not ending:  # the usual case: one command, whatever piled up
            if end - written == 1:
                fields = {"e": args[2], "t": args[3]}
                await self.redis.xadd(stream, fields, id=args[1], maxlen=MAX_EVENTS, approximate=False)  # type: ignore[arg-type]
            else:
                await self.append(keys=[stream], args=args)
            return end
        pipe = self.redis.pipeline(transaction=False)
        if new:  # its prompt and parameters, and its lease
            params = json.dumps(asdict(job.params))
            prompt = job.prompt.dumps() if job.prompt is not None else "null"
            pipe.hset(meta_key, mapping={"ids": " ".join(map(str, job.ids)), "params": params, "prompt": prompt})
            pipe.set(key("l", rec.id), self.name, px=LEASE_MS)
        pipe.eval(APPEND_SCRIPT, 1, stream, *args)
        ttl = self.keep_ms if ending else self.live_ms  # (while it lives, renew() keeps the keys alive)
        pipe.pexpire(stream, ttl)
        pipe.pexpire(meta_key, ttl)
        await pipe.execute()
        return end

    async def written(self, stream_id: str, guess: int) -> int:
        """How many events of a stream Redis holds (after a failed write, some may be there)."""
        try:
            last = await self.redis.xrevrange(key("s", stream_id), count=1)
        except (RedisError, OSError):
            return guess
        return int(last[0][0].split(b"-")[1]) if last else 0

    def lost(self, rec: Recording) -> None:
        """Another replica generates this stream now: stop here without an end, so the readers
        here reconnect and are served there."""
        self.owned.pop(rec.id, None)
        if rec.job is not None:
            rec.job.handed_off = True
            rec.job.stop.set()

    async def renew(self) -> None:
        """Every RENEW seconds: renew the leases of the streams this replica generates."""
        while True:
            await asyncio.sleep(RENEW)
            live = [rec for rec in self.owned.values() if not rec.ended]
            if not live:
                continue
            try:
                pipe = self.redis.pipeline(transaction=False)
                for rec in live:
                    keys = (key("l", rec.id), key("s", rec.id), key("m", rec.id))
                    pipe.eval(RENEW_SCRIPT, 3, *keys, self.name, LEASE_MS, self.live_ms)
                held = await pipe.execute()
            except (RedisError, OSError) as e:
                self.failed("renewing leases", e)
                continue
            for rec, ok in zip(live, held, strict=True):
                if not ok:
                    print(f"stream {rec.id}: its lease went to another replica: stopping here", flush=True)
                    self.lost(rec)

    def hand_off(self) -> int:
        """At shutdown: stop generating every live stream without an end, so that its readers
        reconnect and another replica takes it over (the mirror writes what was made first, then
        releases the lease). Returns how many."""
        live = [rec for rec in self.owned.values() if not rec.ended and rec.job is not None]
        for rec in live:
            rec.job.handed_off = True
            rec.job.stop.set()
        return len(live)

    # --- every replica -------------------------------------------------------------------------

    async def stop(self, stream_id: str) -> bool | None:
        """POST /stop for a stream this replica does not generate: whether it was live (None:
        Redis has no such stream)."""
        try:
            last = await self.redis.xrevrange(key("s", stream_id), count=1)
            if not last:
                return None
            if b"x" in last[0][1]:
                return False
            await self.redis.set(key("k", stream_id), 1, px=self.keep_ms)  # for a taker, if it died
            await self.note("stop", stream_id)
            return True
        except (RedisError, OSError) as e:
            self.failed(f"stopping {stream_id}", e)
            raise unavailable() from None

    async def note(self, what: str, stream_id: str) -> None:
        """Tell the replica generating a stream: "stop" or "read" (raises RedisError)."""
        await self.redis.eval(NOTE_SCRIPT, 1, key("l", stream_id), CONTROL, f"{what} {stream_id}")


async def listen(shared: Shared) -> None:
    """Follow this replica's control channel: stops, and readers elsewhere (resubscribing after
    Redis comes back)."""
    assert shared.srv is not None
    streams = shared.srv.streams.streams
    while True:
        try:
            async with shared.redis.pubsub(ignore_subscribe_messages=True) as sub:
                await sub.subscribe(CONTROL + shared.name)
                while True:
                    message = await sub.get_message(timeout=RENEW)
                    if message is None:
                        continue
                    what, _, stream_id = message["data"].decode().partition(" ")
                    rec = streams.get(stream_id)
                    if rec is None or rec.job is None:
                        continue
                    if what == "stop":
                        rec.job.stop.set()
                    elif what == "read":
                        rec.read_elsewhere(shared.grace)
        except (RedisError, OSError) as e:
            shared.failed("listening for stops", e)
            await asyncio.sleep(RETRY)
