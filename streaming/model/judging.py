"""Whole passes of the model that judge the kernel tables kernels.py timed layer by layer.

A kernel's time on its own layers does not say what it costs among the others: on the Intel Xeon
with AMX, in bfloat16, the fused 896 x 9728 gate and up product at 32 rows took 4.4-4.8 ms with
`wxt` against 4.1 with `dnn` on its own (64 MB of its weights, a few % of a step), but in whole
32-token passes of the bundled model `dnn` there took the pass from 93.7 to 84.2 ms (medians of
7), and one table timed on its own was 13-15% slower than another at 17-32 rows and 7% at the
prefills' 512 (in turn, medians of 14). So:

- `tune()`: at each row count, for every shape of layer, each kernel whose own timing came within
  CLOSE of that shape's fastest runs in whole passes with the rest of the table as it is (one
  shape changed a pass), in turn with the table itself; a shape takes the fastest of those whose
  passes took at most MARGIN of the table's (COPY_MARGIN for a copy of the weight its table did
  not keep). The shapes' changes at a row count are then run together against the table before
  them, and kept only if they won together.
- `check()`: the tables then run against `linear` everywhere, and a quantized model's against
  its dense kernels too; where they lost (and lost again), the caller sets that row count back
  to the winner.

Leaves out: timing a layer on its own, and keeping the tables (kernels.py); searching every
combination (a pass per kernel per shape per row count is all the time a load can spend: the
bundled model's judging takes ~30 s once per machine, then the kept tables are read).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

CLOSE = 1.3  # tune(): a kernel within this of its shape's fastest on its own is tried in the model
TUNE_ROUNDS = 4  # tune(): passes of each kind at each row count, judged by their median
MARGIN = 0.97  # tune(): a pass must take at most this share of the table's (the noise of a whole pass)
# and where the kernel keeps a copy of the weight that its shape's table does not keep yet (memory:
# up to the weight's size again), this share: twice the noise margin, for one shape's part of a pass
COPY_MARGIN = 0.94
CHECK_ROUNDS = 3  # check(): whole-model passes of each kind at each row count, judged by their median
CONFIRM_ROUNDS = 5  # check(): a loss seen there, seen again in this many more rounds (noise decides nothing)
log = logging.getLogger("streaming.model")
K = TypeVar("K")


class Chosen(Protocol):
    """What the passes need of a layer (kernels.ChosenLinear): its table and a kernel to force."""

    table: list[str]
    prefill: str
    fixed: str | None

    def pick(self, rows: int) -> str: ...


def tune(
    groups: Mapping[str, Sequence[Chosen]],
    timed: Mapping[str, list[dict[str, float]]],
    tables: Mapping[str, list[str]],
    step: Callable[[int], Any],
    counts: Sequence[int],
    margins: Callable[[str, str, list[str]], float],
    give: Callable[[dict[str, list[str]]], None],
) -> dict[str, list[str]]:
    """The tables after whole passes judged the kernels close to each shape's fastest (the
    docstring above). `timed[name][i]`: that shape's kernels' own medians at counts[i];
    `margins(name, kernel, table)`: the share of the table's pass a kernel's pass must take to
    replace its choice; `give(tables)`: the layers run these tables from now on (and keep only the
    copies of the weights they name: a row count's tries leave none behind). The changes a row
    count takes together are confirmed in passes against the table before them, or left out."""
    tables = {name: list(table) for name, table in tables.items()}
    said = []
    for i, n in enumerate(counts):
        tried = [
            (name, k)
            for name, times in timed.items()
            for k, t in times[i].items()
            if k != tables[name][i] and t <= CLOSE * min(times[i].values())
        ]
        if not tried:
            continue
        runs: dict[tuple[str, str] | None, Callable[[], Any]] = {None: functools.partial(step, n)}
        runs |= {(name, k): functools.partial(forced_pass, [(groups[name], k)], step, n) for name, k in tried}
        median = medians(runs, TUNE_ROUNDS)
        won = {}
        for name in dict.fromkeys(name for name, _ in tried):
            passing = [
                k
                for shape, k in tried
                if shape == name and median[(name, k)] <= margins(name, k, tables[name]) * median[None]
            ]
            if passing:
                won[name] = min(passing, key=lambda k: median[(name, k)])
        if won:  # together, against the table as it was (each was judged with the others unchanged)
            both = {
                "before": functools.partial(step, n),
                "after": functools.partial(forced_pass, [(groups[name], k) for name, k in won.items()], step, n),
            }
            confirm = medians(both, TUNE_ROUNDS)
            if confirm["after"] <= MARGIN * confirm["before"]:
                for name, k in won.items():
                    said.append(f"{n}: {name} {tables[name][i]} -> {k}")
                    tables[name][i] = k
                said.append(f"{n}: {1000 * confirm['before']:.1f} -> {1000 * confirm['after']:.1f} ms")
        give(tables)
    log.info("kernels judged in the model: %s", "; ".join(said) or "no change")
    return tables


def forced_pass(forced: Sequence[tuple[Sequence[Chosen], str]], step: Callable[[int], Any], n: int) -> None:
    """`step(n)` with each group of layers running its kernel and every other layer its table (then
    its table again)."""
    try:
        for layers, kernel in forced:
            for layer in layers:
                layer.fixed = kernel
        step(n)
    finally:
        for layers, _ in forced:
            for layer in layers:
                layer.fixed = None


def check(
    layers: Sequence[Chosen],
    step: Callable[[int], Any],
    counts: Sequence[int],
    rival: Callable[[int], Sequence[tuple[Sequence[Chosen], str]]] | None = None,
    after: Callable[[], None] | None = None,
) -> dict[int, str]:
    """Whole passes of the model over n tokens at each row count (n rows through every layer, as
    the batched engine's flat steps run them), with the kernels chosen against `linear`
    everywhere, and where `rival(i)` names layers to force (a quantized model: each quantized
    kernel the tables chose at counts[i] replaced by its shape's fastest dense one by their own
    timings at load), against that too, in turn, CHECK_ROUNDS after one to warm up. Returns
    {index: "linear" or "dense"} for the row counts where the tables lost to that one, the loss
    seen again in CONFIRM_ROUNDS more (three rounds on this shared machine decide little alone:
    the bundled model's bfloat16 tables took 1694.4 ms a 512-token pass in them against 1690.8
    with `linear`, then 1436.9 against 1591.2 in the next five). A kernel timed on its own can lose
    inside the model, among the others: on the AMX Xeon, for the bundled model in bfloat16, whole 128-token passes
    took 167 ms with the `wxt` every shape's own timing had chosen against 153 with `linear`
    everywhere, while from 1 to 64 rows the tables won (55 against 72 ms at 1, 102 against 108 at
    64). The dense rival is what makes a quantized model never slower than its dense kernels at a
    row count (as far as passes at load can tell)."""
    lost: dict[int, str] = {}
    said: list[str] = []
    for i, n in enumerate(counts):
        forced = list(rival(i)) if rival is not None else []
        plain = all(layer.pick(n) == "linear" for layer in layers)
        if plain and not forced:
            continue
        runs: dict[str | None, Callable[[], Any]] = {None: functools.partial(step, n)}
        if not plain:
            runs["linear"] = functools.partial(forced_pass, [(layers, "linear")], step, n)
        if forced:
            runs["dense"] = functools.partial(forced_pass, forced, step, n)
        median = medians(runs, CHECK_ROUNDS)
        best = min(runs, key=median.__getitem__)
        said.append(", ".join(f"{k or 'chosen'} {1000 * t:.1f}" for k, t in median.items()) + f" ms at {n}")
        if best is not None:
            again = medians({None: runs[None], best: runs[best]}, CONFIRM_ROUNDS)
            said[-1] += f" (again: {1000 * again[None]:.1f} against {1000 * again[best]:.1f})"
            if again[best] < again[None]:
                lost[i] = best
        if after is not None:  # (the caller's: e.g. drop the weight copies this row count's passes made)
            after()
    log.info("kernels in the model, the tables chosen against their rivals: %s", "; ".join(said))
    return lost


def medians(runs: Mapping[K, Callable[[], Any]], rounds: int) -> dict[K, float]:
    """Each run's median seconds over `rounds` rounds after one to warm up, the runs in turn in
    every round (so a slow moment of the machine falls on all of them): the kernels' own timings,
    tune(), check() and bench.py's profile time their candidates so."""
    times: dict[K, list[float]] = {k: [] for k in runs}
    for r in range(rounds + 1):
        for k, run in runs.items():
            t0 = time.perf_counter()
            run()
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) for k, t in times.items()}
