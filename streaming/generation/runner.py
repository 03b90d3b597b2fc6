"""The generation a server owns: which engine runs its requests, and the counts of its jobs.

`Runner.start(ids, params)` returns a started Job of the chosen engine ("batched": one Engine
thread for all; "thread": the article's thread per request; "free": no model). The server reads
`stats` for /metrics and calls `stop_all` and `wait_all` at shutdown. No module-level state: two
servers in one process would have two runners.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streaming.generation.engine import MAX_BATCH, PREFILL_CHUNK, BatchedJob, Engine
from streaming.generation.free import FreeJob
from streaming.generation.job import Job, Settings, Stats
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.thread import ThreadJob
from streaming.wire.params import GenerationParams

ENGINES = ("batched", "thread", "free")


class Runner:
    def __init__(
        self,
        engine: str = "batched",
        settings: Settings | None = None,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        policy: Fifo | Qoe | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
        settings = settings or Settings()
        self.kind, self.settings, self.stats = engine, settings, Stats()
        self.engine = (
            Engine(max_batch, prefill_chunk, settings.token_delay, policy=policy) if engine == "batched" else None
        )

    def start(self, ids: list[int], params: GenerationParams, prior: list[int] | tuple[int, ...] = ()) -> Job:
        """A started job for the prompt's ids; `prior`: the answer's tokens so far (a stream
        taken over from another replica), which it continues."""
        if self.engine is not None:
            return BatchedJob(self.engine, ids, params, self.settings, self.stats, prior).start()
        cls = ThreadJob if self.kind == "thread" else FreeJob
        return cls(ids, params, self.settings, self.stats, prior).start()

    def metrics(self) -> dict[str, Any]:
        return self.engine.metrics() if self.engine is not None else {"engine": self.kind}

    def stop_all(self) -> None:
        for job in list(self.stats.active):
            job.stop.set()

    async def wait_all(self, timeout: float) -> None:
        """Wait (off the loop) for every job's producing side to finish, up to `timeout` in all."""
        deadline = time.monotonic() + timeout
        for job in list(self.stats.active):
            await asyncio.to_thread(job.wait, max(0.0, deadline - time.monotonic()))
