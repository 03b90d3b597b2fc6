"""How busy the rest of the machine is: the CPU time that other processes took over a span, in
cores, from Linux's /proc (the busy time of the CPUs it may run on in /proc/stat, less this
process's own in /proc/self/stat, every thread of it).

Kernel timings taken beside other work are the contention's, and kept they would choose this
machine's kernels for good (kernels.py): run58's w8a8 tables, timed while the benchmark's other
servers loaded, kept `linear` for the gate and up product in prefills, where fbgemm's w8a8 took
72 ms against linear's 91 for 512 rows alone. The lock in kernels.py keeps two of this project's
processes from timing together; this sees everything else (a peer loading, a test suite, a
build). The benchmark reads processes' ticks with the same readers (scripts/bench_qoe.py).

Plain readers of /proc text and arithmetic on their numbers; the tests feed them text. Leaves out:
machines without /proc (macOS, Windows): there nothing is known (None), and nothing is re-timed.
"""

from __future__ import annotations

import os
import time

# Other processes' CPU, in cores on average over a timing, past which the timing is taken to be
# the contention's: a quarter of one core. A quiet machine here showed 0.00-0.02 (an idle server
# uses none); a server loading its model beside a timing, about one.
QUIET_CORES = 0.25
SAMPLE = 0.5  # seconds a load watches the machine before it times kept tables again


def stat_fields(text: str) -> list[str]:
    """The fields of a /proc/PID/stat text after the command's name (state, ppid, ...): the name is
    in parentheses and may hold spaces and parentheses itself. [] for text that is not one."""
    try:
        return text.rsplit(")", 1)[1].split()
    except IndexError:
        return []


def read_stat(path: str) -> list[str]:
    """stat_fields of a /proc stat file; [] once its process is gone."""
    try:
        with open(path) as f:
            return stat_fields(f.read())
    except OSError:
        return []


def stat_ticks(fields: list[str]) -> int:
    """utime + stime of a process's (or thread's) stat fields; 0 for none."""
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else 0


def machine_ticks(text: str, cpus: set[int] | None = None) -> int:
    """Ticks spent busy, from /proc/stat's text, on the CPUs `cpus` (all where None): all but idle
    and iowait of their lines. Steal counts as busy: on a virtual machine it is the host giving
    the CPU to another guest, contention as much as a process here is."""
    total, seen = 0, False
    for line in text.splitlines():
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or fields[0] == "cpu":
            continue
        if cpus is not None and int(fields[0][3:]) not in cpus:
            continue
        values = [int(v) for v in fields[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = values + [0] * (8 - len(values))
        total, seen = total + user + nice + system + irq + softirq + steal, True
    if not seen:
        raise ValueError("not /proc/stat")
    return total


def ticks() -> tuple[int, int] | None:
    """(busy ticks of the CPUs this process may run on, this process's own), or None without /proc.
    Only its own CPUs: in a container given two of a host's many, the others' work is not its."""
    try:
        cpus = os.sched_getaffinity(0)
        with open("/proc/stat") as f:
            machine = machine_ticks(f.read(), cpus)
    except (OSError, ValueError, AttributeError):  # (AttributeError: no sched_getaffinity, macOS)
        return None
    return machine, stat_ticks(read_stat("/proc/self/stat"))


def others(before: tuple[int, int], after: tuple[int, int], seconds: float, hz: float) -> float:
    """Cores that other processes kept busy on average between two `ticks()`, `seconds` apart."""
    theirs = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, theirs / hz / seconds) if seconds > 0 else 0.0


class Watch:
    """Other processes' CPU from its start on."""

    def __init__(self) -> None:
        self.start, self.t0 = ticks(), time.monotonic()

    def so_far(self) -> float | None:
        """In cores on average since it started (None without /proc)."""
        end = ticks()
        if self.start is None or end is None:
            return None
        return others(self.start, end, time.monotonic() - self.t0, os.sysconf("SC_CLK_TCK"))


def now(seconds: float = SAMPLE) -> float | None:
    """Other processes' CPU over the next `seconds`, in cores (None without /proc)."""
    watch = Watch()
    time.sleep(seconds)
    return watch.so_far()
