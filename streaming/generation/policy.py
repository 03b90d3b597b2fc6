"""Which rows run at the next step, and how many prompt tokens join: the engine's scheduling
policy, as plain objects over what each row has delivered and a clock (the tests drive them with
a fake one; the engine passes time.monotonic()).

`fifo` is every peer's: every active row runs every step, and joining prompts take a fixed
`--prefill-budget` of tokens a step.

`qoe` schedules for what a reader feels (the Andes paper's measure, streaming/qoe.py): a reader
expects the first text within TTFT (1 s) and then reads R tokens a second (4.6). A row's *slack*
is the time left before its reader, reading at R from TTFT on, runs out of delivered text:

    slack = created + TTFT + delivered / R - now       (a prompt not yet answered: delivered 0)

A row with little slack runs (its reader is about to wait, or waits already: the most behind
first); a row far ahead can sit steps out, which makes the step cheaper for the others and leaves
time to prefill newcomers, whose first text is what a burst waits for. The prompts that wait to
join take the whole MAX_PREFILL when the first of them is as far behind as any running row (in a
burst, first text for everyone before more text for some); otherwise the budget plus what the
running rows' slack can spare. It is work-conserving: a row sits a step out only when its place
serves someone who needs it (a reader about to wait, or a prompt waiting to join), and even then
rows ride along where the engine's measured step costs (`StepCosts`) say they cost at most 10%
more; with nobody in need every row runs, orphans too, since an idle machine holding a stream back helps nobody (a
burst of 16 got 70 tokens/s and mean QoE 0.90 under qoe against fifo's 85 and 0.93 when rows far
ahead sat out of steps that had room). Promises kept:
- no starvation: slack falls as time passes, so a skipped row becomes urgent; and no row waits
  more than MAX_SKIP seconds between tokens whatever its slack;
- a resumable stream with no reader (orphaned) runs only in the spare places of a step.

Leaves out: preemption (a row keeps its KV memory while it sits out) and the Andes knapsack over
expected QoE gains (the most-behind-first order here is the simple greedy form).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

READING_RATE = 4.6  # tokens/s a person reads (238 words a minute through this tokenizer: reading_speed.py)
EXPECTED_TTFT = 1.0  # seconds a reader expects to wait for the first text (the Andes paper's default)
HORIZON = 1.0  # seconds of slack under which a row runs: a few steps' worth, so it never runs dry
MIN_BATCH = 4  # rows that run anyway when fewer are urgent: a step of 4 costs about what a step of 1 does
MAX_SKIP = 2.0  # seconds: no row goes longer between tokens, whatever its slack (no starvation)
PREFILL_BUDGET = 256  # prompt tokens prefilled per step (fifo, and qoe's floor): ~0.35 s here, a gap readers absorb
MAX_PREFILL = 2048  # qoe: the most prompt tokens one step takes (~3 s here), however much slack there is
PREFILL_TOKEN_SECONDS = 1.4e-3  # prefill cost a token, measured here: 8 prompts of 45 tokens in 0.50 s (bf16, 0.5B)
SCHEDULES = ("fifo", "qoe")
BANDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # row counts whose step costs are kept (the kernels' own row counts)
WHOLE_BAND = 4  # up to this band, its rest rides along unmeasured (4 rows cost what 3 do); past it, measured
FREE_SHARE = 0.1  # qoe: rows ride along in a step while it costs at most 10% more than the step without them
COST_WEIGHT = 0.2  # the weight of the latest step in a band's moving average (the machine drifts)


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


class StepCosts:
    """What a decode step of n rows has cost lately, by band (n rounded up to the next of BANDS):
    a moving average of the engine's own measurements, so the policy knows when more rows cost
    next to nothing (here a step of 4 rows costs what a step of 1 does, of 16 what one of 8
    does, with the kernels chosen per row count)."""

    def __init__(self, weight: float = COST_WEIGHT) -> None:
        self.weight = weight
        self.seconds: dict[int, float] = {}

    @staticmethod
    def band(n: int) -> int:
        return next((b for b in BANDS if b >= n), n)

    def record(self, n: int, seconds: float) -> None:
        b = self.band(n)
        old = self.seconds.get(b)
        self.seconds[b] = seconds if old is None else old + self.weight * (seconds - old)

    def of(self, n: int) -> float | None:
        return self.seconds.get(self.band(n))

    def free_rows(self, n: int, most: int) -> int:
        """How many rows a step of n could run instead (at most `most`) for at most FREE_SHARE
        more time, from what has been measured (n when nothing is known of n's band): the rest
        of its band if that is at most WHOLE_BAND, or the largest band above that costs at most
        FREE_SHARE more (a larger step can cost less: another kernel runs it)."""
        base = self.of(n)
        if base is None:
            return n
        best = self.band(n) if self.band(n) <= WHOLE_BAND else n  # a small band costs the same throughout
        for b in BANDS:
            cost = self.of(b)
            if best < b <= self.band(most) and cost is not None and cost <= base * (1 + FREE_SHARE):
                best = b
        return min(best, most)


@dataclass(frozen=True)
class Plan:
    run: list[int]  # indices of the active rows that decode this step
    prefill: int  # prompt tokens that may join this step


class Fifo:
    name = "fifo"

    def __init__(self, budget: int = PREFILL_BUDGET) -> None:
        self.budget = budget

    def plan(
        self,
        rows: Sequence[Reading],
        now: float,  # noqa: ARG002 - as Qoe.plan
        joining: float | None = None,  # noqa: ARG002
        costs: StepCosts | None = None,  # noqa: ARG002
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
    ) -> None:
        self.budget, self.rate, self.ttft, self.horizon = budget, rate, ttft, horizon
        self.min_batch, self.token_seconds, self.conserving = min_batch, token_seconds, conserving

    def slack(self, created: float, delivered: int, now: float) -> float:
        """Seconds before a reader who reads at R from TTFT on runs out of text (negative: waiting)."""
        return created + self.ttft + delivered / self.rate - now

    def plan(
        self, rows: Sequence[Reading], now: float, joining: float | None = None, costs: StepCosts | None = None
    ) -> Plan:
        """`joining`: when the first prompt waiting to join arrived (None: none waits); `costs`:
        the engine's step costs, to let rows ride along where they cost next to nothing."""
        slack = [self.slack(r.created, r.delivered, now) for r in rows]
        urgent = [
            i for i, r in enumerate(rows) if now - r.last_at >= MAX_SKIP or (not r.orphaned and slack[i] < self.horizon)
        ]
        if self.conserving and not urgent and joining is None:  # nobody needs a place: everyone runs
            return Plan(list(range(len(rows))), self.budget)
        run = sorted(urgent, key=lambda i: slack[i])
        rest = sorted((i for i in range(len(rows)) if i not in urgent), key=lambda i: (rows[i].orphaned, slack[i]))
        if len(run) < self.min_batch:  # spare places, the least ahead first, readers before orphans
            run += rest[: self.min_batch - len(run)]
        least = min((slack[i] for i in run if not rows[i].orphaned), default=float("inf"))  # before riders
        if self.conserving and costs is not None and run:  # and rows that cost next to nothing
            places = costs.free_rows(len(run), len(rows))
            run += [i for i in rest if i not in run][: max(0, places - len(run))]
        if joining is not None and self.slack(joining, 0, now) <= least:
            return Plan(run, MAX_PREFILL)  # the newcomers are the most behind: admit them in one go
        # Otherwise prefill may take the time the running rows can spare beyond the horizon they
        # keep in hand, at the measured cost of a prompt token.
        spare = (least - self.horizon) / self.token_seconds if least != float("inf") else MAX_PREFILL
        return Plan(run, int(max(self.budget, min(MAX_PREFILL, spare))))


def schedule(name: str, budget: int = PREFILL_BUDGET) -> Fifo | Qoe:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    return Fifo(budget) if name == "fifo" else Qoe(budget)


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
