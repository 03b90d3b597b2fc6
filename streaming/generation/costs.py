"""What the engine's decode steps cost lately, by how many rows ran: the measurements the qoe
policy plans with (policy.py), from the engine's own steps (batch.py records each decode step's
forward pass). Pure: seconds in, answers out.

Leaves out: steps with prompts joining (their cost is the prompts', not the rows').
"""

from __future__ import annotations

BANDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # row counts whose step costs are kept (the kernels' own row counts)
WHOLE_BAND = 4  # up to this band, its rest rides along unmeasured (4 rows cost what 3 do); past it, measured
FREE_SHARE = 0.1  # qoe: rows ride along in a step while it costs at most 10% more than the step without them
COST_WEIGHT = 0.2  # the weight of the latest step in a band's moving average (the machine drifts)
# qoe: a band last measured longer ago than this does not make the policy run fewer rows. A step's
# cost depends on its rows' contexts as well as their count, so a band measured a minute ago, in
# other traffic, is not comparable with today's: after Poisson load, a burst of 48 (every reader of
# equal gain) ran a third of its rows, by a 64-row cost measured at longer contexts against a fresh
# 16-row one, and lost to fifo (mean QoE 0.619 against 0.744 at 16, 0.076 against 0.159 at 48).
FRESH_SECONDS = 10.0
# Costs are also kept for each row count up to here: a kernel that works in blocks of rows makes a
# step's cost jump inside a band. fbgemm's fp16 product on the AVX2 kind reads every weight again
# for each 6 rows (the bundled model's pass, fp16: 76 ms for 6 rows, 113 for 7, 130 for 12, 153
# for 13), which the band of 8 (5 to 8 rows) averages away.
EXACT_MOST = 64


class StepCosts:
    """What a decode step of n rows has cost lately, by band (n rounded up to the next of BANDS):
    a moving average of the engine's own measurements, so the policy knows when more rows cost
    next to nothing (here a step of 4 rows costs what a step of 1 does, of 16 what one of 8
    does, with the kernels chosen per row count)."""

    def __init__(self, weight: float = COST_WEIGHT) -> None:
        self.weight = weight
        self.seconds: dict[int, float] = {}
        self.at: dict[int, float | None] = {}  # when each band was last measured (None: not said)
        self.exact: dict[int, tuple[float, float | None]] = {}  # row count -> (seconds, when), to EXACT_MOST

    @staticmethod
    def band(n: int) -> int:
        return next((b for b in BANDS if b >= n), n)

    def record(self, n: int, seconds: float, now: float | None = None) -> None:
        """One more decode step of n rows; a band or count last measured longer than FRESH_SECONDS
        ago starts again from it (its old average was other traffic's, or warm-up's first-touch
        steps, and would outweigh today's for several steps)."""
        b = self.band(n)
        old = None if self.stale(self.at.get(b), now) else self.seconds.get(b)
        self.seconds[b] = self.moved(old, seconds)
        self.at[b] = now
        if n <= EXACT_MOST:
            seconds_, at = self.exact.get(n, (None, None))
            self.exact[n] = (self.moved(None if self.stale(at, now) else seconds_, seconds), now)

    def moved(self, old: float | None, seconds: float) -> float:
        """A moving average after one more measurement."""
        return seconds if old is None else old + self.weight * (seconds - old)

    @staticmethod
    def stale(at: float | None, now: float | None) -> bool:
        """Measured longer than FRESH_SECONDS before `now` (never, when either time is not known)."""
        return at is not None and now is not None and now - at > FRESH_SECONDS

    def of(self, n: int) -> float | None:
        return self.seconds.get(self.band(n))

    def recent(self, n: int, now: float | None) -> float | None:
        """of(n) if its band was measured within FRESH_SECONDS of `now` (or either time is not
        known), else None."""
        return None if self.stale(self.at.get(self.band(n)), now) else self.of(n)

    def exactly(self, n: int, now: float | None) -> float | None:
        """What a step of exactly n rows has cost lately, if measured within FRESH_SECONDS of
        `now` (or either time is not known), else None."""
        seconds, at = self.exact.get(n, (None, None))
        return None if seconds is None or self.stale(at, now) else seconds

    def most_within(self, seconds: float, most: int) -> int:
        """The most rows (at most `most`) whose step was measured to cost at most `seconds`: by
        the count's own cost where measured, else its band's (0 when none is known)."""
        for m in range(most, 0, -1):
            cost = self.exact[m][0] if m in self.exact else self.of(m)
            if cost is not None and cost <= seconds:
                return m
        return 0

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
