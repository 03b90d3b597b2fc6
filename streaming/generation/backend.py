"""`Backend`: what generates a server's answers, and the counts of its jobs.

`await Backend.open(prompt, params)` returns a started Job of the chosen engine, each a module
here and an entry in ENGINES:

- "batched" (batched.py): one engine thread steps every request at once (the default);
- "process" (process.py): the batched engine in a process of its own, over a pipe;
- "thread" (thread.py): the article's thread per request;
- "free" (free.py): no model, for measuring the server's own cost per event;
- "upstream" (upstream/): OpenAI-compatible engines elsewhere.

A local engine's prompt is encoded to ids first (in a thread), through the backend's `Model`
(the model layer's handle: the package never imports the top-level lm); an upstream job is
returned once an upstream has answered, so that its failure is an error before any header
(ProtocolError 502/503/504); a batched engine with `max_waiting` requests waiting already refuses
a new one before any header (503 `overloaded` with Retry-After). `start(ids, params, prior)` starts a local engine's job from ids (a
stream taken over). The server reads `stats` and `loaded` and calls `load`, `stop_all` and
`wait_all`. No module-level state: two servers in one process would have two backends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from streaming.generation.batched import MAX_BATCH, MAX_WAITING, PREFILL_CHUNK, BatchedJob, BatchEngine
from streaming.generation.free import FreeJob
from streaming.generation.job import Job, JobOptions, Stats
from streaming.generation.kv import KV_MEMORY
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.process import EngineProcess, ProcessJob
from streaming.generation.process_child import EngineSettings
from streaming.generation.prompts import Prompt
from streaming.generation.thread import ThreadJob
from streaming.generation.upstream.pool import Pool
from streaming.generation.upstream.relay import UpstreamJob
from streaming.generation.warm import warm
from streaming.model.loading import Model, in_one_line
from streaming.wire.errors import ProtocolError
from streaming.wire.params import GenerationParams

Prior = list[int] | tuple[int, ...]


def batched(b: Backend, ids: list[int], params: GenerationParams, prior: Prior) -> Job:
    assert b.batch is not None
    return BatchedJob(b.batch, ids, params, b.options, b.stats, prior)


def in_process(b: Backend, ids: list[int], params: GenerationParams, prior: Prior) -> Job:
    assert b.process is not None
    return ProcessJob(b.process, ids, params, b.options, b.stats, prior)


def threaded(b: Backend, ids: list[int], params: GenerationParams, prior: Prior) -> Job:
    assert b.model is not None
    return ThreadJob(ids, params, b.options, b.stats, prior, model=b.model)


def free(b: Backend, ids: list[int], params: GenerationParams, prior: Prior) -> Job:
    return FreeJob(ids, params, b.options, b.stats, prior)


# Each engine's job from a prompt's ids; None: it takes the prompt itself and runs no model here.
ENGINES: dict[str, Callable[[Backend, list[int], GenerationParams, Prior], Job] | None] = {
    "batched": batched,
    "process": in_process,
    "thread": threaded,
    "free": free,
    "upstream": None,
}


class Backend:
    def __init__(
        self,
        engine: str = "batched",
        options: JobOptions | None = None,
        *,
        model: Model | None = None,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        policy: Fifo | Qoe | None = None,
        pool: Pool | None = None,
        max_waiting: int = MAX_WAITING,
        kv_memory: int | None = KV_MEMORY,
        retain_memory: int = RETAIN_MEMORY,
    ) -> None:
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}: choose one of {', '.join(ENGINES)}")
        if (engine == "upstream") != (pool is not None):
            raise ValueError("--engine upstream and --upstream URL go together")
        self.kind, self.make = engine, ENGINES[engine]
        if self.make is not None and model is None:
            raise ValueError(f"--engine {engine} needs a model")
        self.options, self.stats, self.pool, self.model = options or JobOptions(), Stats(), pool, model
        self.batch = (
            BatchEngine(
                model,
                max_batch,
                prefill_chunk,
                self.options.token_delay,
                policy=policy,
                max_waiting=max_waiting,
                kv_memory=kv_memory,
                retain_memory=retain_memory,
            )
            if engine == "batched" and model is not None
            else None
        )
        self.process = (
            EngineProcess(
                model,
                EngineSettings(
                    model.choice,
                    self.options,
                    policy or Fifo(),
                    max_batch,
                    prefill_chunk,
                    max_waiting,
                    kv_memory,
                    retain_memory,
                ),
            )
            if engine == "process" and model is not None
            else None
        )
        # Whether answers can be generated: an upstream's at once; a local model's once load()
        # has loaded and warmed it up (or if it came loaded); the engine process's while it is up.
        self._loaded = self.make is None or (model is not None and model.loaded and engine != "process")

    @property
    def loaded(self) -> bool:
        return self._loaded and (self.process is None or self.process.ready)

    async def load(self, load: Callable[[], str]) -> str:
        """Load the model (in a thread: the loop goes on answering /health and /ready; the batched
        engine's own, which runs its steps), then warm the batched engine's memory (warm.py); what
        `load` says of it. The engine process loads and warms its own (never here)."""
        if self.process is not None:
            model = self.model
            assert model is not None  # its tokenizer encodes the prompts here: loaded meanwhile
            tokenizer = asyncio.to_thread(in_one_line, model, lambda: model.tokenizer)
            said, _ = await asyncio.gather(self.process.start(), tokenizer)
        elif self.batch is not None:  # in the engine's thread, where its steps will run
            said = await asyncio.wrap_future(self.batch.call(load))
            assert self.model is not None
            t0 = time.perf_counter()
            tokens = await warm(self.batch, len(self.model.tokenizer))
            said += f"; memory warmed ({tokens} tokens) in {time.perf_counter() - t0:.1f} s"
        else:
            said = await asyncio.to_thread(load)
        self._loaded = True
        return said

    async def open(self, prompt: Prompt, params: GenerationParams, so_far: str = "", pieces: int = 0) -> Job:
        """A started job for a request (`so_far`, `pieces`: an upstream continues that answer)."""
        if self.pool is not None:
            relay = UpstreamJob(
                self.pool, prompt.chat(), params, self.options, self.stats, so_far=so_far, pieces=pieces
            )
            relay.prompt = prompt
            await relay.start().opened
            return relay
        assert self.model is not None
        self.check_room()  # before encoding: a refused request costs no tokenizer time
        ids = await asyncio.to_thread(prompt.encode, self.model, params)
        self.check_room()  # again with no await before the submit: a burst cannot all pass the first check
        job = self.start(ids, params)
        job.prompt = prompt
        return job

    def check_room(self) -> None:
        """Refuse a new request when --max-waiting requests wait for a place already (503 with
        Retry-After, close 1013). A stream taken over from another replica is not refused: its
        reader is already reading (it goes through start())."""
        engine = self.batch or self.process
        if engine is not None and (full := engine.refusal()) is not None:
            waiting, seconds = full
            raise ProtocolError(
                f"the server is at capacity: {waiting} requests wait for a place already (--max-waiting); "
                f"try again in {seconds} s",
                503,
                close_code=1013,  # RFC 6455: try again later
                kind="overloaded",
                headers=[("Retry-After", str(seconds))],
            )

    def start(self, ids: list[int], params: GenerationParams, prior: Prior = ()) -> Job:
        """A started job for the prompt's ids; `prior`: the answer's tokens so far (a stream
        taken over from another replica), which it continues."""
        assert self.make is not None, "an upstream job starts from the prompt: open()"
        return self.make(self, ids, params, prior).start()

    def model_id(self) -> str:
        """The model's id on /v1/: the upstream's, else the model's short name (never a file's path)."""
        if self.pool is not None:
            return self.pool.model or "upstream"
        return self.model.served_name() if self.model is not None else self.kind

    def facts(self) -> dict[str, Any]:
        """For /metrics.json: the model, where it runs and in what."""
        if self.process is not None and self.process.facts:
            return self.process.facts
        return self.model.facts() if self.model is not None else {}

    def metrics(self) -> dict[str, Any]:
        if self.pool is not None:
            return {"engine": "upstream", "upstreams": self.pool.status()}
        if self.process is not None:
            return self.process.metrics()
        return self.batch.metrics() if self.batch is not None else {"engine": self.kind}

    def waiting(self) -> int:
        return int(self.metrics().get("waiting", 0))

    def position(self, job: Job) -> int | None:
        """Requests ahead of this job waiting for a place in the batch (None: it has one, or
        its engine has no queue)."""
        if self.process is not None:
            return self.process.position(job)
        return self.batch.position(job) if self.batch is not None and isinstance(job, BatchedJob) else None

    def stop_all(self) -> None:
        for job in list(self.stats.active):
            job.stop.set()

    async def wait_all(self, timeout: float) -> None:
        """Wait (off the loop) for every job's producing side to finish, up to `timeout` in all;
        then close the engine process's pipe, which ends it."""
        deadline = time.monotonic() + timeout
        for job in list(self.stats.active):
            await asyncio.to_thread(job.wait, max(0.0, deadline - time.monotonic()))
        if self.process is not None:
            await asyncio.to_thread(self.process.close)
