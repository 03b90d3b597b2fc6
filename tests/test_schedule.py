"""Scheduling for readers (streaming/generation/policy.py), burst admission, the KV cache's slots
(kv.py) and the fused pass over them (attention.py), and the quantized kernels (quant.py).

The policies are driven with hand-made rows and a fake clock; the engine is stepped by hand
(no thread) with the `exact` model, whose logits depend only on a row's own tokens, so a row that
sits steps out or joins in a padded burst must still give exactly the thread engine's text, in
float32 and bfloat16 alike. The arithmetic of prompts joining in one pass and the quantized
kernels is checked with the tiny real model, within stated tolerances."""

import asyncio
import itertools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from helpers import ROOT, TOLERANCE, ServerProcess, http, job_text, metrics, model_of, stream_texts

import lm
from streaming.generation import attention, blocks, kv
from streaming.generation.batch import Row
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.policy import (
    FULL_PACE,
    MAX_PREFILL,
    MAX_SKIP,
    READING_RATE,
    Fifo,
    Qoe,
    StepCosts,
    prefill_group,
    stretch,
)
from streaming.generation.prefixes import PREFIX_MIN, Prefixes
from streaming.generation.thread import ThreadJob
from streaming.model import quant
from streaming.model.loading import forward_kwargs, step_kwargs
from streaming.model.testing import ExactModel, tiny_model
from streaming.qoe import qoe
from streaming.wire.params import plain_request

DTYPES = [torch.float32, torch.bfloat16]
PROMPTS = ["Hello there", "The lighthouse keeper wrote in his log every night", "a", "Once upon a time", "x y z"]


@dataclass
class Fake:
    created: float = 0.0
    delivered: int = 0
    last_at: float = 0.0
    orphaned: bool = False
    planned: int = 100


# --- the policies, on hand-made rows ----------------------------------------------------------


def test_fifo_runs_every_row_and_takes_its_fixed_budget():
    plan = Fifo(300).plan([Fake(), Fake(delivered=500)], now=10.0)
    assert plan.run == [0, 1] and plan.prefill == 300


def test_qoe_skips_a_row_far_ahead_and_runs_the_one_about_to_wait_first():
    # At t=20 the expected reader of a row created at 0 has read 4.6 * 19 = 87.4 tokens.
    rows = [Fake(delivered=200, last_at=19.9), Fake(delivered=88, last_at=19.9), Fake(delivered=80, last_at=19.9)]
    q = Qoe(min_batch=1)
    assert q.slack(0.0, 88, 20.0) == pytest.approx(88 / 4.6 - 19)
    assert sorted(q.plan(rows, now=20.0).run) == [1, 2]  # the two about to wait; 200 tokens ahead sits out


def test_qoe_runs_a_row_skipped_for_max_skip_whatever_its_slack():
    rows = [Fake(delivered=400, last_at=20.0 - MAX_SKIP), Fake(delivered=400, last_at=19.9)]
    assert Qoe(min_batch=1).plan(rows, now=20.0).run == [0]


def test_qoe_a_readerless_stream_runs_only_in_spare_places():
    behind = dict(delivered=10, last_at=19.9)
    orphan = Fake(orphaned=True, **behind)
    assert Qoe(min_batch=1).plan([orphan, Fake(**behind)], now=20.0).run == [1]
    assert Qoe(min_batch=2).plan([orphan, Fake(**behind)], now=20.0).run == [1, 0]  # a spare place: it runs


def test_qoe_fills_a_small_batch_since_a_step_of_four_costs_a_step_of_one():
    rows = [Fake(delivered=d, last_at=19.9) for d in (300, 200, 85, 250)]
    assert Qoe(min_batch=3).plan(rows, now=20.0).run == [2, 1, 3]  # the urgent one, then the least ahead


def test_qoe_admits_newcomers_at_once_when_they_are_the_most_behind():
    q = Qoe(budget=100, min_batch=1)
    ahead = [Fake(delivered=200, last_at=19.9)]
    assert q.plan(ahead, now=20.0, joining=18.0).prefill == MAX_PREFILL  # waited 2 s: behind everyone
    assert q.plan([], now=20.0, joining=19.9).prefill == MAX_PREFILL  # nobody running
    # A reader 0.5 s from running dry and a newcomer just arrived: the budget's floor only.
    close = [Fake(delivered=round(4.6 * 19.5), last_at=19.9)]
    assert q.plan(close, now=20.0, joining=19.99).prefill == 100
    # Readers with seconds of text on screen lend the newcomers their slack.
    plan = q.plan([Fake(delivered=round(4.6 * 25), last_at=19.9)], now=20.0, joining=19.99)
    assert 100 < plan.prefill <= MAX_PREFILL


def test_step_costs_say_how_many_rows_ride_along_for_next_to_nothing():
    costs = StepCosts(weight=1.0)  # the latest measurement only
    for n, seconds in ((1, 0.100), (2, 0.150), (4, 0.105), (8, 0.250), (16, 0.260)):
        costs.record(n, seconds)
    assert StepCosts().free_rows(3, 64) == 3  # nothing measured: nobody rides along
    assert costs.free_rows(1, 64) == 4  # a step of 2 costs 50% more than one of 1, but one of 4 only 5%
    assert costs.free_rows(3, 64) == 4  # the rest of its band (4 rows cost what 3 do)
    assert costs.free_rows(5, 64) == 16  # 16 rows cost 4% more than 8
    assert costs.free_rows(5, 12) == 12  # never more rows than there are
    costs.record(16, 0.5)
    assert costs.free_rows(5, 64) == 8  # the machine changed: 16 is dear now


def test_qoe_lets_rows_far_ahead_ride_along_where_the_step_costs_next_to_nothing():
    costs = StepCosts(weight=1.0)
    for n, seconds in ((1, 0.100), (2, 0.150), (4, 0.105), (8, 0.250)):
        costs.record(n, seconds)
    rows = [Fake(delivered=d, last_at=19.9) for d in (300, 85, 250, 200, 280)]
    q = Qoe(min_batch=1)
    assert q.plan(rows, now=20.0).run == [1]  # without costs: the urgent one alone
    assert q.plan(rows, now=20.0, costs=costs).run == [1, 3, 2, 4]  # a step of 4 costs one of 1, of 5 much more
    assert Qoe(min_batch=1, conserving=False).plan(rows, now=20.0, costs=costs).run == [1]


def test_qoe_lets_every_row_ride_where_a_step_of_all_of_them_was_not_measured_lately():
    """A burst of 8 after a lone reader (only a step of 1 measured): its first decode step, the
    four asked first about to wait, the four asked later a little ahead. A step of 8 rows has not
    been measured, so nothing says the four ahead cost the others anything: all 8 run, and the
    step is measured (before, the four ahead sat out, on a step of 8 costing about what one of 4
    does). Measured dear lately, the rows ahead sit out again; a prompt waiting to join: they sit
    out too, as its first text needs the step (joiners_can_wait); readerless rows (orphans) stay
    in the spare places."""

    def burst(now):  # slack 0.87 s for the first four, 1.12 s for the others
        return [Fake(created=now - t, delivered=1, last_at=now - 0.01) for t in (0.35,) * 4 + (0.1,) * 4]

    lone = StepCosts()
    lone.record(1, 0.061, 9.0)
    assert Qoe().plan(burst(10.0), 10.0, costs=lone).run == list(range(8))
    assert len(Qoe().plan(burst(10.0), 10.0, joining=9.99, costs=lone, waiting=60).run) == 4
    lone.record(8, 0.3, -5.0)  # long ago: the joiners' first text comes in time with all 8 (0.38 s)
    assert Qoe().joiners_can_wait(9.99, 60, 8, 10.0, lone)
    assert len(Qoe().plan(burst(10.0), 10.0, joining=9.99, costs=lone, waiting=60).run) == 4  # not learned then
    orphans = burst(10.0)
    for row in orphans[6:]:
        row.orphaned = True
    assert sorted(Qoe().plan(orphans, 10.0, costs=lone).run) == list(range(6))  # every reader, not the orphans
    lone.record(8, 0.4, 10.0)  # the step of 8, measured: far past FULL_PACE (0.18 s)
    assert Qoe().plan(burst(10.0), 10.0, costs=lone).run == [0, 1, 2, 3]
    assert Qoe().plan(burst(21.0), 21.0, costs=lone).run == list(range(8))  # ten seconds on: measured again


def test_prefill_group_takes_whole_prompts_in_order_within_the_budget():
    assert prefill_group([50, 50, 50], 120) == 2
    assert prefill_group([500, 10], 120) == 1  # at least one
    assert prefill_group([10] * 48, 2048) == 48
    assert prefill_group([10, 10, 500, 10], 2048, longest=128) == 2  # a long prompt goes alone, later


def test_the_prefill_budget_stretches_only_to_spare_the_waiting_prompts_a_step():
    assert stretch(512, 300) == 512  # everything fits: the budget as it is
    assert stretch(512, 556) == 556  # 512 then 44 alone: one step of 556 instead
    assert stretch(512, 2092) == 523  # 4 steps of 523, not 5 with 44 tokens in the last
    assert stretch(512, 900) == 512  # 2 steps either way: none stretched
    assert stretch(512, 10_000) == 625  # 16 steps of at most 1.25x, not 20
    assert stretch(0, 500) == 0  # no prefill this step stays none
    for waiting in range(1, 5000, 7):  # never more steps than the budget alone would take
        b = stretch(256, waiting)
        assert 256 <= b <= 320 and -(-waiting // b) <= -(-waiting // 256)


def test_qoe_runs_every_row_when_nobody_needs_a_place():
    """Work-conserving: rows far ahead of their readers, nobody joining: every row runs (an idle
    machine holding a stream back helps nobody); a prompt waiting to join, or a reader about to
    wait, is what makes a row sit out."""
    ahead = [
        Fake(delivered=200, last_at=19.9),
        Fake(delivered=300, last_at=19.9),
        Fake(delivered=250, last_at=19.9, orphaned=True),
    ]
    assert Qoe(min_batch=1).plan(ahead, now=20.0).run == [0, 1, 2]
    assert Qoe(min_batch=1).plan(ahead, now=20.0, joining=19.99).run == [0]  # a newcomer: they make room
    behind = [*ahead, Fake(delivered=80, last_at=19.9)]
    assert Qoe(min_batch=1).plan(behind, now=20.0).run == [3]  # a reader about to wait runs alone
    assert Qoe(min_batch=1, conserving=False).plan(ahead, now=20.0).run == [0]


def test_qoe_lets_every_row_ride_with_a_prompt_whose_first_text_comes_soon_all_the_same():
    """A lone arrival's short prompt, with every row far ahead: its prefill with all of them
    riding leaves it more than JOIN_MARGIN of its first second, so nobody sits out; a burst's
    prompts, a prompt that waited, or costs not yet measured: the rows make room as before."""
    ahead = [Fake(delivered=200 + i, last_at=19.9) for i in range(20)]
    costs = StepCosts()
    costs.record(20, 0.09)
    q = Qoe(min_batch=4)
    assert q.plan(ahead, now=20.0, joining=19.99, costs=costs, waiting=50).run == list(range(20))
    assert len(q.plan(ahead, now=20.0, joining=19.99, costs=costs, waiting=2000).run) == 4  # a burst
    assert len(q.plan(ahead, now=20.0, joining=19.6, costs=costs, waiting=50).run) == 4  # waited 0.4 s
    assert len(q.plan(ahead, now=20.0, joining=19.99, costs=StepCosts(), waiting=50).run) == 4  # not measured
    assert len(q.plan(ahead, now=20.0, joining=19.99, costs=costs).run) == 4  # tokens not said
    behind = [*ahead, Fake(delivered=80, last_at=19.9)]  # a reader about to wait
    # a step of all 21 keeps every reader at FULL_PACE x R (90 ms: 11 tokens a second): all ride
    assert sorted(q.plan(behind, now=20.0, joining=19.99, costs=costs, waiting=50).run) == list(range(21))
    slow = StepCosts()
    slow.record(21, 1 / (READING_RATE * FULL_PACE) + 0.01)  # all of them: slower than that, places are needed
    assert len(q.plan(behind, now=20.0, joining=19.99, costs=slow, waiting=50).run) < 21


def test_qoe_runs_the_urgent_rows_worth_the_step_newest_and_shortest_first():
    costs = StepCosts(weight=1.0)
    for n, seconds in ((1, 0.10), (2, 0.12), (4, 0.15), (8, 0.30)):
        costs.record(n, seconds)
    # Six readers waiting at t=30: three whose reading windows (1 s + 100 / 4.6 s) are nearly spent,
    # three newer. A token is worth most to the newest and the shortest answers: a step of 4 rows
    # (the three new, then the best of the old) gives more per second than one of all 6 (8's cost).
    rows = [Fake(created=c, delivered=d, last_at=29.9, planned=p) for c, d, p in ((8, 80, 100), (25, 10, 300),
            (7, 80, 100), (28, 4, 100), (9, 90, 100), (29, 2, 300))]  # fmt: skip
    assert Qoe(min_batch=1).plan(rows, now=30.0, costs=costs).run == [3, 5, 1, 4]
    assert sorted(Qoe(min_batch=1).plan(rows, now=30.0).run) == list(range(6))  # nothing measured: all run
    # Equal gains (a burst): the step that gives the most tokens a second, here 4 rows (26.7/s) ...
    equal = [Fake(created=10.0, delivered=10, last_at=29.9) for _ in range(6)]
    assert Qoe(min_batch=1).plan(equal, now=30.0, costs=costs).run == [0, 1, 2, 3]
    costs.record(8, 0.2)  # ... or, where a step of 8 costs 0.2 s, all six (30/s)
    assert sorted(Qoe(min_batch=1).plan(equal, now=30.0, costs=costs).run) == list(range(6))


def test_qoe_keeps_every_urgent_row_of_a_burst_whatever_costs_were_measured_long_ago():
    """A burst after other traffic: every reader of equal gain. Costs measured a minute ago (at
    other contexts: a 64-row step dear, a 16-row one cheap) do not make the step run 16 of 48
    rows, as they did before (a burst of 48 then lost to fifo); measured just now, a smaller step
    runs only where it gives SMALLER_STEP more rows a second."""
    burst = [Fake(created=0.0, delivered=5, last_at=9.9) for _ in range(48)]
    stale = StepCosts(weight=1.0)
    for n, seconds in ((16, 0.283), (64, 0.909)):
        stale.record(n, seconds, now=-50.0)
    assert len(Qoe().plan(burst, now=10.0, costs=stale).run) == 48
    fresh = StepCosts(weight=1.0)
    for n, seconds in ((16, 0.283), (64, 0.909)):
        fresh.record(n, seconds, now=9.0)
    assert len(Qoe().plan(burst, now=10.0, costs=fresh).run) == 48  # 56.5 rows/s against 52.8: short of 10%
    fresh.record(16, 0.2, now=9.5)  # 80 rows a second against 52.8: a smaller step is worth it
    assert len(Qoe().plan(burst, now=10.0, costs=fresh).run) == 16
    assert Qoe.worth_running([1.0] * 48, 0, fresh, now=70.0) == 48  # a minute on, nothing is fresh
    # the whole step's cost old (warm-up's 64 rows), a smaller one's fresh (a burst of 32 just
    # before): all of them run, and their step is learned again
    warmed = StepCosts(weight=0.2)
    warmed.record(64, 0.909, now=-50.0)
    warmed.record(32, 0.150, now=9.5)
    assert Qoe.worth_running([1.0] * 48, 0, warmed, now=10.0) == 48
    assert len(Qoe().plan(burst, now=10.0, costs=warmed).run) == 48
    warmed.record(48, 0.220, now=10.0)  # a stale band's average starts again from its first new step
    assert warmed.of(48) == 0.220 and warmed.exactly(48, 10.0) == 0.220
    warmed.record(48, 0.240, now=10.2)  # and then moves as before
    assert warmed.of(48) == pytest.approx(0.224)


def blocky_seconds(k):
    """A step of k rows where the kernel works in blocks of 6 rows (fbgemm's fp16 product on the
    AVX2 kind reads every weight again for each 6): 76 ms for 1-6 rows, 113 for 7-12, 150 for
    13-18 ..."""
    return 0.039 + 0.037 * -(-k // 6)


def test_qoe_serves_rows_past_a_kernels_block_in_turn_where_that_gives_everyone_more_text():
    """Seven rows far ahead of their readers, nobody joining, on a kernel that works in blocks of
    6 rows: six run at a time, in turn (the longest without a token first), so every row gets
    more tokens a second than at every step of seven; costs not measured lately: every row runs,
    and is measured; a smooth cost (more rows never dearer a row): every row runs, always."""
    rows = [Fake(created=0.0, delivered=300, last_at=19.0) for _ in range(7)]
    costs, q, now = StepCosts(), Qoe(), 20.0
    assert q.plan(rows, now, costs=costs).run == list(range(7))  # nothing measured yet
    for k in (6, 7):
        costs.record(k, blocky_seconds(k), now)
    tokens, start = [0] * 7, now
    for _ in range(70):
        run = q.plan(rows, now, costs=costs).run
        costs.record(len(run), blocky_seconds(len(run)), now)
        now += blocky_seconds(len(run))
        for i in run:
            rows[i].delivered, rows[i].last_at, tokens[i] = rows[i].delivered + 1, now, tokens[i] + 1
    per_row = [t / (now - start) for t in tokens]
    assert min(per_row) > 1 / blocky_seconds(7) * 1.2  # each row: more than every step of 7 gives
    assert max(tokens) - min(tokens) <= 1  # in turn
    assert q.plan(rows, now + 60, costs=costs).run == list(range(7))  # a minute on: measured again
    smooth = StepCosts()
    for k in range(1, 8):
        smooth.record(k, step_seconds(k), now)
    assert q.plan(rows, now, costs=smooth).run == list(range(7))
    assert Qoe.cheapest(list(range(7)), 7, costs, now) == list(range(7))  # rows that must run, run


def test_qoe_trims_the_urgent_rows_to_a_kernels_block_the_neediest_kept():
    """Seven readers about to wait: six run, the one with the most text left in hand waits a step."""
    rows = [Fake(created=0.0, delivered=88 + i, last_at=19.9) for i in range(7)]
    costs = StepCosts()
    for k in range(1, 8):
        costs.record(k, blocky_seconds(k), 20.0)
    assert sorted(Qoe().plan(rows, 20.0, costs=costs).run) == [0, 1, 2, 3, 4, 5]


def test_qoe_lets_rows_ahead_ride_with_a_reader_about_to_wait_while_the_step_keeps_its_pace():
    """Two readers about to wait among ten far ahead: the rows ahead ride along while the step
    keeps every reader in it at KEEP_PACE x the reading rate (steps of 12 here: 113 ms, 8.8
    tokens a second), instead of a step of MIN_BATCH rows that leaves the others' tokens for
    later; where only small steps keep that pace, only they run, and where a step of all of them
    keeps every reader at FULL_PACE x the rate, all of them; a prompt waiting to join: the rows
    make room for it as before."""
    rows = [Fake(delivered=d, last_at=19.9) for d in (85, 86, *range(200, 210))]
    costs = StepCosts()
    for k in range(1, 13):
        costs.record(k, blocky_seconds(k), 20.0)
    assert sorted(Qoe().plan(rows, 20.0, costs=costs).run) == list(range(12))
    slow = StepCosts()
    for k in range(1, 13):
        slow.record(k, 0.1 + 0.02 * k, 20.0)  # 1 / (1.5 x 4.6) = 145 ms: 2 rows
    assert sorted(Qoe().plan(rows, 20.0, costs=slow).run) == [0, 1, 2, 3]  # MIN_BATCH's places
    paced = StepCosts()
    for k in range(1, 13):  # 8 rows within KEEP_PACE's 145 ms, all 12 within FULL_PACE's 181 ms: all ride
        paced.record(k, 0.1 + 0.005 * k, 20.0)
    assert paced.most_within(1 / (READING_RATE * 1.5), 12) == 8
    assert sorted(Qoe().plan(rows, 20.0, costs=paced).run) == list(range(12))
    assert len(Qoe().plan(rows, 20.0, joining=19.9, costs=costs, waiting=2000).run) == 4


def step_seconds(k):
    """A step of k rows on a machine shaped like this one (bundled model, bfloat16): a step of 16
    costs less than twice one of 1, past that the rows cost in full (about 0.12 s for 1 row,
    0.2 for 16, 0.38 for 32)."""
    return 0.115 + 0.0055 * k if k <= 16 else 0.203 + 0.011 * (k - 16)


def overloaded(policy, n=40, every=0.3, tokens=100):
    """n readers, one every `every` seconds (each with its first token out at once), stepped on
    `step_seconds`' machine, which cannot keep them all at reading speed: each reader's QoE and
    the longest any row went without a token."""
    costs = StepCosts()
    rows = [Fake(created=i * every, delivered=1, last_at=i * every, planned=tokens) for i in range(n)]
    arrivals = [[(0.0, 1)] for _ in rows]
    now, longest = 0.0, 0.0
    while live := [i for i, r in enumerate(rows) if r.created <= now and r.delivered < tokens]:
        run = [live[j] for j in policy.plan([rows[i] for i in live], now, None, costs).run]
        costs.record(len(run), step_seconds(len(run)))
        now += step_seconds(len(run))
        for i in run:
            longest = max(longest, now - rows[i].last_at)
            rows[i].delivered += 1
            rows[i].last_at = now
            arrivals[i].append((now - rows[i].created, 1))
    return [qoe(a) for a in arrivals], longest


def test_qoe_under_overload_serves_readers_better_than_running_everyone_and_starves_nobody():
    """3.3 readers a second on a machine that keeps about 16 at reading speed: running the rows
    worth the step (qoe) gives a higher mean QoE (0.692 against 0.633), and more readers at 0.95
    or more (1 against 0; 5 before smaller steps needed fresh costs and 10% more gain), than
    running every row (fifo); no row goes longer than MAX_SKIP without a token, give or take the step
    under way and the one after it."""
    ours, longest = overloaded(Qoe())
    everyone, _ = overloaded(Fifo())
    assert sum(ours) > 1.05 * sum(everyone)
    assert sum(q >= 0.95 for q in ours) > sum(q >= 0.95 for q in everyone)
    assert longest <= MAX_SKIP + 2 * step_seconds(40)


def test_qoe_starves_no_row_under_overload():
    """40 readers on a machine that can serve fewer at reading speed: every row still runs at
    least every MAX_SKIP seconds, and the policy never runs an empty step."""
    q, now = Qoe(), 0.0
    rows = [Fake(created=0.0, delivered=1, last_at=0.0) for _ in range(40)]
    longest = 0.0
    for _ in range(400):
        run = q.plan(rows, now).run
        assert run
        now += 0.05 + 0.006 * len(run)  # a step's time grows with its batch
        for i in run:
            longest = max(longest, now - rows[i].last_at)
            rows[i].delivered += 1
            rows[i].last_at = now
    assert longest <= MAX_SKIP + 0.05 + 0.006 * 40


# --- the engine, stepped by hand --------------------------------------------------------------


def params(i, n=12):
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n, "seed": i, "temperature": 0 if i % 2 else 1.0}
    return plain_request(body).params


def ids(i):
    return lm.tok(PROMPTS[i % len(PROMPTS)]).input_ids


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


async def all_at_once(net, prompts, answers, max_batch):
    """An engine with no thread (fifo): every request queued and admitted at once, then stepped by
    hand until all have ended; the engine and each request's text."""
    e = BatchEngine(max_batch=max_batch, model=model_of(net), policy=Fifo(10_000), clock=Clock())
    jobs = [BatchedJob(e, p, params(i, n)) for i, (p, n) in enumerate(zip(prompts, answers, strict=True))]
    for job in jobs:
        job.stats.active.add(job)
        e.waiting.append(Row(job, 0.0))
    e.batch.admit(e.max_batch)
    with torch.inference_mode():
        while e.batch.rows or e.batch.joining:
            e.batch.step()
    return e, [await job_text(j) for j in jobs]


async def each_alone(net, prompts, answers):
    """Each request's text from the thread engine, one after the other."""
    return [
        await job_text(ThreadJob(p, params(i, n), model=model_of(net)).start())
        for i, (p, n) in enumerate(zip(prompts, answers, strict=True))
    ]


def stepped(net, policy, n_jobs, tokens=12):
    """An engine with no thread: n jobs queued, then step() by hand; the fake clock moves 0.2 s a step."""
    clock = Clock()
    e = BatchEngine(max_batch=16, model=model_of(net), policy=policy, clock=clock)
    jobs = [BatchedJob(e, ids(i), params(i, tokens)) for i in range(n_jobs)]
    for job in jobs:
        job.stats.active.add(job)
        e.waiting.append(Row(job, clock()))
    e.batch.admit(e.max_batch)
    return e, jobs, clock


def alone(net, n_jobs, tokens=12):
    async def run():
        return [
            await job_text(ThreadJob(ids(i), params(i, tokens), model=model_of(net)).start()) for i in range(n_jobs)
        ]

    return asyncio.run(run())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_burst_joins_in_one_step_within_the_budget_and_gives_each_its_text_alone(dtype):
    net = ExactModel(lm.load_tokenizer()).to(dtype)
    lengths = [len(ids(i)) for i in range(8)]

    async def run(budget):
        e, jobs, clock = stepped(net, Fifo(budget), 8)
        with torch.inference_mode():
            e.batch.step()
            after_one = [j.produced for j in jobs]
            while e.batch.rows or e.batch.joining:
                clock.now += 0.2
                e.batch.step()
        return after_one, [await job_text(j) for j in jobs]

    after_one, texts = asyncio.run(run(sum(lengths)))
    assert after_one == [1] * 8  # all eight prompts in one forward pass: each has its first token
    after_one_half, texts_half = asyncio.run(run(sum(lengths[:4])))
    # the budget took the first four; the last three repeat them (PROMPTS has five) and ride on them
    assert after_one_half == [1] * 4 + [0] + [1] * 3
    assert texts == texts_half == alone(net, 8)


def test_a_failed_step_fails_the_prompts_it_began_and_those_not_begun_join_after_it():
    """A step fails (its pass raised): its rows and the prompts with a slot fail, and the prompts
    that were in no pass (the budget took the first four) join at the next step and get their texts
    alone. They failed with the others. But once only: what fails before they have slots would fail
    at every step, the engine stepping on for ever."""
    net = ExactModel(lm.load_tokenizer())
    lengths = [len(ids(i)) for i in range(8)]

    async def run():
        e, jobs, clock = stepped(net, Fifo(sum(lengths[:4])), 8)
        forward = e.batch.forward

        def fails(*_):
            e.batch.forward = forward  # once
            raise RuntimeError("a kernel failed")

        e.batch.forward = fails
        with torch.inference_mode():
            try:
                e.batch.step()
            except RuntimeError as error:
                e.batch.fail(error)  # (as the engine's thread does)
            assert len(e.batch.joining) == 4 and not e.batch.rows
            while e.batch.rows or e.batch.joining:
                clock.now += 0.2
                e.batch.step()
        got = []
        for j in jobs:
            try:
                got.append(await job_text(j))
            except RuntimeError as error:
                got.append(str(error))
        return got

    got = asyncio.run(run())
    assert got[:4] == ["a kernel failed"] * 4 and got[4:] == alone(net, 8)[4:]

    async def before_any_slot():  # what fails before the prompts have slots fails them at its second step
        e, jobs, _ = stepped(net, Fifo(sum(lengths)), 3)

        def fails(*_):
            raise RuntimeError("no room")

        e.batch.pieces = fails
        for left in (3, 0):
            try:
                e.batch.step()
            except RuntimeError as error:
                e.batch.fail(error)
            assert len(e.batch.joining) == left
        return [j.ended.is_set() for j in jobs]

    assert asyncio.run(before_any_slot()) == [True] * 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_that_sit_steps_out_keep_their_text_and_a_stop_holds_within_a_step(dtype):
    net = ExactModel(lm.load_tokenizer()).to(dtype)

    async def run():
        e, jobs, clock = stepped(net, Qoe(min_batch=1, conserving=False), 6, tokens=30)
        jobs[0].orphaned = True  # a resumable stream nobody reads: spare places only
        skipped_orphan = 0
        with torch.inference_mode():
            e.batch.step()  # the burst joins: one token each
            for k in range(200):
                clock.now += 0.05  # fast steps: rows get ahead of their readers and sit out
                before = jobs[0].produced
                e.batch.step()
                skipped_orphan += jobs[0].produced == before and not jobs[0].ended.is_set()
                if k == 20:
                    jobs[3].stop.set()
                    stop_at = jobs[3].produced
                if not (e.batch.rows or e.batch.joining):
                    break
        texts = [await job_text(j) for j in jobs]
        return e, jobs, texts, skipped_orphan, stop_at

    e, jobs, texts, skipped_orphan, stop_at = asyncio.run(run())
    assert e.batch.skipped > 0 and skipped_orphan > 0  # rows sat steps out, the orphan most
    assert jobs[3].reason == "stopped" and jobs[3].produced - stop_at <= 1
    expected = alone(net, 6, tokens=30)
    assert [t for i, t in enumerate(texts) if i != 3] == [t for i, t in enumerate(expected) if i != 3]
    assert expected[3].startswith(texts[3])
    assert e.batch.rows == [] and e.batch.kv.rows() == 0  # every row's KV memory released


class Holder:
    def __init__(self, length=0):
        self.slot, self.length = None, length


def write(b, decode=(), pieces=(), value=0.0):
    """One step's keys through SlotKV.update (as a one-layer model would write them)."""
    layout = kv.Layout(b, list(decode), list(pieces), [o.length for o in b.owners])
    b.fit(len(b), layout.room())
    b.layout = layout
    t = len(layout.tokens)
    keys = torch.arange(t, dtype=torch.float32).view(1, 1, t, 1) + value
    b.update(keys, keys.clone(), 0)
    return layout


def test_a_request_that_would_pass_the_kv_memory_waits_its_turn_and_keeps_its_text():
    net = ExactModel(lm.load_tokenizer())
    longest = max(len(ids(i)) for i in range(2)) + 30
    room_for_one = int(1.5 * longest * kv.token_bytes(net))  # two rows at their whole answers would pass it

    async def run():
        e = BatchEngine(max_batch=8, model=model_of(net), policy=Fifo(10_000), clock=Clock(), kv_memory=room_for_one)
        jobs = [BatchedJob(e, ids(i), params(i, 30)) for i in range(2)]
        for job in jobs:
            job.stats.active.add(job)
            e.waiting.append(Row(job, e.clock()))
        e.batch.admit(e.max_batch)
        admitted, waiting = len(e.batch), e.position(jobs[1])
        with torch.inference_mode():
            while e.batch.rows or e.batch.joining or e.waiting:
                e.batch.step()
                with e.lock:
                    e.batch.admit(e.max_batch)
        return admitted, waiting, [await job_text(j) for j in jobs]

    admitted, waiting, texts = asyncio.run(run())
    assert admitted == 1 and waiting == 0  # the second waits, first in line, though there are places
    assert texts == alone(net, 2, tokens=30)


def test_tokens_go_into_their_slots_and_a_row_that_sits_out_is_not_touched():
    b = kv.SlotKV("cpu")
    rows = [Holder() for _ in range(3)]
    for r in rows:
        b.take(r)
    write(b, pieces=[(0, 0, 2), (1, 0, 3), (2, 0, 1)], value=10)  # three prompts join in one pass
    rows[0].length, rows[1].length, rows[2].length = 2, 3, 1
    store = b.keys[0].data_ptr()
    layout = write(b, decode=[(0, 2), (2, 1)], value=20)  # row 1 sits the step out
    keys = b.keys[0][:, 0, :, 0]
    assert keys[0, :3].tolist() == [10, 11, 20] and keys[1, :4].tolist() == [12, 13, 14, 0]
    assert keys[2, :2].tolist() == [15, 21] and b.keys[0].data_ptr() == store  # written in place
    assert not layout.every_slot and len(layout.blocks) == 1  # three slots: one block (blocks.GRAIN)
    (block,) = layout.blocks
    assert (block.start, block.end, block.longest, block.first, block.last) == (0, 3, 3, 0, 2)
    assert block.index.tolist() == [0, 2]  # row 1's place gets a zero query
    # Attention reads each slot to its own length: row 1 (sitting out) is masked to its 3.
    assert block.mask[:, 0, 0].tolist() == [[True, True, True], [True, True, True], [True, True, False]]


def test_a_leave_moves_the_last_slot_into_its_place_and_an_empty_batch_holds_nothing():
    b = kv.SlotKV("cpu")
    rows = [Holder() for _ in range(3)]
    for r in rows:
        b.take(r)
    write(b, pieces=[(0, 0, 2), (1, 0, 2), (2, 0, 2)])
    for r in rows:
        r.length = 2
    b.release(rows[0])
    assert rows[2].slot == 0 and rows[1].slot == 1 and rows[0].slot is None and len(b) == 2
    assert b.keys[0][0, 0, :2, 0].tolist() == [4, 5]  # row 2's keys, moved
    b.release(rows[1])
    b.release(rows[2])
    assert len(b) == 0 and b.rows() == 0 and not b.keys  # memory released


def test_sorting_the_slots_moves_each_rows_keys_with_it_and_only_the_rows_out_of_their_piece():
    b = kv.SlotKV("cpu")
    lengths = [3, 9, 5, 9, 1, 7]
    rows = [Holder() for _ in lengths]
    for r in rows:
        b.take(r)
    write(b, pieces=[(i, 0, n) for i, n in enumerate(lengths)])
    for r, n in zip(rows, lengths, strict=True):
        r.length = n
    before = {id(r): b.keys[0][r.slot, 0, : r.length, 0].tolist() for r in rows}
    untouched = b.keys[0][1:5].clone()  # rows in their piece of blocks.GRAIN slots by rank already
    b.sorter.spent = float("inf")  # (the rule is blocks.py's: here, due at once)
    b.settle()
    assert b.sorts == 1
    assert sorted(o.length for o in b.owners[:4]) == [5, 7, 9, 9] and sorted(o.length for o in b.owners[4:]) == [1, 3]
    assert [r.slot for r in rows] == [5, 1, 2, 3, 4, 0] and all(b.owners[r.slot] is r for r in rows)  # two moved
    assert all(b.keys[0][r.slot, 0, : r.length, 0].tolist() == before[id(r)] for r in rows)
    assert torch.equal(b.keys[0][1:5], untouched)


def decode_in_slots(net, prompts, call=1e12, sitting_out=None, fed=None):
    """Each prompt alone into a slot of its own, then one decode step of every row but the one in
    slot `sitting_out` (row i fed fed[i], by default 100 + i), at a block call cost of `call`
    (blocks.py): the step's logits (a row each) and its Layout."""
    fed = fed or [100 + i for i in range(len(prompts))]
    b = kv.SlotKV("cpu")
    b.call = call
    holders = [Holder() for _ in prompts]
    with torch.inference_mode():
        for h, p in zip(holders, prompts, strict=True):
            b.take(h)
            layout = kv.Layout(b, [], [(h.slot, 0, len(p))], [o.length for o in b.owners])
            b.fit(len(b), layout.room())
            b.layout = layout
            net(
                input_ids=torch.tensor([p]),
                position_ids=torch.tensor([list(range(len(p)))]),
                attention_mask={"full_attention": layout},
                **step_kwargs(net, b, torch.tensor([len(p) - 1])),
            )
            h.length = len(p)
        run = [h for h in holders if h.slot != sitting_out]
        layout = kv.Layout(b, [(h.slot, h.length) for h in run], [], [o.length for o in b.owners])
        b.fit(len(b), layout.room())
        b.layout = layout
        logits = net(
            input_ids=torch.tensor([[fed[h.slot] for h in run]]),
            position_ids=torch.tensor([[h.length for h in run]]),
            attention_mask={"full_attention": layout},
            **step_kwargs(net, b, torch.arange(len(run))),
        ).logits[0]
    return logits, layout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_in_blocks_gives_what_one_block_over_every_slot_gives(dtype):
    """Rows of unlike lengths, one decode step: read in blocks, each to its own longest (cheap
    calls), and read all to the longest (calls dearer than any padding), with one row sitting out."""
    net = tiny_model(lm.load_tokenizer()).to(dtype).eval()
    attention.install(net)
    text = lm.tok(" ".join(PROMPTS * 3)).input_ids
    prompts = [text[i : 2 + 4 * i] for i in range(12)]  # 2 to 35 tokens
    for sitting_out in (None, 5):
        one, layout = decode_in_slots(net, prompts, 1e12, sitting_out)
        blocked, cut = decode_in_slots(net, prompts, 0.0, sitting_out)
        assert len(layout.blocks) == 1 and len(cut.blocks) == len(prompts) // 4  # a block every GRAIN slots
        scale = float(one.abs().max())
        assert float((one - blocked).abs().max()) <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_one_length_decode_folded_as_each_would_alone(dtype):
    """Rows of one length need no mask, and their block is read with the query heads folded onto
    their key-value heads (attention.folded, not transformers' enable_gqa): each row's logits are
    what it gets alone in the engine (transformers' own call), within a pass's tolerance."""
    net = tiny_model(lm.load_tokenizer()).to(dtype).eval()
    attention.install(net)
    text = lm.tok(" ".join(PROMPTS * 3)).input_ids
    prompts = [text[9 * i : 9 * i + 9] for i in range(6)]  # six prompts of 9 tokens
    together, layout = decode_in_slots(net, prompts)
    assert [(b.start, b.end, b.mask) for b in layout.blocks] == [(0, 6, None)]
    scale = float(together.abs().max())
    for i, p in enumerate(prompts):
        alone, _ = decode_in_slots(net, [p], fed=[100 + i])
        assert float((together[i] - alone[0]).abs().max()) <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_lone_rows_decode_through_its_slot_is_the_models_own_arithmetic_to_the_bit(dtype):
    """One row, as the engine runs it (attention.py over its slot) and as the model runs alone
    with transformers' own cache: the same logits at every step, to the bit (its block has no
    mask, so SDPA is called as transformers calls it)."""
    from transformers import DynamicCache

    net = tiny_model(lm.load_tokenizer()).to(dtype).eval()
    attention.install(net)
    prompt, fed = lm.tok(" ".join(PROMPTS)).input_ids, [100 + 7 * k for k in range(6)]
    b, h, cache = kv.SlotKV("cpu"), Holder(), DynamicCache()
    b.take(h)
    with torch.inference_mode():
        own = net(input_ids=torch.tensor([prompt]), **forward_kwargs(net, cache)).logits[0, -1]
        layout = kv.Layout(b, [], [(0, 0, len(prompt))], [0])
        b.fit(1, layout.room())
        b.layout = layout
        ours = net(
            input_ids=torch.tensor([prompt]),
            position_ids=torch.tensor([list(range(len(prompt)))]),
            attention_mask={"full_attention": layout},
            **step_kwargs(net, b, torch.tensor([len(prompt) - 1])),
        ).logits[0, -1]
        assert torch.equal(ours, own)
        h.length = len(prompt)
        for token in fed:
            own = net(input_ids=torch.tensor([[token]]), **forward_kwargs(net, cache)).logits[0, -1]
            layout = kv.Layout(b, [(0, h.length)], [], [h.length])
            b.fit(1, layout.room())
            b.layout = layout
            ours = net(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[h.length]]),
                attention_mask={"full_attention": layout},
                **step_kwargs(net, b, torch.tensor([0])),
            ).logits[0, -1]
            assert torch.equal(ours, own), h.length
            h.length += 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_whose_slots_are_sorted_mid_answer_keep_the_thread_engines_text(dtype, monkeypatch):
    monkeypatch.setattr(kv, "Sorter", lambda call: blocks.Sorter(call, copy=0.0))  # sort whenever out of order
    net = ExactModel(lm.load_tokenizer()).to(dtype)
    prompts = [ids(i % 5) + ids(i)[: i % 7] for i in range(14)]  # unlike lengths
    answers = [8 + 5 * (i % 4) for i in range(14)]  # rows leave at unlike times: the last slot moves

    e, texts = asyncio.run(all_at_once(net, prompts, answers, max_batch=16))
    assert e.batch.kv.sorts >= 2 and texts == asyncio.run(each_alone(net, prompts, answers))


def test_the_room_grows_for_a_long_row_and_keeps_what_the_slots_hold():
    b = kv.SlotKV("cpu")
    r = Holder()
    b.take(r)
    write(b, pieces=[(0, 0, 3)], value=1)
    r.length = 3
    write(b, decode=[(0, kv.FIRST_ROOM + 5)], value=7)  # past the room: it doubles
    assert b.room >= kv.FIRST_ROOM + 6 and b.keys[0][0, 0, :3, 0].tolist() == [1, 2, 3]
    assert b.keys[0][0, 0, kv.FIRST_ROOM + 5, 0] == 7


def test_slots_grow_for_more_rows_and_keep_what_they_hold():
    b = kv.SlotKV("cpu")
    rows = [Holder() for _ in range(kv.FIRST_SLOTS)]
    for r in rows:
        b.take(r)
    write(b, pieces=[(r.slot, 0, 2) for r in rows])
    for r in rows:
        r.length = 2
    late = Holder()
    b.take(late)  # one more row than there are slots: more slots
    assert b.slots > kv.FIRST_SLOTS and b.keys[0][: kv.FIRST_SLOTS, 0, :2, 0].flatten().tolist() == list(range(16))


def test_a_long_row_holds_no_spare_slots():
    b = kv.SlotKV("cpu")
    r = Holder()
    b.take(r)
    write(b, pieces=[(0, 0, 3)])
    r.length = 3
    write(b, decode=[(0, 20_000)])  # every slot holds the whole room: no spare slots of 20,000 tokens
    assert b.slots == 1 and b.room >= 20_001


def one_pass(net, prompts, prefixes=None, decode=None):
    """The prompts' last logits from one fused pass of the engine (attention.py over kv.py's
    slots), after a kept prefix where `prefixes` has one; with `decode`, a row that decodes a
    token in the same pass (its prompt prefilled first, alone) comes first."""
    attention.install(net)
    b = kv.SlotKV("cpu")
    holders = []

    def run(decode_rows, pieces, tokens, positions, keep):
        layout = kv.Layout(b, decode_rows, pieces, [o.length for o in b.owners])
        b.fit(len(b), layout.room())
        b.layout = layout
        mask = {"full_attention": layout, "sliding_attention": layout}
        keep = torch.tensor(keep, dtype=torch.long)
        return net(
            input_ids=torch.tensor([tokens]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
            **step_kwargs(net, b, keep),
        ).logits[0]

    with torch.inference_mode():
        first = []
        if decode is not None:
            h = Holder()
            b.take(h)
            run([], [(h.slot, 0, len(decode))], decode, list(range(len(decode))), [len(decode) - 1])
            h.length = len(decode)
            holders.append(h)
            first = [(h.slot, h.length)]
        pieces, tokens, positions = [], [100] if first else [], [len(decode)] if first else []
        for p in prompts:
            h = Holder()
            b.take(h)
            start = 0
            if prefixes is not None and (kept := prefixes.lookup(p, None)) is not None:
                start, layers = kept
                b.put(h.slot, layers, start)
            pieces.append((h.slot, start, len(p) - start))
            tokens += p[start:]
            positions += range(start, len(p))
        ends = list(itertools.accumulate(n for *_, n in pieces))
        keep = [len(first) + e - 1 for e in ends]
        return run(first, pieces, tokens, positions, keep)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prompts_joining_in_one_pass_with_a_decoding_row_give_each_prompts_logits_alone(dtype):
    net = tiny_model(lm.load_tokenizer()).to(dtype)
    prompts = [ids(i) for i in range(5)]
    together = one_pass(net, prompts, decode=lm.tok(PROMPTS[1]).input_ids)
    each = [one_pass(net, [p])[0] for p in prompts]
    with torch.inference_mode():
        plain = [net(input_ids=torch.tensor([p]), logits_to_keep=1).logits[0, -1] for p in prompts]  # no engine
    scale = max(float(x.abs().max()) for x in each)
    worst = max(float((together[i] - each[i]).abs().max()) for i in range(len(prompts)))
    assert worst <= TOLERANCE[dtype] * scale
    assert all(torch.equal(a, b) for a, b in zip(each, plain, strict=True))  # alone: the model's own arithmetic


SHARED = "You are a careful assistant. You answer briefly and exactly, in plain words, and you never guess. "


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_shared_beginning_is_prefilled_once_and_the_texts_stay_those_of_each_alone(dtype):
    net = ExactModel(lm.load_tokenizer()).to(dtype)
    prompts = [lm.tok(SHARED + p).input_ids for p in PROMPTS]

    e, texts = asyncio.run(all_at_once(net, prompts, [12] * len(prompts), max_batch=8))
    assert e.batch.prefixes.hits == len(prompts) and len(e.batch.prefixes.known) == 1
    assert len(next(iter(e.batch.prefixes.known))[1]) >= PREFIX_MIN
    assert texts == asyncio.run(each_alone(net, prompts, [12] * len(prompts)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prefill_after_a_kept_prefix_gives_the_logits_of_a_whole_one_within_the_tolerance(dtype):
    net = tiny_model(lm.load_tokenizer()).to(dtype)
    prompts = [lm.tok(SHARED + p).input_ids for p in PROMPTS]
    prefixes = Prefixes("cpu")
    with torch.inference_mode():
        prefixes.learn(net, prompts, forward_kwargs, None)
    assert len(prefixes.known) == 1 and len(next(iter(prefixes.known))[1]) >= PREFIX_MIN
    after = one_pass(net, prompts, prefixes)
    whole = [one_pass(net, [p])[0] for p in prompts]
    assert prefixes.hits == len(prompts)
    scale = max(float(x.abs().max()) for x in whole)
    worst = max(float((after[i] - whole[i]).abs().max()) for i in range(len(prompts)))
    assert worst <= TOLERANCE[dtype] * scale


# --- the quantized kernels ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_request_in_the_engine_gives_its_own_unbatched_runs_tokens(mode):
    net = quant.quantize(tiny_model(lm.load_tokenizer()).to(torch.float32), mode)
    assert any(isinstance(m, quant.QuantLinear) for m in net.modules())

    async def run():
        e = BatchEngine(max_batch=4, model=model_of(net))
        together = [await job_text(BatchedJob(e, ids(i), params(i, 20)).start()) for i in range(3)]
        return together

    assert asyncio.run(run()) == alone(net, 3, tokens=20)


# --- the server's options ---------------------------------------------------------------------


def test_a_qoe_server_serves_a_burst_with_the_same_greedy_texts_as_a_fifo_one():
    servers = [
        ServerProcess("--model", "exact", "--schedule", "qoe", "--prefill-budget", "40"),
        ServerProcess("--model", "exact", "--schedule", "fifo"),
    ]
    try:
        ports = [s.wait().port for s in servers]

        def burst(port):
            bodies = [{"prompt": PROMPTS[i % 5], "max_tokens": 25, "temperature": 0} for i in range(10)]
            with ThreadPoolExecutor(10) as pool:
                answers = list(pool.map(lambda b: http(port, "POST", "/stream", b), bodies))
            return [(a[0], "".join(stream_texts(a[2])[0])) for a in answers]

        qoe_texts, fifo_texts = burst(ports[0]), burst(ports[1])
        assert all(status == 200 for status, _ in qoe_texts) and qoe_texts == fifo_texts
        assert metrics(ports[0])["schedule"] == "qoe" and metrics(ports[1])["schedule"] == "fifo"
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("argv", [["--prefill-budget", "0"], ["--schedule", "lifo"]], ids=["budget 0", "schedule"])
def test_a_bad_schedule_option_is_a_usage_error(argv):
    out = subprocess.run(
        [sys.executable, "server.py", "--model", "tiny", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "usage:" in out.stderr and "Traceback" not in out.stderr


def test_the_room_grows_by_doubling_but_never_past_the_longest_a_row_can_grow():
    """Admission (kv.fits) counts every slot at the longest row's whole answer; the room, doubled
    past that, held up to 2.9x --kv-memory (two rows of 4,200 tokens in 3 slots of 8,192)."""
    b = kv.SlotKV("cpu")
    first = b.room
    b.fit(1, first + 1, most=first + 10)
    assert b.room == first + 10  # not 2 * first
    b.fit(1, first + 11)
    assert b.room == 2 * (first + 10)  # no bound given: doubled, as before


def test_a_stream_taken_over_is_as_urgent_as_a_reader_caught_up_now():
    """Its answer so far (prior) was read on the replica that died. Created at the takeover with
    prior counted as delivered, its slack was 1 + P/R s: never urgent, a token per MAX_SKIP under
    load. Now it is a reader caught up at the takeover: the slack of a new request's (TTFT)."""
    prior = ids(1) * 20  # 200-odd tokens read already

    async def rows():  # (a job belongs to a running loop)
        e = BatchEngine(max_batch=4, model=lm.handle(), policy=Qoe(), clock=Clock())
        taken = BatchedJob(e, ids(0), params(0, 400), prior=prior)
        return taken, Row(taken, 100.0), Row(BatchedJob(e, ids(0), params(0, 400)), 100.0)

    taken, over, fresh = asyncio.run(rows())
    policy = Qoe()
    slack = [policy.slack(r.created, r.delivered, 100.0) for r in (over, fresh)]
    assert taken.produced == len(prior) and slack[0] == pytest.approx(slack[1]) == pytest.approx(policy.ttft)
