"""Which rows run at the next step, and how many prompt tokens join: the engine's scheduling
policy, as plain objects over what each row has delivered and a clock (the tests drive them with
a fake one; the engine passes time.monotonic()).

`fifo` is every peer's: every active row runs every step, and joining prompts take a fixed
`--prefill-budget` of tokens a step.

`qoe` schedules for what a reader feels (the Andes paper's measure, streaming/qoe.py): a reader
expects the first text within TTFT (1 s) and then reads R tokens a second (4.6). A row's *slack*
is the time left before its reader, reading at R from TTFT on, runs out of delivered text:

    slack = created + TTFT + delivered / R - now       (a prompt not yet answered: delivered 0)

A row with little slack runs (its reader is about to wait, or waits already); a row far ahead
can sit steps out, which makes the step cheaper for the others and leaves time to prefill
newcomers, whose first text is what a burst waits for. The prompts that wait to join take the
whole MAX_PREFILL when the first of them is as far behind as any running row (in a burst, first
text for everyone before more text for some); otherwise the budget plus what the running rows'
slack can spare. It is work-conserving: a row sits a step out only when its place serves someone
who needs it (a reader about to wait, or a prompt waiting to join whose first text would come
late with every row riding along: not a lone arrival's short prompt, `joiners_can_wait`), and even
then rows ride along where the engine's measured step costs (`StepCosts`) say they cost at most 10%
more; with nobody in need every row runs, orphans too, since an idle machine holding a stream back
helps nobody. For a reader about to wait, the rows ahead ride along too while the step keeps
every reader in it at KEEP_PACE x R (the urgent one still gains text; nobody's tokens are left for
later without need), and every row rides where a step of all of them keeps every reader at
FULL_PACE x R (a large batch that still outpaces its readers: sitting rows out would only move
their tokens later and cost tokens a second); and every reader's row rides where no step of that
many rows (its band of StepCosts) was measured lately and no prompt waits to join: its cost is
learned (in a burst of 8 after a lone reader, half of them about to wait, the half ahead sat out
for want of a measured step of 8, which costs 72 ms here against 67 for one of 4; orphans stay in
the spare places, and a batch small enough to carry guessed tokens, whose steps are not recorded,
keeps the rule before); in a step that prompts join, too, where they get
their first text in time with every row riding (`joiners_can_wait`). And where a kernel works in
blocks of rows (the costs, kept for each row count, jump past a block), a decode step runs the
rows that fill whole blocks and the rest in turn (`cheapest`): 7 rows on the AVX2 kind's fp16
weights, 6 a step, each reader gets more text a second.

**Under overload, the rows worth the step.** When more readers need text than the machine can
keep at reading speed, which of them run decides what they feel. A token now is worth most to
the readers with the most of their expected reading window still ahead, after Andes (Liu et al.
2024): a reader who waits loses, each second, R times the time left in their window, out of a
whole area of L²/2R (L: the answer's length, its max_tokens), so the gain of serving a waiting
row is (window end - now) / L² — newer and shorter answers first, and among equals always the
same ones (the earlier asked). A step runs the urgent rows in that order, as many as give the
most gain per second of step from the measured step costs (`worth_running`; a smaller step only
from costs measured in the last 10 s, and only for 10% more): with equal gains (a burst) all of
them, the most tokens a second; when some readers' windows are nearly spent, the others run in a
smaller, faster step. (Running at most the rows that the costs keep at
reading speed, whole readers, served 16 of 24 at 1.0 on a model of this machine, but in the
measured Poisson runs it lost a third of the throughput where 16 rows cost just over 1/R, and
mean QoE with it: 0.762 against fifo's 0.856 at 0.35/s.) Promises kept:
- no starvation: no row waits more than MAX_SKIP seconds between tokens, whatever its place;
- a resumable stream with no reader (orphaned) runs only in the spare places of a step.

Either way, a step's prefill budget stretches by up to STRETCH where that spares the waiting
prompts a step (`stretch`: the burst's last prompt does not wait a step of its own for its last
few tokens).

Leaves out: preemption (a row keeps its KV memory while it waits) and Andes' knapsack over
predicted lengths (the gain order here is its greedy form, with max_tokens for the length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from streaming.generation.costs import BANDS, StepCosts
from streaming.generation.speculation import SPECULATE

READING_RATE = 4.6  # tokens/s a person reads (238 words a minute through this tokenizer: reading_speed.py)
EXPECTED_TTFT = 1.0  # seconds a reader expects to wait for the first text (the Andes paper's default)
HORIZON = 1.0  # seconds of slack under which a row runs: a few steps' worth, so it never runs dry
MIN_BATCH = 4  # rows that run anyway when fewer are urgent: a step of 4 costs about what a step of 1 does
MAX_SKIP = 2.0  # seconds: no row goes longer between tokens, whatever its slack (no starvation)
PREFILL_BUDGET = 256  # prompt tokens prefilled per step (fifo, and qoe's floor): ~0.35 s here, a gap readers absorb
# qoe: the most prompt tokens one step takes, however much slack there is. The prompts ride in the
# decode's own pass, so smaller steps cost no second weight read and give the first prompts their
# text sooner: a burst of 48 chat prompts (bfloat16, the AVX-512 Xeon) got its first text at p50
# 6.1 s, p99 9.3 s with 512 against 8.3 s and 9.5 s with 2,048 (one 8 s step for 43 of them).
MAX_PREFILL = 512
# A step may take up to this much more than its prefill budget when that spares the waiting prompts
# a step: their tokens spread evenly over the fewest steps of at most 1.25x the budget. A burst of 48
# chat prompts left its last 44 tokens to a step of their own (184 ms, a weight read and 47 decode
# rows for one prompt's first text), which the last reader's first text waited for.
STRETCH = 1.25
PREFILL_TOKEN_SECONDS = 1.4e-3  # prefill cost a token, measured here: 8 prompts of 45 tokens in 0.50 s (bf16, 0.5B)
SCHEDULES = ("fifo", "qoe")
TIE = 1e-9  # qoe: a row's worth beside its gain, so that among rows worth nothing more rows win (throughput)
# qoe: a smaller step of urgent rows runs only where it gives this much more gain a second than all
# of them: per-row step costs here are nearly flat from 8 to 32 rows (18.6, 17.7, 18.3 ms a row),
# so with equal gains the choice would flip on the moving averages' noise, leaving rows out for it.
SMALLER_STEP = 0.1
# qoe: rows ahead of their readers ride along in a step for readers about to wait (no prompt joining)
# while it keeps every reader in it at this multiple of the reading rate, by the measured costs: a
# reader about to wait then gains half a second of text a second all the same, and the rows ahead
# do not fall behind for it. Without it, 12 rows at once in steady Poisson load (0.35/s, the AVX2
# kind) ran 4 at a time for a few urgent readers, 39 tokens/s where steps of 12 give 60-78.
KEEP_PACE = 1.5
# qoe: and every row rides along, urgent readers or not, where a step of all of them keeps every
# reader at this multiple of the reading rate (by the step of that many rows measured lately):
# nobody falls behind for it, and rows sitting out would only move tokens later. At 2.4 requests
# a second with 96 rows (the AVX-512 kind), steps kept to KEEP_PACE left 20-30% of the rows out,
# in the prompts' join steps the most: 331 tokens/s where a burst of as many readers got 450.
FULL_PACE = 1.2
# qoe: prompts joining while every running row is ahead of its reader make no row sit out when
# their prefill, with every row riding along, still leaves them this much of their expected first
# text's second (against the step costs' noise). A Poisson arrival's 50-token prompt took a step of
# 4 rows about once in five steps at 1.4/s, and the rows sitting out cost 17% of the tokens a second
# that fifo kept (179.5 against a burst's 215.2 tokens/s at as many readers; fifo 0.94x) for 40 ms
# of first text.
JOIN_MARGIN = 0.5


class Reading(Protocol):
    """What a policy knows of a row."""

    @property
    def created(self) -> float: ...  # when the request arrived (the policy's clock)
    @property
    def delivered(self) -> int: ...  # tokens generated so far
    @property
    def last_at(self) -> float: ...  # when it last ran (or arrived)
    @property
    def orphaned(self) -> bool: ...  # no reader connected (a resumable stream between readers)
    @property
    def planned(self) -> int: ...  # the answer's most tokens (its max_tokens): its reader's whole window


@dataclass(frozen=True)
class Plan:
    run: list[int]  # indices of the active rows that decode this step
    prefill: int  # prompt tokens that may join this step


class Fifo:
    name = "fifo"

    def __init__(self, budget: int = PREFILL_BUDGET, speculate: int = SPECULATE) -> None:
        self.budget = budget
        self.speculate = speculate  # guessed tokens a small decode step may carry (speculation.py)

    def plan(
        self,
        rows: Sequence[Reading],
        now: float,  # noqa: ARG002 - as Qoe.plan
        joining: float | None = None,  # noqa: ARG002
        costs: StepCosts | None = None,  # noqa: ARG002
        waiting: int | None = None,  # noqa: ARG002
    ) -> Plan:
        return Plan(list(range(len(rows))), self.budget)


class Qoe:
    name = "qoe"

    def __init__(
        self,
        budget: int = PREFILL_BUDGET,
        rate: float = READING_RATE,
        ttft: float = EXPECTED_TTFT,
        horizon: float = HORIZON,
        min_batch: int = MIN_BATCH,
        token_seconds: float = PREFILL_TOKEN_SECONDS,
        conserving: bool = True,
        speculate: int = SPECULATE,
    ) -> None:
        self.budget, self.rate, self.ttft, self.horizon = budget, rate, ttft, horizon
        self.speculate = speculate  # guessed tokens a small decode step may carry (speculation.py)
        self.min_batch, self.token_seconds, self.conserving = min_batch, token_seconds, conserving

    def slack(self, created: float, delivered: int, now: float) -> float:
        """Seconds before a reader who reads at R from TTFT on runs out of text (negative: waiting)."""
        return created + self.ttft + delivered / self.rate - now

    def gain(self, row: Reading, now: float) -> float:
        """What a token now is worth to this row's reader, relatively (Andes): the seconds left in
        their expected reading window over the whole window's area (L² up to a constant)."""
        length = max(1, row.planned)
        return max(0.0, row.created + self.ttft + length / self.rate - now) / (length * length)

    def joiners_can_wait(
        self, joining: float, waiting: int | None, n: int, now: float, costs: StepCosts | None
    ) -> bool:
        """Whether the prompts waiting to join (`waiting` tokens, the first arrived at `joining`)
        get their first text with JOIN_MARGIN of their expected first text's time to spare when all
        `n` running rows ride along: their prefill at the measured cost of a prompt token, plus a
        step of n rows for each prefill budget's worth. Unknown costs or tokens: they cannot."""
        step = costs.of(n) if costs is not None else None
        if waiting is None or step is None:
            return False
        prefill = waiting * self.token_seconds + math.ceil(waiting / max(1, self.budget)) * step
        return self.slack(joining, 0, now) - prefill >= JOIN_MARGIN

    @staticmethod
    def worth_running(gains: list[float], fixed: int, costs: StepCosts, now: float | None = None) -> int:
        """How many of the urgent rows (by gain, highest first) to run with `fixed` others: the
        count whose summed gain per second of step is the highest, of those whose step cost is
        measured lately (StepCosts.recent; all of them when theirs is not: it is learned), a
        smaller step only where it gives SMALLER_STEP more (measured costs are noisy, and a row
        left out waits). Equal gains: all of them, the most tokens a second; a few readers near
        the end of their window: the others run faster."""
        n = len(gains)
        # A whole step's cost measured lately, else all of them (learned again): with any age, a first
        # burst of 48 after the server's warm-up (64 rows, first-touch pages) and a burst of 32 ran 31
        # rows a step against the fresh 32-row cost, 213.8 tokens/s where w8a8 ran all 48 at 250.8.
        whole = costs.recent(n + fixed, now)
        if whole is None:
            return n
        best, value = n, (sum(gains) + TIE * n) / whole
        bar = value * (1 + SMALLER_STEP)
        for b in BANDS:  # a smaller step, of the rows worth the most
            k, cost = b - fixed, costs.recent(b, now)
            if 0 < k < n and cost is not None and (v := (sum(gains[:k]) + TIE * k) / cost) > max(value, bar):
                best, value = k, v
        return best

    @staticmethod
    def cheapest(run: list[int], keep: int, costs: StepCosts, now: float) -> list[int]:
        """The first k rows of `run` (at least `keep`, the rows that must run), where a step of
        exactly k rows gives SMALLER_STEP more tokens a second than one of all of them, by both
        counts' costs measured lately (StepCosts.exactly); else all. A kernel that works in
        blocks of rows makes the rows past a block dear: on the AVX2 kind a 7th row makes a step
        of fp16 weights cost half as much again (113 against 76 ms), so 7 readers served 6 at a
        time, in turn, each get more text a second than all 7 at every step (11.3 against 8.8).
        Both costs fresh or nothing: a count that stops running is measured again within
        FRESH_SECONDS, as the whole step runs then."""
        n = len(run)
        whole = costs.exactly(n, now)
        if whole is None or n < 2:
            return run
        best, value = n, n / whole
        bar = value * (1 + SMALLER_STEP)
        for k in range(max(1, keep), n):
            cost = costs.exactly(k, now)
            if cost is not None and k / cost > max(value, bar):
                best, value = k, k / cost
        return run[:best]

    def plan(
        self,
        rows: Sequence[Reading],
        now: float,
        joining: float | None = None,
        costs: StepCosts | None = None,
        waiting: int | None = None,
    ) -> Plan:
        """`joining`: when the first prompt waiting to join arrived (None: none waits); `costs`:
        the engine's step costs, to let rows ride along where they cost next to nothing, and to
        know how many rows a step keeps at reading speed; `waiting`: the prompt tokens waiting to
        join (None: not said)."""
        slack = [self.slack(r.created, r.delivered, now) for r in rows]
        starving = [i for i, r in enumerate(rows) if now - r.last_at >= MAX_SKIP]
        urgent = [i for i, r in enumerate(rows) if not r.orphaned and slack[i] < self.horizon and i not in starving]
        if self.conserving and not urgent and not starving:  # nobody needs a place
            if joining is None and costs is not None:  # in turn: the longest without a token, then the least ahead
                turn = sorted(range(len(rows)), key=lambda i: (rows[i].last_at, slack[i]))
                return Plan(sorted(self.cheapest(turn, 0, costs, now)), self.budget)
            if joining is None or self.joiners_can_wait(joining, waiting, len(rows), now, costs):
                return Plan(list(range(len(rows))), self.budget)
        urgent.sort(key=lambda i: (-self.gain(rows[i], now), rows[i].created))  # ties: the same readers stay served
        if costs is not None and urgent:
            urgent = urgent[: self.worth_running([self.gain(rows[i], now) for i in urgent], len(starving), costs, now)]
        run = starving + urgent
        rest = sorted((i for i in range(len(rows)) if i not in run), key=lambda i: (rows[i].orphaned, slack[i]))
        if len(run) < self.min_batch:  # spare places, the least ahead first, readers before orphans
            run += rest[: self.min_batch - len(run)]
        least = min((slack[i] for i in run if not rows[i].orphaned), default=float("inf"))  # before riders
        if self.conserving and costs is not None and run:  # and rows that cost next to nothing
            free = costs.free_rows(len(run), len(rows))
            if joining is None or self.joiners_can_wait(joining, waiting, len(rows), now, costs):
                # or that keep every reader in the step at KEEP_PACE x R; or all, at FULL_PACE x R
                free = max(free, costs.most_within(1 / (self.rate * KEEP_PACE), len(rows)))
                whole = costs.recent(len(rows), now)
                if whole is not None and whole <= 1 / (self.rate * FULL_PACE):
                    free = len(rows)
                readers = sum(not r.orphaned for r in rows)
                if joining is None and readers > self.speculate and costs.recent(readers, now) is None:
                    free = max(free, readers)  # a step of every reader, not measured lately: it is learned
            run += [i for i in rest if i not in run][: max(0, free - len(run))]
        if joining is None and costs is not None:  # a kernel's block of rows: the last few may wait a step
            run = self.cheapest(run, len(starving), costs, now)
        if joining is not None and self.slack(joining, 0, now) <= least:
            return Plan(run, MAX_PREFILL)  # the newcomers are the most behind: as many as a step takes
        # Otherwise prefill may take the time the running rows can spare beyond the horizon they
        # keep in hand, at the measured cost of a prompt token.
        spare = (least - self.horizon) / self.token_seconds if least != float("inf") else MAX_PREFILL
        return Plan(run, int(max(self.budget, min(MAX_PREFILL, spare))))


def schedule(name: str, budget: int = PREFILL_BUDGET, speculate: int = SPECULATE) -> Fifo | Qoe:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return Fifo(budget, speculate) if name == "fifo" else Qoe(budget, speculate=speculate)


def stretch(budget: int, waiting: int, most: float = STRETCH) -> int:
    """The prefill budget for a step when `waiting` prompt tokens wait to join: spread evenly over
    the fewest steps that take at most `most` x `budget` each (never less than the budget)."""
    if waiting <= budget or budget <= 0:
        return budget
    steps = math.ceil(waiting / (budget * most))
    return max(budget, math.ceil(waiting / steps))


def prefill_group(lengths: list[int], budget: int, longest: int | None = None) -> int:
    """How many joining prompts, in order, are prefilled together this step: as many whole
    prompts as fit the budget, at least one; none longer than `longest` (those go alone, in
    chunks)."""
    total, n = 0, 0
    for length in lengths:
        if n and (total + length > budget or longest is not None and length > longest):
            break
        total, n = total + length, n + 1
    return n
