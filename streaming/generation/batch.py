"""One step of the batched engine, as the engine's thread runs it (batched.py owns the thread, the
lock and what the event loop calls): the stop flags, the rows the policy runs, the prompts that
join, all in one forward pass. `Batch` owns the rows in the batch, the prompts being prefilled,
the slots of the KV cache (kv.py), the shared prefixes and the step's timings; it touches the
waiting room and the counters the event loop reads only under the engine's lock. A test drives
it without a thread: rows admitted by hand, `step()` with a fake clock.

- a step first checks every stop flag once (a stopped or finished row leaves at that step and its
  slot is freed), then runs one forward pass over a flat sequence of tokens: the last token of
  each row the policy runs, then the pieces of joining prompts that fit the step's prefill budget
  (a prompt longer than PREFILL_CHUNK a chunk a step, so it delays the others by a chunk, not all
  of it; the budget stretched by up to a quarter where that spares them a step, policy.stretch).
  Each token's keys and values go straight into its row's slot, and attention reads the slots
  (attention.py), so the rows that sit out cost nothing and the prompts that join ride in
  the decode's pass instead of a second one (Sarathi-Serve's chunked prefill, one weight read);
- a prompt that shares a beginning with a row in the batch copies it from that row's slot (a
  kept system prompt from the kept prefixes), computing only the rest; if that beginning is
  still being computed in the other's slot, it waits and copies it then (sharing.py);
- a prompt whose last piece is in gets its first token from that pass and joins the decoding rows,
  and so do its exact repeats not started (they copy its keys and sample from its logits);
- a step of a few rows and no prompt carries guessed tokens after each row's next one, looked up
  in its own text (speculation.py), and the row keeps those its own draws choose anyway;
- each row samples with its own seeded draws, temperature and top_p (sampling.choose_batch), and
  its tokens go through its job's per-token routine (job.py).

Leaves out: the thread and its wait (batched.py), and paged KV memory (kv.py).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from streaming.generation import decoder, sharing
from streaming.generation.job import Job
from streaming.generation.kv import KV_MEMORY, Layout, SlotKV, default_kv_memory, fits
from streaming.generation.parts import StepCounts, StepParts
from streaming.generation.policy import READING_RATE, Fifo, Qoe, StepCosts, prefill_group, stretch
from streaming.generation.prefixes import RETAIN_MEMORY, RETAIN_STEP, Prefixes
from streaming.generation.sampling import Draws, choose_batch
from streaming.generation.speculation import Lookup, Odds, kept
from streaming.generation.waiting import WaitingRoom
from streaming.model.loading import Model, forward_kwargs


class Row:
    """One request inside the engine: its sampler, its slot, and what the policy reads of it
    (policy.Reading)."""

    def __init__(self, job: Job, now: float) -> None:
        p = job.params
        self.job, self.ids = job, job.context
        self.draws = Draws(p.seed, len(job.prior))  # token i's draw depends on the seed and i only
        self.temperature, self.top_p = p.temperature, p.top_p
        self.salt = p.cache_salt  # its keys are shared only with rows of the same (prefixes.py)
        self.slot: int | None = None  # its place in the KV cache, from its first prompt piece on
        self.filled = 0  # prompt tokens in its slot so far
        self.length = 0  # tokens in its slot: the position of the next input
        self.next: int | None = None  # the token to feed at the next step
        self.not_before = now + job.options.first_delay  # testing: --first-delay
        # A stream taken over from another replica brings its answer so far (`prior`), read by
        # then: its reader is taken to be caught up now. (Created now with `prior` delivered, its
        # slack was 1 + P/R s, so it was never urgent: about a token per MAX_SKIP under load.)
        self.created = now - len(job.prior) / READING_RATE
        self.last_at = now
        self.done = False
        self.lookup = Lookup(self.ids)  # its text, where its guesses come from (speculation.py)
        self.guesses: list[int] = []  # fed after `next` at this step
        self.match = 0  # the length of the text's tail they were looked up by
        self.spared = False  # a failed step left it waiting, its prompt not begun (spare_once): once only

    @property
    def delivered(self) -> int:
        return self.job.produced

    @property
    def orphaned(self) -> bool:
        return self.job.orphaned

    @property
    def planned(self) -> int:
        return self.job.params.max_tokens

    def take(self, tokens: list[int], odds: Odds, now: float) -> int:
        """This step's tokens (one, or the guesses kept and the token after them): its draws, slot
        and text move on, the odds learn, and each goes to its job until its end. Returns how many
        came after its end (an end of sequence among the guesses kept)."""
        self.draws.i += len(tokens)
        self.length += len(tokens) - 1  # the guesses kept are in its slot (the token fed: forward)
        self.lookup.extend(tokens)
        if self.guesses:
            odds.guessed(self.match, len(self.guesses), len(tokens) - 1)
        self.guesses, self.next, self.last_at = [], tokens[-1], now
        for i, token in enumerate(tokens):
            if i and self.job.stop.is_set():  # stopped meanwhile: at most this step's first token
                return len(tokens) - i
            self.done = not self.job.on_token(token)
            if self.done:
                return len(tokens) - i - 1
        return 0

    def end(self, reason: str = "stopped", error: BaseException | None = None) -> None:
        self.done = True
        if error is None:
            self.job.end(reason)
        else:
            self.job.fail(error)


class Batch:
    def __init__(
        self,
        model: Model,
        chunk: int,
        policy: Fifo | Qoe,
        clock: Callable[[], float],
        waiting: WaitingRoom,
        lock: threading.Condition,
        kv_memory: int | None = KV_MEMORY,
        retain_memory: int = RETAIN_MEMORY,
    ) -> None:
        self.model, self.device, self.chunk, self.policy, self.clock = model, model.device, chunk, policy, clock
        self.kv_memory = default_kv_memory(str(self.device)) if kv_memory is None else kv_memory  # kv.py
        self.waiting, self.lock = waiting, lock  # shared with the event loop: touched under the lock
        self.joining: collections.deque[Row] = collections.deque()  # admitted, prompt being prefilled
        self.rows: list[Row] = []  # decoding
        self.kv = SlotKV(self.device)
        self.prefixes = Prefixes(self.device, retain_memory=retain_memory)
        self.parts = StepParts(str(self.device))  # on a GPU each part waits for its kernels (parts.py)
        self.costs = StepCosts()  # decode steps' seconds by rows run: the policy lets rows ride where free
        self.odds = Odds()  # what guesses are worth here: kept how often, passes cost how much
        self.widest = 1  # the most tokens one row got at the last step (its guesses kept and one)
        self.forward_by: str | None = None  # the pass the last step took (decoder.py; --forward)
        # (under the lock) tokens sampled, row-steps sat out, prompt tokens copied from another row's
        # slot instead of computed, guessed tokens fed and kept (speculation.py)
        self.tokens = self.skipped = self.shared = self.guessed = self.guesses_kept = 0
        self.counts = StepCounts()  # (under the lock) rows run, prompt tokens joined (bench_qoe.py's steady window)

    def __len__(self) -> int:
        """Requests that hold a place: in the batch or being prefilled."""
        return len(self.rows) + len(self.joining)

    def active(self) -> int:
        return sum(not r.done for r in self.rows) + len(self.joining)

    def admit(self, room: int) -> None:
        """Admit waiting rows into at most `room` places, within the KV memory (under the lock)."""
        while len(self) < room and (row := self.waiting.admit(self.clock(), self.fits)):
            try:
                if not row.job.begin(self.model):  # its answer so far is whole: it has ended, no step
                    continue
            except Exception as e:  # noqa: BLE001 - this request fails (an id the model has not: InvalidRequest), not the engine
                row.end(error=e)
                continue
            self.joining.append(row)

    def fits(self, row: Row) -> bool:
        return fits([len(r.ids) + r.planned for r in [*self.rows, *self.joining, row]], self.model.net, self.kv_memory)

    def fail(self, error: BaseException) -> None:
        """A step failed: every request in it fails (the rows, and the prompts begun: their keys go
        with the slots), the batch starts empty but for the prompts spare_once() keeps (the engine
        goes on). A row that ended in the step before it failed keeps its end (it was ended twice:
        counted twice, and an error put after its end)."""
        spared = spare_once(self.joining)
        kept = {id(r) for r in spared}
        for row in [*self.rows, *self.joining]:
            if not row.done and id(row) not in kept:
                row.end(error=error)
        self.rows = []
        self.kv.clear()  # every slot freed
        self.joining = collections.deque(spared)

    def step(self) -> None:
        """The stop flags, then one pass: the rows the policy runs and the prompts that join (a
        row whose prompt is all in has its first token from this pass)."""
        self.drop_stopped()
        with self.parts.timed("kv"):
            self.kv.settle()  # slots sorted by length where it pays (blocks.py), before any slot is read
        waiting = sharing.to_prefill(self.joining, self.holders(), self.prefixes) if self.joining else 0
        first = self.joining[0].created if self.joining else None
        plan = self.policy.plan(self.rows, self.clock(), first, self.costs, waiting)
        run = sorted((self.rows[i] for i in plan.run), key=lambda r: r.slot or 0)  # in slot order
        pieces = self.pieces(stretch(plan.prefill, waiting)) if self.joining else []
        if not pieces and 0 < len(run) == len(self.rows) <= self.policy.speculate:  # a small batch, all running
            guess(run, self.policy.speculate, self.odds)
        if run or pieces:
            self.forward(run, pieces, sharing.twins(pieces, self.joining))

    def drop_stopped(self) -> None:
        """The once-per-step check of every stop flag (a waiting row's too: it leaves its place)."""
        with self.lock:
            gone = self.waiting.stopped()
        for row in gone:
            row.end("stopped")
        for row in list(self.joining):
            if row.job.stop.is_set():
                self.joining.remove(row)
                row.end("stopped")
                if row.slot is not None:
                    self.kv.release(row)
        if any(row.job.stop.is_set() for row in self.rows):
            for row in self.rows:
                if row.job.stop.is_set():
                    row.end("stopped")
            self.compact()

    def holders(self) -> list[Row]:
        """The rows with a slot (whose prompt's keys a joining prompt may copy), the most filled
        first: of two that share as much, the one whose keys are in is chosen."""
        return sorted((r for r in (*self.rows, *self.joining) if r.slot is not None), key=lambda r: -r.filled)

    def pieces(self, budget: int) -> list[tuple[Row, int]]:
        """The prompt tokens that join this step, in order, at most `budget` (a prompt longer
        than the chunk at most a chunk of it): (row, tokens) each. A prompt starting now takes a
        slot, after the beginning it shares with a row in the batch (copied from its slot) or a
        kept shared beginning (learned from the prompts starting together). One whose shared
        beginning is still being computed in the other's slot waits for it, then copies it."""
        if fresh := [r for r in self.joining if r.slot is None]:
            self.kv.fit(len(self.kv) + len(fresh), 1)  # every newcomer's slot at once: one copy, not one a step
            for salt, group in starting(fresh, budget, self.chunk).items():
                with self.parts.timed("prefill"):  # rare: a new shared beginning's own pass
                    self.prefixes.learn(self.model.net, group, forward_kwargs, salt)
        out: list[tuple[Row, int]] = []
        left = budget
        for row in self.joining:
            if left <= 0:
                break
            if row.slot is None:
                donor, share, _ = sharing.beginning(row, self.holders(), self.prefixes)
                if donor is not None and donor.filled < share:
                    continue  # being computed in the donor's slot (this step or its next chunks): copied then
                self.start(row, donor, share)
            rest = len(row.ids) - row.filled
            n = min(rest, left, self.chunk if len(row.ids) > self.chunk else rest)
            out.append((row, n))
            left -= n
        return out

    def start(self, row: Row, donor: Row | None, share: int) -> None:
        copied = sharing.start(row, donor, share, self.kv, self.prefixes)
        with self.lock:
            self.shared += copied

    def forward(self, run: list[Row], pieces: list[tuple[Row, int]], riders: list[tuple[Row, Row]]) -> None:
        """One forward pass: a token for each row in `run` (and its guesses after it, as a piece of
        its own), the prompt pieces after them; then each of `riders` joins on its twin's keys and
        logits (sharing.twins)."""
        m = self.model.net
        plain, guessing = [r for r in run if not r.guesses], [r for r in run if r.guesses]
        with self.parts.timed("kv"):
            layout = layout_of(self.kv, plain, guessing, pieces)
            most = max(len(r.ids) + r.planned for r in (*self.rows, *self.joining))  # (the longest a row grows)
            self.kv.fit(len(self.kv), layout.room(), most)
        ids, positions, keep, joined = flat_inputs(plain, guessing, pieces, layout)
        self.kv.layout = layout
        tensors = (torch.tensor(x, dtype=torch.long, device=self.device) for x in (ids, positions, keep))
        self.forward_by = decoder.chosen(m, self.model.choice.forward == "own")
        with self.parts.timed("forward"):
            logits = decoder.step(m, self.forward_by, layout, self.kv, *tensors)
        self.kv.layout = None
        if not pieces:  # a decode step's cost: by tokens (what guesses cost); without guesses by rows run
            self.odds.passed(len(ids), self.parts.last["forward"])
            if not guessing:
                self.costs.record(len(run), self.parts.last["forward"], self.clock())
        with self.lock:
            self.skipped += len(self.rows) - len(run)
            self.counts.step(len(run), [n for _, n in pieces], self.parts.last["forward"])
        for r in run:
            r.length += 1
        for r, n in pieces:
            r.filled += n
            r.length = r.filled
        if riders:
            with self.parts.timed("kv"):
                logits, copied = board(riders, joined, logits, self.kv)
            joined += [r for r, _ in riders]
            with self.lock:
                self.shared += copied
        for r in joined:
            self.joining.remove(r)
            self.rows.append(r)
        self.emit(plain + guessing + joined, logits)
        if any(r.done for r in run + joined):
            self.compact()

    def emit(self, rows: list[Row], logits: Any) -> None:
        """Sample each row's token (a row with guesses: at each of their places, keeping those its
        draws confirm) and hand them to its job's per-token routine; a row whose job ended is
        marked done."""
        with self.parts.timed("sampling"):
            taken = sample(rows, logits)
        self.widest = max(map(len, taken), default=1)  # the most tokens a row got (--token-delay paces each)
        now = self.clock()
        with self.lock:  # counted before they are handed off: a reader who has their end sees them counted
            self.tokens += sum(map(len, taken))
            self.guessed += sum(len(r.guesses) for r in rows)
            self.guesses_kept += sum(map(len, taken)) - len(rows)
        with self.parts.timed("hand_off"):
            undelivered = sum(row.take(tokens, self.odds, now) for row, tokens in zip(rows, taken, strict=True))
        if undelivered:  # (a step's first token always goes: those after an end were guesses kept)
            with self.lock:
                self.tokens -= undelivered
                self.guesses_kept -= undelivered

    def compact(self) -> None:
        """Drop the rows that are done: their slots go back."""
        gone = [r for r in self.rows if r.done]
        with self.lock:
            self.waiting.left(self.clock(), len(gone))  # places freed
        with self.parts.timed("kv"):
            if gone and self.joining:  # prompts waiting on a row that leaves copy from it first
                for row, donor, share in sharing.inherit(gone, self.joining, self.holders(), self.prefixes):
                    self.start(row, donor, share)
            retire(gone, self.kv, self.prefixes)
        self.rows = [r for r in self.rows if not r.done]


def starting(fresh: list[Row], budget: int, chunk: int) -> dict[str | None, list[list[int]]]:
    """The prompts not started that this step's budget takes, by salt (each salt's prefixes its
    own, prefixes.py: tenants apart), each once: the kept prefix is learned from them (a repeat
    copies its twin instead)."""
    distinct = list({(r.salt, tuple(r.ids)): r for r in fresh}.values())
    group = distinct[: prefill_group([len(r.ids) for r in distinct], budget, chunk)]
    return {salt: [r.ids for r in group if r.salt == salt] for salt in dict.fromkeys(r.salt for r in group)}


def board(riders: list[tuple[Row, Row]], joined: list[Row], logits: Any, kv: SlotKV) -> tuple[Any, int]:
    """After the pass, each rider (sharing.twins) takes a slot with its twin's keys, its row of
    logits a copy of its twin's (the rows of `joined` are the last of `logits`): the logits with
    the riders' after them, and the tokens copied."""
    twins = [len(logits) - len(joined) + joined.index(t) for _, t in riders]
    return torch.cat((logits, logits[twins])), sum(sharing.ride(r, t, kv) for r, t in riders)


def spare_once(joining: collections.deque[Row]) -> list[Row]:
    """The prompts a failed step leaves waiting, to join at the next step: those not begun (no
    slot: they were in no pass), each once. What fails before a prompt has its slot (its slot's
    room, a shared beginning's pass) fails again at every step: spared every time, the engine
    stepped on for ever, nobody's answer ending."""
    spared = [r for r in joining if r.slot is None and not r.spared and not r.done]
    for row in spared:
        row.spared = True
    return spared


def retire(gone: list[Row], kv: SlotKV, prefixes: Prefixes) -> None:
    """The finished rows' slots go back; those that fit in RETAIN_STEP tokens in all (a step's
    copying), in order, are kept first as beginnings a next turn may copy (prefixes.py)."""
    budget = RETAIN_STEP
    for r in gone:
        assert r.slot is not None
        if r.length <= budget:
            budget -= r.length
            prefixes.retain(r.lookup.ids[: r.length], kv, r.slot, r.salt)
        kv.release(r)


def guess(run: list[Row], most: int, odds: Odds) -> None:
    """Each running row's guesses for this step, looked up in its own text: as many as the odds
    say pay, at most `most` in all and never past its max_tokens (speculation.Odds.shares)."""
    proposals = []
    for r in run:
        r.match, ids = r.lookup.propose(min(most, r.planned - r.delivered - 1))
        proposals.append(ids)
    counts = odds.shares([(r.match, len(p)) for r, p in zip(run, proposals, strict=True)], most)
    for r, p, n in zip(run, proposals, counts, strict=True):
        r.guesses = p[:n]


def layout_of(kv: SlotKV, plain: list[Row], guessing: list[Row], pieces: list[tuple[Row, int]]) -> Layout:
    """Where the step's tokens go: a plain row's one token; a guessing row's token and guesses as
    a piece of its slot from its length on; each prompt piece."""
    slot = lambda r: cast(int, r.slot)  # noqa: E731 - every row in a step has its slot
    return Layout(
        kv,
        [(slot(r), r.length) for r in plain],
        [(slot(r), r.length, 1 + len(r.guesses)) for r in guessing] + [(slot(r), r.filled, n) for r, n in pieces],
        [o.length for o in kv.owners],
    )


def sample(rows: list[Row], logits: Any) -> list[list[int]]:
    """Each row's tokens from its logits: one, or for a row with guesses those it keeps (its token
    at each place, with the draw of that token's index, up to the first that differs from its
    guess; speculation.kept). `logits` holds 1 + len(guesses) rows for each row, in order."""
    each = [(r, j) for r in rows for j in range(1 + len(r.guesses))]
    sampled = choose_batch(
        logits,
        [Draws(r.draws.seed, r.draws.i + j) for r, j in each],
        [r.temperature for r, _ in each],
        [r.top_p for r, _ in each],
    )
    out, at = [], 0
    for r in rows:
        mine = sampled[at : at + 1 + len(r.guesses)]
        out.append(mine[: kept(r.guesses, mine)])
        at += len(mine)
    return out


def flat_inputs(
    plain: list[Row], guessing: list[Row], pieces: list[tuple[Row, int]], layout: Layout
) -> tuple[list[int], list[int], list[int], list[Row]]:
    """The step's flat sequence: its token ids and their positions (each plain running row's next
    token, each guessing row's next token and guesses, then the prompt pieces), the places whose
    logits are wanted (each decode token's and guess's, and each prompt's last token where this
    piece ends it) and the rows whose prompt this step completes."""
    fed = [[r.next, *r.guesses] for r in guessing]
    ids = [r.next for r in plain] + [t for f in fed for t in f]
    ids += [t for r, n in pieces for t in r.ids[r.filled : r.filled + n]]
    positions = [r.length for r in plain] + [
        p for r in guessing for p in range(r.length, r.length + 1 + len(r.guesses))
    ]
    positions += [p for r, n in pieces for p in range(r.filled, r.filled + n)]
    joined, keep = [], list(range(len(plain)))
    for r, (*_, offset, _) in zip(guessing, layout.pieces[: len(guessing)], strict=True):
        keep += range(offset, offset + 1 + len(r.guesses))
    for (r, n), (*_, offset, _) in zip(pieces, layout.pieces[len(guessing) :], strict=True):
        if r.filled + n == len(r.ids):
            joined.append(r)
            keep.append(offset + n - 1)
    return ids, positions, keep, joined  # type: ignore[return-value]
