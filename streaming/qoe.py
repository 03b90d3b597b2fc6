"""A reader's quality of experience (QoE) of one streamed answer, after the Andes paper (Liu et
al., "Andes: Defining and Enhancing Quality-of-Experience in LLM-Based Text Streaming Services",
2024), computed exactly from the arrival times of the tokens.

The reader expects the first text `ttft` seconds after asking and then reads at `rate` tokens a
second: the expected curve E(t) is 0 until `ttft`, then grows at `rate` until the whole answer
(L tokens) is read at T = ttft + L / rate. What the reader has actually been able to read by time t,
D(t), grows at `rate` while delivered tokens wait unread, and waits (flat) when it has caught up
with delivery: text that arrives early waits on screen; a reader never reads faster than `rate`.
QoE = ∫ min(D, E) dt / ∫ E dt over [0, T]: 1.0 when delivery kept up with the reader all the way,
less when the reader waited. Both curves are piecewise linear, so the integral is exact.

Pure: times in, a number out. Leaves out: Andes' scheduling (the engine's business).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

EXPECTED_TTFT = 1.0  # seconds a reader expects to wait for the first text
READING_RATE = 4.6  # tokens a second: 238 words a minute through this tokenizer (scripts/reading_speed.py)
Curve = list[tuple[float, float]]  # (t, value) points of a piecewise linear function, t increasing


def qoe(arrivals: Sequence[tuple[float, float]], ttft: float = EXPECTED_TTFT, rate: float = READING_RATE) -> float:
    """QoE of one answer: `arrivals` are (seconds since the request, tokens that arrived then),
    in time order. 0.0 for an answer with no tokens."""
    total = sum(n for _, n in arrivals)
    if total <= 0:
        return 0.0
    end = ttft + total / rate
    expected = [(0.0, 0.0), (ttft, 0.0), (end, total)]
    area = 0.5 * (end - ttft) * total
    return min(1.0, integral_of_min(read_curve(arrivals, rate, end), expected, end) / area)


def read_curve(arrivals: Sequence[tuple[float, float]], rate: float, end: float) -> Curve:
    """D(t) up to `end`: the tokens the reader has been able to read by time t."""
    points: Curve = [(0.0, 0.0)]
    t, read, delivered = 0.0, 0.0, 0.0
    for when, n in [*arrivals, (end, 0.0)]:
        when = min(max(when, t), end)
        if read < delivered:  # reading what waits on screen, at `rate`, until caught up or `when`
            caught = t + (delivered - read) / rate
            if caught < when:
                points.append((caught, delivered))
                read = delivered
            else:
                read += (when - t) * rate
        points.append((when, read))
        t, delivered = when, delivered + n
        if t >= end:
            break
    return points


def at(curve: Curve, t: float, times: Sequence[float] | None = None) -> float:
    """The curve's value at t, from its first piece [t0, t1] holding t (`times`: the curve's
    times, to find that piece by bisection: integral_of_min asks thousands of times)."""
    ts = [p[0] for p in curve] if times is None else times
    j = bisect.bisect_left(ts, t)
    i = j - 1 if j > 0 else 0  # ts[j-1] < t <= ts[j]: no earlier piece holds t
    if i + 1 >= len(curve) or not ts[i] <= t <= ts[i + 1]:
        return curve[-1][1]
    (t0, v0), (t1, v1) = curve[i], curve[i + 1]
    return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def integral_of_min(a: Curve, b: Curve, end: float) -> float:
    """∫ min(a, b) dt over [0, end], exactly: both are linear between the merged breakpoints, and
    where they cross inside a piece, the piece is split there."""
    times = sorted({t for t, _ in a} | {t for t, _ in b} | {0.0, end})
    ta, tb = [t for t, _ in a], [t for t, _ in b]
    total = 0.0
    for t0, t1 in zip(times, times[1:], strict=False):
        if t1 > end:
            break
        a0, a1, b0, b1 = at(a, t0, ta), at(a, t1, ta), at(b, t0, tb), at(b, t1, tb)
        if (a0 - b0) * (a1 - b1) < 0:  # they cross inside: split at the crossing
            x = t0 + (t1 - t0) * (a0 - b0) / ((a0 - b0) - (a1 - b1))
            m = at(a, x, ta)
            total += 0.5 * (x - t0) * (min(a0, b0) + m) + 0.5 * (t1 - x) * (m + min(a1, b1))
        else:
            total += 0.5 * (t1 - t0) * (min(a0, b0) + min(a1, b1))
    return total


def summary(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, 10th percentile (nearest rank) and the share of readers at 0.95 or more."""
    if not values:
        return {"qoe_mean": None, "qoe_p10": None, "qoe_share_95": None}
    s = sorted(values)
    return {
        "qoe_mean": sum(s) / len(s),
        "qoe_p10": s[max(0, math.ceil(0.1 * len(s)) - 1)],  # nearest rank
        "qoe_share_95": sum(v >= 0.95 for v in s) / len(s),
    }
