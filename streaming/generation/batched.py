"""The step-batched generation engine: one thread, one model, every reader in one batch.

The article's server runs a thread per request, so sixteen readers share the model sixteen ways
and each gets a sixteenth of it. Here one thread owns the model and runs a loop of steps; each
step is one forward pass for the rows that run and the prompts that join (a batch of 16 costs far
less than 16 batches of one; batch.py: the step itself). Between steps:

- the policy (policy.py: `fifo`, every row every step; or `qoe`, the rows whose readers are about
  to wait, first) says which rows run and how many prompt tokens may join;
- requests join: the waiting prompts' tokens ride in the step's pass, up to its prefill budget
  (a burst of 48 short prompts joins in a few steps, not 48); a prompt longer than PREFILL_CHUNK
  at most a chunk a step, so it delays the others by a chunk, not by all of it;
- the stop flags are checked, once per step, as the article says a batched engine does: a stopped
  or finished row leaves the batch at that step and its slot of the KV cache is freed;
- at most `max_batch` requests are active; the rest wait in order (the server sends them
  keep-alive pings that say their place meanwhile), those with a reader before readerless
  resumable streams; past `max_waiting` waiting, a new request is refused (`refusal()`: the
  server's 503 with Retry-After, which a load balancer takes as "try another replica");
- `call(fn)` runs a function on the engine's thread between steps (the model's loading);
  `after_step`, if given, runs there after every step.

Alone, a request gives the same tokens as with the thread engine; in a batch, its logits can
differ in the last bits (more rows change the shapes of the arithmetic), so a sampled text may
differ: in float32 rarely, in bfloat16 often (the tests state the tolerance).

Leaves out: --queue's backpressure (a row is never paused for a slow reader: its queue grows; the
qoe policy skips it instead), and the repetition penalty.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from streaming.generation.batch import Batch, Row
from streaming.generation.job import Job
from streaming.generation.kv import KV_MEMORY
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.waiting import MAX_WAITING, WaitingRoom
from streaming.model.choice import cpu_has_bf16
from streaming.model.loading import Model

MAX_BATCH = 64  # active requests per step: past it they wait. 64 rows of 4k tokens is ~6 GB of KV in float32
# On CUDA: vLLM's max_num_seqs default. A GPU's step is bound by launching kernels, not by rows (the
# H200 check of issue 22 §7: 53-62 ms a step at every batch from 1 to 64), so more rows cost next to
# nothing, and 64 made arrivals wait that the step had room for (that run passed --max-batch 128).
GPU_MAX_BATCH = 256


# On a CPU that computes bfloat16 natively (AVX-512 BF16, AMX), in bfloat16: its products of many
# rows run on the matrix units, and a step still grows less than its rows do past 64 (the bundled
# model, contexts of 100-300 tokens, the AVX-512 + AMX kind: 64 rows 135 ms a step, 472 tokens/s;
# 96 rows 180 ms, 534 tokens/s, each reader still at 5.6 tokens/s; 128 rows 239 ms, 536 tokens/s,
# below reading speed). At 2.4 requests a second, 64 places made a queue (mean QoE 0.761, first
# text p50 5.7 s) where 96 held every reader (0.990). Elsewhere (AVX2: float32 or fp16 weights) a
# step of 64 rows is past reading pace already, and 64 stays.
BF16_CPU_MAX_BATCH = 96


def default_max_batch(device: str, dtype: torch.dtype | None = None) -> int:
    """--max-batch left out: GPU_MAX_BATCH on CUDA; BF16_CPU_MAX_BATCH on a CPU with native
    bfloat16 running the model in it (`dtype`: the model's); else MAX_BATCH (a CPU's step grows
    with rows)."""
    if device.startswith("cuda"):
        return GPU_MAX_BATCH
    if device == "cpu" and dtype == torch.bfloat16 and cpu_has_bf16():
        return BF16_CPU_MAX_BATCH
    return MAX_BATCH


PREFILL_CHUNK = 128  # a longer prompt joins at most this many tokens a step: the extra wait it adds to others' gaps


class BatchEngine:
    def __init__(
        self,
        model: Model,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        token_delay: float = 0.0,
        policy: Fifo | Qoe | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_waiting: int = MAX_WAITING,
        kv_memory: int | None = KV_MEMORY,
        after_step: Callable[[], None] | None = None,
        retain_memory: int = RETAIN_MEMORY,
    ) -> None:
        self.max_batch, self.token_delay = max_batch, token_delay
        self.after_step = after_step  # on this thread after each step (the engine process sends its pieces)
        self.clock = clock
        self.lock = threading.Condition()
        self.waiting = WaitingRoom(max_waiting)  # not yet admitted (from the event loop)
        self.batch = Batch(
            model, prefill_chunk, policy or Fifo(), clock, self.waiting, self.lock, kv_memory, retain_memory
        )
        self.steps = 0
        self.step_seconds = 0.0
        self.thread: threading.Thread | None = None
        self.calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = collections.deque()

    # --- from the event loop -------------------------------------------------------------------

    def submit(self, job: BatchedJob) -> None:
        with self.lock:
            self.waiting.append(Row(job, self.clock()))
            self.start_thread()
            self.lock.notify()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run `fn` on the engine's own thread, between steps (the model's loading: torch's CPU
        kernels run faster in the thread that loaded and timed them; measured on an AVX2 EPYC, one
        decode step with --quantize bf16: 92-95 ms loaded there against 111-116 loaded in another
        thread). Its result or error comes back in the future."""
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self.lock:
            self.calls.append((fn, done))
            self.start_thread()
            self.lock.notify()
        return done

    def start_thread(self) -> None:
        if self.thread is None:  # (under the lock)
            self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)
            self.thread.start()

    def position(self, job: Job) -> int | None:
        """How many requests wait ahead of this one for a place in the batch (None: it has one)."""
        with self.lock:
            return self.waiting.position(job)

    def refusal(self) -> tuple[int, int] | None:
        """None while a new request may wait for a place; else (waiting, Retry-After seconds)."""
        with self.lock:
            return self.waiting.refusal(max(0, self.max_batch - len(self.batch)))

    def metrics(self) -> dict[str, Any]:
        b = self.batch
        with self.lock:
            return {
                "engine": "batched",
                "schedule": b.policy.name,
                "max_batch": self.max_batch,
                "kv_memory": b.kv_memory,  # bytes: --kv-memory, or the budget sized for the device
                "active": b.active(),
                "waiting": len(self.waiting),
                "steps": self.steps,
                "tokens_generated": b.tokens,
                "rows_skipped": b.skipped,  # row-steps the qoe policy sat out
                **b.counts.metrics(),  # rows run, prompt tokens joined, the join steps' passes (parts.py)
                "kv_sorts": b.kv.sorts,  # the slots sorted by length (blocks.py)
                "prefix_hits": b.prefixes.hits,  # prompts prefilled after a kept shared beginning
                "prompt_tokens_shared": b.shared,  # copied from a row in the batch with the same beginning
                "retained_hits": b.prefixes.retained_hits,  # prompts begun from an ended row's keys (prefixes.py)
                "prompt_tokens_retained": b.prefixes.retained_tokens,  # the prompt tokens copied from them
                "retained_bytes": b.prefixes.retained_bytes,  # what the ended rows' keys hold now (--retain-memory)
                "speculate": b.policy.speculate,  # --speculate
                "forward": b.forward_by,  # the pass the last step took: own (decoder.py) or transformers; None before any
                "tokens_guessed": b.guessed,  # guessed tokens fed to the model (speculation.py)
                "guesses_kept": b.guesses_kept,  # of those, the ones the rows' own sampling chose too
                "step_seconds": round(self.step_seconds, 3),  # bench.py: mean step time per batch size
                "step_parts_seconds": {k: round(v, 3) for k, v in b.parts.snapshot().items()},
            }

    # --- the engine thread ---------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            with self.lock:
                while not (len(self.batch) or self.calls or self.waiting.ready(self.clock())):
                    self.lock.wait(0.05 if self.waiting else None)
                if not (len(self.batch) or self.calls) and (pause := self.waiting.landing(self.clock())) > 0:
                    self.lock.wait(pause)  # idle: the rest of a burst may be arriving (waiting.py)
                    continue
                calls = list(self.calls)
                self.calls.clear()
                if not calls:
                    try:
                        self.batch.admit(self.max_batch)
                    except Exception as e:  # noqa: BLE001 - as a failed step: its requests fail, never the thread
                        traceback.print_exc()
                        self.batch.fail(e)
            if calls:  # between steps; then wait again for what there is to do
                for fn, done in calls:
                    try:
                        done.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - the caller's to handle
                        done.set_exception(e)
                continue
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self.batch.step()
                with self.lock:
                    self.steps += 1
                    self.step_seconds += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                traceback.print_exc()  # (its readers are told only that it failed: the why is here)
                self.batch.fail(e)
            if self.after_step is not None:
                try:
                    self.after_step()
                except Exception:  # noqa: BLE001 - the engine goes on (a dead engine thread leaves every reader waiting)
                    traceback.print_exc()
            if self.token_delay:  # testing: after each token, so after a step as many as a row got
                time.sleep(self.token_delay * self.batch.widest)


class BatchedJob(Job):
    """A Job that a BatchEngine's thread runs in its batch."""

    def __init__(self, engine: BatchEngine, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engine = engine

    def start(self) -> BatchedJob:
        super().start()
        self.engine.submit(self)
        return self
