"""The batched engine's waiting room: the requests that have no place in the batch yet, in order,
with what a reader and a load balancer are told of it.

- a request is admitted in order once its time has come (`--first-delay` in tests), those with a
  reader before readerless resumable streams;
- `position(job)`: how many wait ahead of it (the server's keep-alive comments say it);
- `refusal()`: past `max_waiting` a new request is refused, with an estimate of when a place
  frees (the mean time between the latest ends in the batch: the server's Retry-After);
- a stopped request leaves its place at the engine's once-per-step check;
- `landing()`: an idle engine waits a few milliseconds for the rest of a burst before its first
  step, so that the burst's prompts start together.

Plain bookkeeping: the engine holds its lock around every call. Leaves out: priorities beyond
"has a reader", and any estimate cleverer than the recent ends.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterator
from typing import Any, Protocol

MAX_WAITING = 512  # requests waiting for a place: past it a new one gets 503 and Retry-After (another replica)
# (a readerless resumable stream counts too: it holds a place in line as any request does)
DEPARTURES = 32  # the latest ends kept to estimate when a place frees
NO_ESTIMATE = 5.0  # seconds said before two ends were seen
RETRY_LONGEST = 60  # Retry-After is said between 1 s and this
# An idle engine's first step waits for a burst to land: until no request has come for
# LANDING_QUIET seconds, at most LANDING_MOST after the first (Triton's dynamic batcher's
# max_queue_delay). A burst of 48 reached the engine over 25 ms, up to 7 ms apart; the first step
# took the first two, and the other 46 waited for its 200 ms (a shared beginning learned from two
# prompts, then their pass). A lone request pays LANDING_QUIET once.
LANDING_QUIET = 0.010
LANDING_MOST = 0.050


class Waiter(Protocol):
    job: Any  # has .orphaned and .stop
    not_before: float
    created: float  # when it was submitted (the engine's clock)


class WaitingRoom:
    def __init__(self, max_waiting: int = MAX_WAITING) -> None:
        self.max_waiting = max_waiting
        self.rows: collections.deque[Any] = collections.deque()
        self.departures: collections.deque[float] = collections.deque(maxlen=DEPARTURES)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.rows)

    def append(self, row: Waiter) -> None:
        self.rows.append(row)

    def ready(self, now: float) -> bool:
        return any(r.not_before <= now for r in self.rows)

    def landing(self, now: float) -> float:
        """Seconds an idle engine waits before its first step for more of a burst (0: none)."""
        if not self.rows:
            return 0.0
        first, last = min(r.created for r in self.rows), max(r.created for r in self.rows)
        return max(0.0, min(last + LANDING_QUIET, first + LANDING_MOST) - now)

    def admit(self, now: float, fits: Callable[[Any], bool] | None = None) -> Any | None:
        """The next row whose time has come, in order, those with a reader first (None: none, or
        `fits` says the next one does not fit yet: it keeps its place, and those behind it wait)."""
        ready = [r for r in self.rows if r.not_before <= now]
        if not ready:
            return None
        row = next((r for r in ready if not r.job.orphaned), ready[0])
        if fits is not None and not fits(row):
            return None
        self.rows.remove(row)
        return row

    def stopped(self) -> list[Any]:
        """The rows whose job was stopped while waiting, taken out."""
        gone = [row for row in self.rows if row.job.stop.is_set()]
        for row in gone:
            self.rows.remove(row)
        return gone

    def position(self, job: Any) -> int | None:
        """How many wait ahead of this job (None: it is not waiting)."""
        return next((i for i, row in enumerate(self.rows) if row.job is job), None)

    def left(self, now: float, rows: int = 1) -> None:
        """Rows left the batch (ended, stopped): places freed."""
        self.departures.extend([now] * rows)

    def refusal(self, free: int = 0) -> tuple[int, int] | None:
        """None while a new request may wait (`free`: places in the batch not yet taken, which
        the rows waiting will take at the next step); else (requests waiting, seconds after
        which a place is likely to have freed). With max_waiting 0: refused once the batch is
        full."""
        if len(self.rows) - free < self.max_waiting:
            return None
        ends = list(self.departures)
        between = (ends[-1] - ends[0]) / (len(ends) - 1) if len(ends) > 1 else NO_ESTIMATE
        return len(self.rows), max(1, min(RETRY_LONGEST, math.ceil(between)))
