"""One step of the batched engine, as the engine's thread runs it (batched.py owns the thread, the
lock and what the event loop calls): the stop flags, the rows the policy runs, the prompts that
join. `Batch` owns the rows in the batch, the prompts being prefilled, the batch's KV cache
(kv.py), the shared prefixes and the step's timings; it touches the waiting room and the
counters the event loop reads only under the engine's lock. A test drives it without a thread:
rows admitted by hand, `step()` with a fake clock.

- a step first checks every stop flag once (a stopped or finished row leaves at that step and its
  rows of the KV cache are dropped), then decodes the rows the policy runs (one forward pass),
  then prefills the prompts that join: every waiting prompt that fits the step's prefill budget
  in one left-padded forward pass, or one PREFILL_CHUNK of a longer prompt (alone, a chunk a
  step). A prompt's last pass samples its first token and its KV rows join the batch's;
- each row samples with its own seeded draws, temperature and top_p (sampling.choose_batch), and
  its tokens go through its job's per-token routine (job.py).

Leaves out: the thread and its wait (batched.py), paged KV memory (a join or leave copies the
batch's cache), and fusing the prefill into the decode's forward pass.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import torch

from streaming.generation import kv
from streaming.generation.job import Job
from streaming.generation.parts import StepParts
from streaming.generation.policy import Fifo, Qoe, StepCosts, prefill_group
from streaming.generation.sampling import Draws, choose_batch
from streaming.generation.waiting import WaitingRoom
from streaming.model.loading import Model, forward_kwargs


class Row:
    """One request inside the engine: its sampler, its place in the batch, and what the policy
    reads of it (policy.Reading)."""

    def __init__(self, job: Job, now: float) -> None:
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


class Batch:
    def __init__(
        self,
        model: Model,
        chunk: int,
        policy: Fifo | Qoe,
        clock: Callable[[], float],
        waiting: WaitingRoom,
        lock: threading.Condition,
    ) -> None:
        self.model, self.device, self.chunk, self.policy, self.clock = model, model.device, chunk, policy, clock
        self.waiting, self.lock = waiting, lock  # shared with the event loop: touched under the lock
        self.joining: collections.deque[Row] = collections.deque()  # admitted, prompt being prefilled
        self.rows: list[Row] = []  # in the batch, one per row of `kv`
        self.kv = kv.KVBatch(self.device)
        self.prefixes = kv.Prefixes(self.device)
        self.parts = StepParts()
        self.costs = StepCosts()  # decode steps' seconds by rows run: the policy lets rows ride where free
        self.tokens = self.skipped = 0  # tokens sampled, row-steps sat out (written under the lock)

    def __len__(self) -> int:
        """Requests that hold a place: in the batch or being prefilled."""
        return len(self.rows) + len(self.joining)

    def active(self) -> int:
        return sum(not r.done for r in self.rows) + len(self.joining)

    def admit(self, room: int) -> None:
        """Admit waiting rows into at most `room` places (under the lock)."""
        while len(self) < room and (row := self.waiting.admit(self.clock())):
            row.job.begin(self.model)
            self.joining.append(row)

    def fail(self, error: BaseException) -> None:
        """A step failed: every request in it fails, the batch starts empty (the engine goes on)."""
        for row in list(self.rows) + list(self.joining):
            self.end(row, error=error)
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
