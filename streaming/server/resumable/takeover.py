"""Streams generated on another replica: a resume that lands here reads them from Redis, and if
their generator died (its lease expired), this replica takes the generation over.

`find()` answers a Last-Event-ID that this replica's own recordings do not know: it makes a
*view*, a recording (job None) filled with the stream's events from Redis, which the ordinary
follow (endpoints.py) sends; a watch task keeps it growing (blocking reads), says "read S" on the
control channel every second while someone reads it here, and checks the generator's lease. When
the lease is gone and the stream has no end, the watch takes the lease (SET NX: one taker wins),
reads the prompt, the parameters and the answer's token ids, and starts a job that continues the
answer: the model reads prompt + tokens so far, the detokenizer is fed the same ids, and sampling
goes on from draw i (sampling.uniform). The view becomes this replica's own stream: its readers
see the next events as if nothing happened. Tokens the dead generator made but never wrote are
made again, the same ones for greedy decoding (and for sampling, from the same logits), so a
reader who saw them sees them again with the same numbers and skips nothing.

Leaves out: taking over streams nobody resumes (a stream with no reader left is not worth it).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from streaming.generation.backend import Backend
from streaming.generation.prompts import Prompt
from streaming.server.resumable import encodings
from streaming.server.resumable.control import Control
from streaming.server.resumable.mirror import Mirror
from streaming.server.resumable.recordings import Recording, Recordings, parse_event_id
from streaming.server.resumable.store import (
    LEASE_MS,
    RENEW,
    RETRY,
    Entry,
    Gap,
    RedisStore,
    entry_number,
    key,
    lost_part,
    unavailable,
)
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.params import GenerationParams

BLOCK_MS = int(RENEW * 1000)  # a watch's blocking read: it checks the lease and says "read" this often
# A recorded token id: int() refuses past 4,300 digits (a ValueError, a 500 on resume), and no
# vocabulary comes near ten.
TOKEN_ID = re.compile(rb"[0-9]{1,10}")
# Seconds a view's reader waits while Redis cannot be read: then its connection ends (no event),
# and it comes back with its last event id, to a replica that can read Redis or to a clear 503.
# Kept open with pings instead, it waited as long as the outage, however long.
OUTAGE = 10.0
LOST = ProtocolError("the stream's generator is gone and the store lost its prompt", 503, 1011, "stream_lost")


def fill(rec: Recording, entries: list[Entry]) -> None:
    """Append entries (0-(k+1), fields) to a view, in order, skipping any it has. Raises Gap if
    they do not follow on from it (Redis lost some) or one is not an event of ours."""
    for entry_id, fields in entries:
        n = entry_number(entry_id)
        if n <= len(rec.events):
            continue
        ids = fields.get(b"t", b"").split()
        if n != len(rec.events) + 1 or b"e" not in fields or not all(TOKEN_ID.fullmatch(t) for t in ids):
            raise Gap(f"stream {rec.id}: entry {n} after {len(rec.events)} events")
        rec.append(fields[b"e"], tuple(int(t) for t in ids), last=b"x" in fields)
    if rec.last and not rec.ended:
        rec.end()


def broken(rec: Recording, err: ProtocolError) -> None:
    """A view that cannot go on: its readers get the events it has, then an error event."""
    print(f"stream {rec.id}: {err.message}", flush=True)
    rec.add(json.dumps(error_body(err)), event="error", last=True)
    rec.end()


class Takeover:
    """Views of streams generated elsewhere, and taking one over (`pump` starts a stream's pump
    here once it is this replica's own)."""

    def __init__(
        self,
        store: RedisStore,
        recordings: Recordings,
        mirror: Mirror,
        control: Control,
        backend: Backend,
        pump: Callable[[Recording, encodings.Encoding], None],
        on_takeover: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.recordings, self.mirror, self.control = store, recordings, mirror, control
        self.backend, self.pump, self.on_takeover = backend, pump, on_takeover
        self.taken_over = 0  # streams this replica took over from a replica that died
        self.closing = False  # shutting down: views follow Redis, another replica takes their streams over
        self.views = 0  # resumes of streams generated elsewhere that this replica served

    async def find(self, event_id: str) -> tuple[Recording, int] | None:
        """(view, k) for a Last-Event-ID of a stream generated elsewhere, or None: unknown to
        Redis, or naming its last event. Raises a 503 if Redis cannot be reached."""
        parsed = parse_event_id(event_id)
        if parsed is None:
            return None
        stream_id, k = parsed
        if (known := self.recordings.get(stream_id)) is not None:
            # A live stream behind the reader (its first generator died before writing what the
            # reader saw, and the taker makes those events again): wait for them. Else nothing to send.
            return (known, k) if not known.ended else None
        try:
            entries = await self.store.entries(stream_id)
        except (RedisError, OSError) as e:
            self.store.failed(f"reading {stream_id}", e)
            raise unavailable() from None
        if (known := self.recordings.get(stream_id)) is not None:  # another resume made the view meanwhile
            return (known, k) if not known.ended else None  # (as above: a 204 would end a live stream's reader)
        if not entries:
            return None
        rec = Recording(stream_id, None)
        try:
            fill(rec, entries)
        except Gap:  # its beginning is gone: nothing to resume from
            raise lost_part(stream_id) from None
        if rec.ended and k >= len(rec.events) - 1:
            return None
        self.views += 1
        if not rec.ended:  # events this replica has not yet got (k may be past them: they will come)
            self.recordings.add_view(rec)
            self.store.spawn(self.watch(rec), name=f"watch {rec.id}")
        # An ended view is never kept here: Redis is its record, and forgets it --resume-keep
        # after its last write. A copy kept here would outlive that by however late it was read.
        return rec, k

    async def watch(self, rec: Recording) -> None:
        """Keep a view growing while someone reads it here; take it over if its generator died."""
        r = self.store.redis
        noted, failing = 0.0, None
        while not rec.ended and rec.job is None:
            if rec.readers == 0:  # the reader left: the view goes (Redis still has everything)
                self.recordings.drop(rec.id)
                return
            if failing is not None and time.monotonic() - failing > OUTAGE:
                self.recordings.drop(rec.id)
                rec.end()
                return
            try:
                if time.monotonic() - noted >= RENEW:
                    noted = time.monotonic()
                    await self.control.note("read", rec.id, rec.read_to)
                    if not self.closing and not await r.exists(key("l", rec.id)) and await self.take_over(rec):
                        return
                fill(rec, await self.store.entries_after(rec.id, len(rec.events), BLOCK_MS))
                failing = None
            except Gap:  # Redis lost what follows what this view has: tell its readers, never spin
                broken(rec, lost_part(rec.id))
                return
            except (RedisError, OSError) as e:
                self.store.failed(f"following {rec.id}", e)
                failing = failing or time.monotonic()
                await asyncio.sleep(RETRY)
            except Exception as e:  # noqa: BLE001 - a stream that cannot go on ends with an error, never hangs
                print(f"stream {rec.id}: taking it over failed: {e!r}", flush=True)
                await self.store.redis.delete(key("l", rec.id))
                if not rec.ended:
                    broken(rec, LOST)
                return
        if rec.job is None and self.recordings.get(rec.id) is rec:  # it ended in Redis: Redis keeps it (find)
            self.recordings.drop(rec.id)

    async def take_over(self, rec: Recording) -> bool:
        """Take over a stream whose generator's lease expired; whether this replica did."""
        r = self.store.redis
        if not await r.set(key("l", rec.id), self.store.name, nx=True, px=LEASE_MS):
            return False  # another replica was quicker
        try:
            fill(rec, await self.store.entries(rec.id, len(rec.events)))
        except Gap:
            await r.delete(key("l", rec.id))
            broken(rec, lost_part(rec.id))
            return True
        meta = await r.hgetall(key("m", rec.id))
        stopped = await r.exists(key("k", rec.id))
        written = len(rec.events)
        if rec.ended or b"params" not in meta:  # it ended after all, or Redis lost what it needs
            await r.delete(key("l", rec.id))
            if not rec.ended:
                broken(rec, LOST)
            return True
        try:  # what the generator wrote (another version of this server may have written it)
            params = GenerationParams(**json.loads(meta[b"params"]))
            ids = [int(t) for t in meta[b"ids"].split()]
            prompt = Prompt.loads(meta[b"prompt"]) if self.backend.pool is not None else None
            texts = encodings.texts(rec)
            model = self.backend.model  # the answer so far, tool-call tags and all (its prefill first)
            start = Prompt.loads(meta[b"prompt"]).prefill if meta.get(b"prompt") not in (None, b"null") else ""
            so_far = model.tokenizer.decode(rec.answer, skip_special_tokens=True) if model is not None else ""
            enc = encodings.of_events(rec, start + so_far if model is not None else "")
        except (ValueError, TypeError, KeyError, ProtocolError) as e:
            await r.delete(key("l", rec.id))
            print(f"stream {rec.id}: what the store holds of it cannot be read ({e!r})", flush=True)
            broken(rec, LOST)
            return True
        prior = rec.answer
        self.taken_over += 1
        if self.on_takeover is not None:
            self.on_takeover()
        print(
            f"stream {rec.id}: taken over after {len(prior)} tokens and {written} events "
            f"(its generator's lease expired or was handed off){' (it was stopped: ending it)' if stopped else ''}",
            flush=True,
        )
        if stopped or max(len(prior), len(texts)) >= params.max_tokens:  # nothing more to generate: only the end
            enc.done(rec, "stopped" if stopped else "length", len(ids), max(len(prior), len(texts)))
            self.end(rec, written)
            return True
        try:
            if prompt is not None:  # an upstream continues the text so far
                job = await self.backend.open(prompt, params, "".join(texts), len(texts))
            else:
                job = self.backend.start(ids, params, prior)
        except ProtocolError as e:
            enc.failed(rec, e)
            self.end(rec, written)
            return True
        rec.adopt(job, self.control.grace)
        self.mirror.own(rec, written)
        self.pump(rec, enc)
        return True

    def end(self, rec: Recording, written: int) -> None:
        """A stream taken over that has nothing more to generate: its end (added by its
        encoding), written here."""
        rec.end()
        self.mirror.own(rec, written)
