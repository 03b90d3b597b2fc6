"""Redis as the store of resumable streams (--store redis://HOST:PORT/DB): the key layout, the
Lua scripts, and `RedisStore`, the one client the mirror, the control channel and the takeover
share (with this replica's name and the count of commands that failed).

Per stream S (every key lives --resume-keep seconds after its last write):

    streaming:s:S   the events: entry 0-(k+1) is event k: e (the SSE bytes as sent), t (its
                    token ids, space-separated), x ("1" on the last event). Explicit entry ids
                    also fence writers: a second writer of event k is refused by Redis.
    streaming:m:S   a hash: the prompt's token ids and the request's parameters (JSON)
    streaming:l:S   the generator's lease: its replica's name, for LEASE_MS, renewed every RENEW
    streaming:k:S   set by POST /stop on any replica: a taker must not go on generating

and a channel per replica, streaming:ctl:NAME, that only it subscribes to (control.py).

Retries are ours, not the client's: redis-py retries a command that timed out (ten times by
default), but a write that timed out while Redis was paused still runs when it wakes, so a retry
would meet its own first attempt. Here every command fails at once after TIMEOUT; the mirror
tries again every RETRY seconds after reading what Redis holds (and takes an entry that is there
already with its own bytes as its own: mirror.py), leases are renewed again the next second, the
listener resubscribes, and a view's watch backs off. Leaves out Redis Cluster and Sentinel (one Redis, or a proxy; docs/scaling.md says what a
cluster would need).
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any, cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from streaming.wire.errors import ProtocolError
from streaming.wire.params import MAX_TOKENS

PREFIX = "streaming:"
CONTROL = f"{PREFIX}ctl:"  # + a replica's name: its control channel
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
# Append events k+1.. only right after event k: an append into a Redis that lost the stream's start
# (restarted empty while a write was on its way) would leave a hole that no resume can cross.
APPEND_SCRIPT = """local first = tonumber(string.match(ARGV[2], '^0%-(%d+)$'))
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local have = 0
if #last > 0 then have = tonumber(string.match(last[1][1], '^0%-(%d+)$')) end
if have ~= first - 1 then
  return redis.error_reply('NOTNEXT the stream holds ' .. have .. ' events, not ' .. (first - 1))
end
for i = 2, #ARGV, 4 do
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


Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry as redis-py gives it: its id, its fields


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


class Gap(Exception):
    """The store's entries of a stream do not follow on from what this replica has: Redis lost
    some (it restarted empty, or someone trimmed the stream), or an entry is not one of ours."""


def entry_number(entry_id: bytes) -> int:
    """k + 1 of the entry 0-(k+1) that holds event k."""
    millis, _, number = entry_id.partition(b"-")
    if millis != b"0" or not number.isdigit():
        raise Gap(f"an entry id that is not one of ours: {entry_id[:40]!r}")
    return int(number)


def lost_part(stream_id: str) -> ProtocolError:
    return ProtocolError(
        f"the stream store (Redis) lost part of stream {stream_id}: it cannot be resumed",
        503,
        close_code=1011,
        kind="store_unavailable",
    )


class RedisStore:
    """The client, this replica's name (in leases and logs), the tasks that use Redis, and the
    failures: each counted, told to `on_error` (the metric) and logged in one line."""

    def __init__(self, url: str, keep: float, name: str | None = None, on_error: Callable[[], None] | None = None):
        self.redis = aioredis.Redis.from_url(
            url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT, retry=Retry(NoBackoff(), 0)
        )
        self.keep_ms = int(keep * 1000)
        self.live_ms = max(self.keep_ms, LEASE_MS)  # a live stream's keys outlive a renewal missed or two
        self.append = self.redis.register_script(APPEND_SCRIPT)  # EVALSHA, loaded on first use
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.on_error = on_error
        self.errors = 0
        self.tasks: set[asyncio.Task[Any]] = set()

    async def entries(self, stream_id: str, first: int = 0) -> list[Entry]:
        """The entries of a stream's events from event `first` on."""
        start = f"0-{first + 1}" if first else "-"
        return cast(list[Entry], await self.redis.xrange(key("s", stream_id), min=start))

    async def last_entry(self, stream_id: str) -> Entry | None:
        got = cast(list[Entry], await self.redis.xrevrange(key("s", stream_id), count=1))
        return got[0] if got else None

    async def entries_after(self, stream_id: str, have: int, block_ms: int) -> list[Entry]:
        """The entries after the first `have` events, waiting up to `block_ms` for one to come."""
        got = await self.redis.xread({key("s", stream_id): f"0-{have}"}, block=block_ms)
        return [entry for _, entries in cast(list[tuple[bytes, list[Entry]]], got) for entry in entries]

    async def forget_connections(self) -> None:
        """After a command failed: close the idle pooled connections. When Redis restarted they
        are all dead, and each would fail its next command (redis-py does not always see a
        closed socket before writing to it); new ones are made as needed."""
        await self.redis.connection_pool.disconnect(inuse_connections=False)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str | None = None) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def failed(self, what: str, e: BaseException) -> None:
        self.errors += 1
        if self.on_error is not None:
            self.on_error()
        print(f"store: {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    async def close(self, timeout: float) -> None:
        """At shutdown: let the mirrors finish writing (and release their leases), then stop."""
        mirrors = [t for t in self.tasks if t.get_name().startswith("mirror")]
        if mirrors:
            await asyncio.wait(mirrors, timeout=timeout)
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.redis.aclose()
