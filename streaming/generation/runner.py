"""The generation a server owns: which engine runs its requests, and the counts of its jobs.

`await Runner.open(prompt, params)` returns a started Job of the chosen engine ("batched": one
Engine thread for all; "thread": the article's thread per request; "free": no model;
"upstream": OpenAI-compatible engines elsewhere, upstream.py). A local engine's prompt is
encoded to ids first (in a thread); an upstream job is returned once an upstream has answered,
so that its failure is an error before any header (ProtocolError 502/503/504). `start(ids,
params, prior)` is the local engines' start from ids. The server reads `stats` for /metrics and
calls `stop_all` and `wait_all` at shutdown. No module-level state: two servers in one process
would have two runners.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from streaming.generation.engine import MAX_BATCH, PREFILL_CHUNK, BatchedJob, Engine
from streaming.generation.free import FreeJob
from streaming.generation.job import Job, Settings, Stats
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.prompts import Prompt
from streaming.generation.thread import ThreadJob
from streaming.generation.upstream import Pool, UpstreamJob
from streaming.wire.params import GenerationParams

ENGINES = ("batched", "thread", "free", "upstream")


class Runner:
    def __init__(
        self,
        engine: str = "batched",
        settings: Settings | None = None,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        policy: Fifo | Qoe | None = None,
        pool: Pool | None = None,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
        if (engine == "upstream") != (pool is not None):
            raise ValueError("--engine upstream and --upstream URL go together")
        settings = settings or Settings()
        self.kind, self.settings, self.stats, self.pool = engine, settings, Stats(), pool
        self.engine = (
            Engine(max_batch, prefill_chunk, settings.token_delay, policy=policy) if engine == "batched" else None
        )

    async def open(self, prompt: Prompt, params: GenerationParams, so_far: str = "", pieces: int = 0) -> Job:
        """A started job for a request (`so_far`, `pieces`: an upstream continues that answer)."""
        if self.pool is not None:
            relay = UpstreamJob(
                self.pool, prompt.chat(), params, self.settings, self.stats, so_far=so_far, pieces=pieces
            )
            relay.prompt = prompt
            await relay.start().opened
            return relay
        job = self.start(await asyncio.to_thread(prompt.encode, params), params)
        job.prompt = prompt
        return job

    def start(self, ids: list[int], params: GenerationParams, prior: list[int] | tuple[int, ...] = ()) -> Job:
        """A started job for the prompt's ids; `prior`: the answer's tokens so far (a stream
        taken over from another replica), which it continues."""
        if self.engine is not None:
            return BatchedJob(self.engine, ids, params, self.settings, self.stats, prior).start()
        cls = ThreadJob if self.kind == "thread" else FreeJob
        return cls(ids, params, self.settings, self.stats, prior).start()

    def metrics(self) -> dict[str, Any]:
        if self.pool is not None:
            return {"engine": "upstream", "upstreams": self.pool.status()}
        return self.engine.metrics() if self.engine is not None else {"engine": self.kind}

    def stop_all(self) -> None:
        for job in list(self.stats.active):
            job.stop.set()

    async def wait_all(self, timeout: float) -> None:
        """Wait (off the loop) for every job's producing side to finish, up to `timeout` in all."""
        deadline = time.monotonic() + timeout
        for job in list(self.stats.active):
            await asyncio.to_thread(job.wait, max(0.0, deadline - time.monotonic()))
