"""The step-batched generation engine: one thread, one model, every reader in one batch.

The article's server runs a thread per request, so sixteen readers share the model sixteen ways
and each gets a sixteenth of it. Here one thread owns the model and runs a loop of steps; each
step is one forward pass for the rows that run (a batch of 16 costs far less than 16 batches of
one), then one forward pass for the prompts that join. Between steps:

- the policy (policy.py: `fifo`, every row every step; or `qoe`, the rows whose readers are about
  to wait, first) says which rows run and how many prompt tokens may join;
- requests join: every waiting prompt that fits the step's prefill budget is prefilled in one
  left-padded forward pass (a burst of 48 short prompts joins in a few steps, not 48); a prompt
  longer than PREFILL_CHUNK is prefilled alone, a chunk a step, so it delays the others by a
  chunk, not by all of it. A prompt's last pass samples its first token and its KV rows join the
  batch's (kv.py: left-padded to a common length, with an attention mask and each row's own
  positions);
- the stop flags are checked, once per step, as the article says a batched engine does: a stopped
  or finished row leaves the batch at that step and its rows of the KV cache are dropped;
- at most `max_batch` requests are active; the rest wait in order (the server sends them
  keep-alive pings that say their place meanwhile), those with a reader before readerless
  resumable streams; past `max_waiting` waiting, a new request is refused (`refusal()`: the
  server's 503 with Retry-After, which a load balancer takes as "try another replica").

Each row samples with its own seeded draws, temperature and top_p (sampling.choose_batch),
and its tokens go through its job's per-token routine (job.py: its own detokenizer, its own
queue). Alone, a request gives the same tokens as with the thread engine; in a batch, its logits
can differ in the last bits (padding changes the shapes of the arithmetic), so a sampled text may
differ: in float32 rarely, in bfloat16 often (the tests state the tolerance).

Leaves out: paged KV memory (a join or leave copies the batch's cache), fusing the prefill into
the decode's forward pass, --queue's backpressure (a row is never paused for a slow reader: its
queue grows; the qoe policy skips it instead), and the repetition penalty.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from streaming.generation import kv
from streaming.generation.job import Job
from streaming.generation.parts import StepParts
from streaming.generation.policy import PREFILL_BUDGET, Fifo, Qoe, StepCosts, prefill_group
from streaming.generation.sampling import Draws, choose_batch
from streaming.generation.waiting import MAX_WAITING, WaitingRoom
from streaming.model.loading import Model, forward_kwargs

MAX_BATCH = 64  # active requests per step: past it they wait. 64 rows of 4k tokens is ~6 GB of KV in float32
PREFILL_CHUNK = (
    128  # a longer prompt is prefilled alone, this many tokens a step: the extra wait it adds to others' gaps
)


class Row:
    """One request inside the engine: its sampler, its place in the batch, and what the policy
    reads of it (policy.Reading)."""

    def __init__(self, job: BatchedJob, now: float) -> None:
        p = job.params
        self.job, self.ids = job, job.context
        self.draws = Draws(p.seed, len(job.prior))  # token i's draw depends on the seed and i only
        self.temperature, self.top_p = p.temperature, p.top_p
        self.cache: Any = None  # its own cache while a long prompt is prefilled in chunks
        self.filled = 0  # prompt tokens prefilled so far
        self.length = 0  # tokens in its KV cache: the position of the next input
        self.next: int | None = None  # the token to feed at the next step
        self.not_before = now + job.options.first_delay  # testing: --first-delay
        self.created = self.last_at = now
        self.done = False

    @property
    def delivered(self) -> int:
        return self.job.produced

    @property
    def orphaned(self) -> bool:
        return self.job.orphaned


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
    ) -> None:
        self.max_batch, self.chunk, self.token_delay = max_batch, prefill_chunk, token_delay
        self.model = model  # its network is loaded on the first step (the server listens first)
        self.device = model.device
        self.policy = policy or Fifo(PREFILL_BUDGET)
        self.clock = clock
        self.waiting = WaitingRoom(max_waiting)  # not yet admitted (from the event loop)
        self.joining: collections.deque[Row] = collections.deque()  # admitted, prompt being prefilled
        self.rows: list[Row] = []  # in the batch, one per row of `kv`
        self.kv = kv.KVBatch(self.device)
        self.prefixes = kv.Prefixes(self.device)
        self.lock = threading.Condition()
        self.steps = self.tokens = self.skipped = 0
        self.step_seconds = 0.0
        self.parts = StepParts()
        self.costs = StepCosts()  # decode steps' seconds by rows run: the policy lets rows ride where free
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
            return self.waiting.refusal(max(0, self.max_batch - len(self.rows) - len(self.joining)))

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            return {
                "engine": "batched",
                "schedule": self.policy.name,
                "max_batch": self.max_batch,
                "active": sum(not r.done for r in self.rows) + len(self.joining),
                "waiting": len(self.waiting),
                "steps": self.steps,
                "tokens_generated": self.tokens,
                "rows_skipped": self.skipped,  # row-steps the qoe policy sat out
                "prefix_hits": self.prefixes.hits,  # prompts prefilled after a kept shared beginning
                "step_seconds": round(self.step_seconds, 3),  # bench.py: mean step time per batch size
                "step_parts_seconds": {k: round(v, 3) for k, v in self.parts.snapshot().items()},
            }

    # --- the engine thread ---------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            with self.lock:
                while not (self.rows or self.joining or self.calls or self.waiting.ready(self.clock())):
                    self.lock.wait(0.05 if self.waiting else None)
                calls = list(self.calls)
                self.calls.clear()
                if not calls:
                    self.take_waiting()
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
                    self.step()
                with self.lock:
                    self.steps += 1
                    self.step_seconds += time.perf_counter() - t0
                if self.token_delay:
                    time.sleep(self.token_delay)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                for row in list(self.rows) + list(self.joining):
                    self.end(row, error=e)
                self.rows, self.kv = [], kv.KVBatch(self.device)
                self.joining.clear()

    def step(self) -> None:
        """The stop flags, then the rows the policy runs, then the prompts that join (after the
        decode: a row that joins now has its first token for this step)."""
        self.drop_stopped()
        plan = self.policy.plan(self.rows, self.clock(), self.joining[0].created if self.joining else None, self.costs)
        if plan.run:
            self.decode(sorted(plan.run))
        if self.joining:
            self.prefill(plan.prefill)

    def take_waiting(self) -> None:
        """Admit waiting rows while the batch has room (under the lock)."""
        while len(self.rows) + len(self.joining) < self.max_batch and (row := self.waiting.admit(self.clock())):
            row.job.begin(self.model)
            self.joining.append(row)

    def drop_stopped(self) -> None:
        """The once-per-step check of every stop flag (a waiting row's too: it leaves its place)."""
        with self.lock:
            gone = self.waiting.stopped()
        for row in gone:
            self.end(row, "stopped")
        for row in list(self.joining):
            if row.job.stop.is_set():
                self.joining.remove(row)
                self.end(row, "stopped")
        if any(row.job.stop.is_set() for row in self.rows):
            for row in self.rows:
                if row.job.stop.is_set():
                    self.end(row, "stopped")
            self.compact()

    def prefill(self, budget: int) -> None:
        """The joining prompts that fit `budget` tokens, in one forward pass; or one chunk of a
        long prompt. A prompt whose last token is in gets its first token and joins the batch."""
        m, device = self.model.net, self.device
        first = self.joining[0]
        if first.filled or len(first.ids) > self.chunk:
            if first.cache is None:
                first.cache = kv.new_cache(m)
            part = first.ids[first.filled : first.filled + self.chunk]
            x = torch.tensor([part], device=device)
            with self.parts.timed("prefill"):
                logits = m(input_ids=x, use_cache=True, **forward_kwargs(m, first.cache)).logits[:, -1]
            first.filled += len(part)
            if first.filled == len(first.ids):
                self.joined([first], first.cache, None, logits)
            return
        n = prefill_group([len(r.ids) for r in self.joining], budget, self.chunk)  # none is partly filled
        group = [self.joining[i] for i in range(n)]  # they leave `joining` once prefilled (a failed step ends them)
        prompts = [r.ids for r in group]
        with self.parts.timed("prefill"):
            prefix = self.prefixes.find(m, prompts, forward_kwargs)
            cache, mask, logits = kv.prefill(m, prompts, device, forward_kwargs, prefix)
        self.joined(group, cache, mask, logits)

    def joined(self, group: list[Row], cache: Any, mask: Any, logits: Any) -> None:
        """Prefilled rows: their first tokens; those that go on join the batch's cache."""
        for r in group:
            self.joining.remove(r)
            r.length = r.filled = len(r.ids)
            r.cache = None
        self.emit(group, logits)
        device = self.device
        part = kv.KVBatch(device)
        live = [i for i, r in enumerate(group) if not r.done]
        with self.parts.timed("kv"):
            part.join(cache, mask if mask is not None else kv.ones(cache, len(group), device))
            if len(live) < len(group):
                part.keep(live)
            if live:
                self.kv.join(part.cache, part.mask)
        self.rows += [group[i] for i in live]

    def decode(self, run: list[int]) -> None:
        """One forward pass for the rows `run` (indices into self.rows): each feeds its last token."""
        m, device = self.model.net, self.device
        rows = [self.rows[i] for i in run]
        everyone = len(rows) == len(self.rows)
        with self.parts.timed("kv"):
            mask = self.kv.extend() if everyone else self.kv.narrow(run)
        with self.parts.timed("forward"):
            out = m(
                input_ids=torch.tensor([[r.next] for r in rows], device=device),
                position_ids=torch.tensor([[r.length] for r in rows], device=device),
                attention_mask=mask,  # None when no row has padding: the same arithmetic as the thread engine
                use_cache=True,
                **forward_kwargs(m, self.kv.cache),
            )
        self.costs.record(len(rows), self.parts.last["forward"])
        if not everyone:
            with self.parts.timed("kv"):
                self.kv.widen(run)
            with self.lock:
                self.skipped += len(self.rows) - len(rows)
        for r in rows:
            r.length += 1
        self.emit(rows, out.logits[:, -1])
        if any(r.done for r in rows):
            self.compact()

    def emit(self, rows: list[Row], logits: Any) -> None:
        """Sample a token for each row and hand it to its job's per-token routine; a row whose job
        ended is marked done."""
        with self.parts.timed("sampling"):
            tokens = choose_batch(
                logits, [r.draws for r in rows], [r.temperature for r in rows], [r.top_p for r in rows]
            )
        now = self.clock()
        with self.lock:
            self.tokens += len(rows)
        with self.parts.timed("hand_off"):
            for row, token in zip(rows, tokens, strict=True):
                row.done = not row.job.on_token(token)
                row.next, row.last_at = token, now

    def end(self, row: Row, reason: str | None = None, error: BaseException | None = None) -> None:
        row.done = True
        if error is None:
            row.job.end(reason or "stopped")
        else:
            row.job.fail(error)

    def compact(self) -> None:
        """Drop the rows that are done: their KV memory goes with them."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        with self.lock:
            self.waiting.left(self.clock(), len(self.rows) - len(keep))  # places freed
        with self.parts.timed("kv"):
            self.kv.keep(keep)
        self.rows = [self.rows[i] for i in keep]


class BatchedJob(Job):
    """A Job that a BatchEngine's thread runs in its batch."""

    def __init__(self, engine: BatchEngine, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engine = engine

    def start(self) -> BatchedJob:
        super().start()
        self.engine.submit(self)
        return self
