"""Streams generated on another replica: a resume that lands here reads them from Redis, and if
their generator died (its lease expired), this replica takes the generation over.

`find()` answers a Last-Event-ID that this replica's own store does not know: it makes a *view*,
a recording (job None) filled with the stream's events from Redis, which the ordinary follow
(resumable.py) sends; a watch task keeps it growing (blocking reads), says "read S" on the control
channel every second while someone reads it here, and checks the generator's lease. When the
lease is gone and the stream has no end, the watch takes the lease (SET NX: one taker wins),
reads the prompt, the parameters and the answer's token ids, and starts a job that continues the
answer: the model reads prompt + tokens so far, the detokenizer is fed the same ids, and sampling
goes on from draw i (decoding.uniform). The view becomes this replica's own stream: its readers
see the next events as if nothing happened. Tokens the dead generator made but never wrote are
made again, the same ones for greedy decoding (and for sampling, from the same logits), so a
reader who saw them sees them again with the same numbers and skips nothing.

Leaves out: taking over streams nobody resumes (a stream with no reader left is not worth it).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from streaming.generation.prompts import Prompt
from streaming.server.shared import LEASE_MS, RENEW, RETRY, Shared, key, unavailable
from streaming.server.streams import Recording, parse_event_id
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.params import GenerationParams
from streaming.wire.sse import EventParser

if TYPE_CHECKING:
    from streaming.server.app import Server

BLOCK_MS = int(RENEW * 1000)  # a watch's blocking read: it checks the lease and says "read" this often
LOST = ProtocolError("the stream's generator is gone and the store lost its prompt", 503, 1011, "stream_lost")


def entry_number(entry_id: bytes) -> int:
    return int(entry_id.split(b"-")[1])


def fill(rec: Recording, entries: list) -> None:
    """Append entries (0-(k+1), fields) to a view, in order, skipping any it has."""
    for entry_id, fields in entries:
        if entry_number(entry_id) == len(rec.events) + 1:
            ids = tuple(int(t) for t in fields.get(b"t", b"").split())
            rec.append(fields[b"e"], ids, last=b"x" in fields)
    if rec.last and not rec.ended:
        rec.end()


async def find(srv: Server, shared: Shared, event_id: str) -> tuple[Recording, int] | None:
    """(view, k) for a Last-Event-ID of a stream generated elsewhere, or None: unknown to Redis,
    or naming its last event. Raises a 503 if Redis cannot be reached."""
    parsed = parse_event_id(event_id)
    if parsed is None:
        return None
    stream_id, k = parsed
    if (known := srv.streams.streams.get(stream_id)) is not None:
        # A live stream behind the reader (its first generator died before writing what the
        # reader saw, and the taker makes those events again): wait for them. Else nothing to send.
        return (known, k) if not known.ended else None
    try:
        entries = await shared.redis.xrange(key("s", stream_id))
    except (RedisError, OSError) as e:
        shared.failed(f"reading {stream_id}", e)
        raise unavailable() from None
    if not entries or stream_id in srv.streams.streams:  # (another resume made the view meanwhile)
        return srv.streams.find(event_id) if entries else None
    rec = Recording(stream_id, None)
    fill(rec, entries)
    if rec.ended and k >= len(rec.events) - 1:
        return None
    srv.streams.streams[stream_id] = rec
    shared.views += 1
    if not rec.ended:  # events this replica has not yet got (k may be past them: they will come)
        shared.spawn(watch(srv, shared, rec))
    return rec, k


async def watch(srv: Server, shared: Shared, rec: Recording) -> None:
    """Keep a view growing while someone reads it here; take it over if its generator died."""
    stream = key("s", rec.id)
    noted = 0.0
    while not rec.ended and rec.job is None:
        if rec.readers == 0:  # the reader left: the view goes (Redis still has everything)
            srv.streams.streams.pop(rec.id, None)
            return
        try:
            if time.monotonic() - noted >= RENEW:
                noted = time.monotonic()
                await shared.note("read", rec.id)
                if not await shared.redis.exists(key("l", rec.id)) and await take(srv, shared, rec):
                    return
            got = await shared.redis.xread({stream: f"0-{len(rec.events)}"}, block=BLOCK_MS)
            for _, entries in got:
                fill(rec, entries)
        except (RedisError, OSError) as e:
            shared.failed(f"following {rec.id}", e)
            await asyncio.sleep(RETRY)


async def take(srv: Server, shared: Shared, rec: Recording) -> bool:
    """Take over a stream whose generator's lease expired; whether this replica did."""
    from streaming.server.resumable import start_pump

    r = shared.redis
    if not await r.set(key("l", rec.id), shared.name, nx=True, px=LEASE_MS):
        return False  # another replica was quicker
    fill(rec, await r.xrange(key("s", rec.id), min=f"0-{len(rec.events) + 1}"))
    meta = await r.hgetall(key("m", rec.id))
    stopped = await r.exists(key("k", rec.id))
    if rec.ended or b"params" not in meta:  # it ended after all, or Redis lost what it needs
        await r.delete(key("l", rec.id))
        if not rec.ended:
            print(f"stream {rec.id}: cannot be taken over: its prompt is no longer in the store", flush=True)
            rec.add(json.dumps(error_body(LOST)), event="error", last=True)
            rec.end()
        return True
    params = GenerationParams(**json.loads(meta[b"params"]))
    ids = [int(t) for t in meta[b"ids"].split()]
    prior = rec.answer
    shared.taken_over += 1
    srv.metrics.takeovers.inc()
    print(
        f"stream {rec.id}: taken over after {len(prior)} tokens and {len(rec.events)} events "
        f"(its generator's lease expired or was handed off){' (it was stopped: ending it)' if stopped else ''}",
        flush=True,
    )
    written = len(rec.events)
    texts = [json.loads(ev.data)["text"] for e in rec.events[1:] for ev in EventParser().feed(e)]
    if stopped or max(len(prior), len(texts)) >= params.max_tokens:  # nothing more to generate: only the end
        rec.add("[DONE]", last=True)
        rec.end()
        shared.own(rec, written)
        return True
    try:
        if srv.runner.pool is not None:  # an upstream continues the text so far
            rec.job = await srv.runner.open(Prompt.loads(meta[b"prompt"]), params, "".join(texts), len(texts))
        else:
            rec.job = srv.runner.start(ids, params, prior)
    except ProtocolError as e:
        rec.add(json.dumps(error_body(e)), event="error", last=True)
        rec.end()
        shared.own(rec, written)
        return True
    rec.job.orphaned = rec.readers == 0
    shared.own(rec, written)
    start_pump(srv, rec)
    return True
