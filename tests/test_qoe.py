"""QoE (streaming/qoe.py) against timelines computed by hand: the areas below are triangles and
trapezoids of the reader's curve D(t) and the expected curve E(t) = R (t - 1), read at R = 4.6."""

import pytest

from streaming.qoe import qoe, summary

R = 4.6


def paced(n, start, rate=R):
    return [(start + i / rate, 1) for i in range(n)]


def expected_area(n):
    return 0.5 * (n / R) * n  # the triangle under E from 1 s to 1 + n/R


def test_delivery_that_keeps_up_or_runs_early_is_1():
    assert qoe(paced(100, 1.0)) == pytest.approx(1.0)
    assert qoe([(0.3, 100)]) == pytest.approx(1.0)  # all at once, early: it waits on screen
    assert qoe(paced(100, 0.5, rate=20)) == pytest.approx(1.0)  # faster than reading


def test_a_late_first_token():
    # D = R (t - 3) from 3 to T = 1 + 100/R: a triangle of base T - 3
    base = 1 + 100 / R - 3
    assert qoe(paced(100, 3.0)) == pytest.approx(0.5 * base * R * base / expected_area(100))


def test_a_stall_mid_answer():
    # 50 tokens paced from 1 s (D follows E to 50), a 5 s stall (D flat), the other 50 at once
    # (D grows at R again until T)
    t50 = 1 + 50 / R
    resume = t50 + 5
    end = 1 + 100 / R
    arrivals = paced(50, 1.0) + [(resume, 50)]
    area = 0.5 * (t50 - 1) * 50 + 50 * 5 + 0.5 * (50 + 50 + R * (end - resume)) * (end - resume)
    assert qoe(arrivals) == pytest.approx(area / expected_area(100))


def test_a_whole_answer_at_the_end_and_a_short_one():
    # /complete after 20 s: the reader starts at 20 and has 1 + 100/R - 20 s left
    left = 1 + 100 / R - 20
    assert qoe([(20.0, 100)]) == pytest.approx(0.5 * R * left * left / expected_area(100))
    # a 10-token answer at 2 s: its expected duration is short too
    assert qoe([(2.0, 10)]) == pytest.approx(((1 + 10 / R - 2) / (10 / R)) ** 2)
    assert qoe([]) == 0.0


def test_the_summary_mean_p10_and_share_at_095():
    s = summary([1.0] * 8 + [0.5, 0.2])
    assert s["qoe_mean"] == pytest.approx(0.87) and s["qoe_p10"] == 0.2 and s["qoe_share_95"] == 0.8
    assert summary([])["qoe_mean"] is None
