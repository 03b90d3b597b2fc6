"""The control channel of --store redis://: stops and "read" notes, sent to the one replica that
generates a stream, and heard by it.

Each replica subscribes to its own channel, streaming:ctl:NAME, and nobody else's. "stop S" (POST
/stop on another replica: the generator stops within a step) and "read S" (a reader follows S on
another replica: do not stop it for want of readers) are published to the channel of the
replica that S's lease names (NOTE_SCRIPT: one round trip), so no replica hears of streams it
does not generate, however many replicas there are. A stop also leaves a mark (streaming:k:S) for
a replica that would take the stream over. The listener resubscribes after Redis comes back.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import RedisError

from streaming.server.resumable.recordings import EVENT_NUMBER, Recordings
from streaming.server.resumable.store import CONTROL, NOTE_SCRIPT, RENEW, RETRY, RedisStore, key, unavailable


class Control:
    def __init__(self, store: RedisStore, recordings: Recordings, grace: float) -> None:
        self.store, self.recordings, self.grace = store, recordings, grace

    def start(self) -> None:
        self.store.spawn(self.listen(), name="listen")

    async def stop(self, stream_id: str) -> bool | None:
        """POST /stop for a stream this replica does not generate: whether it was live (None:
        Redis has no such stream). A 503 (store_unavailable) if Redis cannot be reached."""
        r = self.store.redis
        try:
            last = await self.store.last_entry(stream_id)
            if last is None:
                return None
            if b"x" in last[1]:
                return False
            await r.set(key("k", stream_id), 1, px=self.store.keep_ms)  # for a taker, if it died
            await self.note("stop", stream_id)
            return True
        except (RedisError, OSError) as e:
            self.store.failed(f"stopping {stream_id}", e)
            raise unavailable() from None

    async def note(self, what: str, stream_id: str, at: int | None = None) -> None:
        """Tell the replica generating a stream: "stop", or "read" with how many events the
        readers here have been sent (raises RedisError)."""
        note = f"{what} {stream_id}" if at is None else f"{what} {stream_id} {at}"
        await self.store.redis.eval(NOTE_SCRIPT, 1, key("l", stream_id), CONTROL, note)

    async def listen(self) -> None:
        """Follow this replica's channel: stops, and readers elsewhere."""
        store = self.store
        while True:
            try:
                async with store.redis.pubsub(ignore_subscribe_messages=True) as sub:
                    await sub.subscribe(CONTROL + store.name)
                    while True:
                        message = await sub.get_message(timeout=RENEW)
                        if message is not None:
                            self.heard(message["data"].decode("utf-8", "replace"))
            except (RedisError, OSError) as e:
                store.failed("listening for stops", e)
                await asyncio.sleep(RETRY)

    def heard(self, note: str) -> None:
        """One note on the channel. Anyone who may PUBLISH to Redis can send one: a note that is
        not ours is ignored (an exception here ended the listener, and the replica heard no stop
        again)."""
        what, stream_id, at = (note.split(" ") + ["", ""])[:3]
        rec = self.recordings.get(stream_id)
        if rec is None or rec.job is None:
            return
        if what == "stop":
            rec.job.stop.set()
        elif what == "read":  # (a note without a count: its readers are taken to be up to date)
            rec.read_elsewhere(self.grace, int(at) if EVENT_NUMBER.fullmatch(at) else len(rec.events))
