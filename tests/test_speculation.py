"""Speculative decoding by prompt lookup (streaming/generation/speculation.py, batch.py): the
lookup against a brute-force search (hypothesis), how a step's guesses are shared and kept, and in
the engine, that an answer with guesses is token for token the answer without them: with the
`exact` model (guesses nearly always wrong: each is thrown away) and the `echo` model (the answer
is the prompt's message: guesses kept), greedy and seeded sampling, alone and in a batch, in both
dtypes; and the server's --speculate."""

import asyncio
import json

import pytest
import torch
from helpers import ServerProcess, http, job_text, metrics, model_of
from hypothesis import given, settings
from hypothesis import strategies as st

import lm
import server
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.speculation import GUESS_COST, MAX_SPECULATE, SPECULATE, STALE_PASSES, Lookup, Odds, kept
from streaming.generation.thread import ThreadJob
from streaming.model.testing import EchoModel, ExactModel
from streaming.wire.params import GenerationParams

MESSAGES = [
    "one two three, one two four, one two three, one two four, and one two five",
    "The keeper wrote in his log: wind from the west. The keeper wrote in his log: wind from the east.",
    "abc abc abd abc abc abd abc",
]


def reference(ids, k, longest=3):
    """The latest earlier occurrence of the longest tail (up to `longest`) with something after it."""
    for n in range(min(longest, len(ids)), 0, -1):
        tail = ids[-n:]
        for s in range(len(ids) - n - 1, -1, -1):
            if ids[s : s + n] == tail:
                return n, ids[s + n : s + n + k]
    return 0, []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=60),
    st.lists(st.lists(st.integers(0, 5), max_size=6), max_size=8),
    st.integers(1, 6),
)
def test_a_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_tail(start, added, k):
    look, ids = Lookup(start), list(start)
    assert look.propose(k) == reference(ids, k)
    for more in added:  # indexed as it is asked: the same answers after each extension
        look.extend(more)
        ids += more
        assert look.propose(k) == reference(ids, k)
    assert look.propose(0) == (0, [])


def test_a_row_keeps_its_guesses_up_to_the_first_its_sampling_differs_from():
    assert kept([], [7]) == 1  # no guesses: its one token
    assert kept([5, 6, 7], [5, 6, 7, 8]) == 4  # all confirmed: and the token after them
    assert kept([5, 6, 7], [5, 9, 7, 8]) == 2  # the second differs: its own token ends the step
    assert kept([5], [4, 5]) == 1


def test_the_odds_give_a_step_the_guesses_that_pay_by_the_engines_own_counts_and_costs():
    odds = Odds()  # the prior: a guess costs GUESS_COST of a pass; after one id, the second is marginal
    assert GUESS_COST == 0.09 and SPECULATE == 4 and MAX_SPECULATE >= SPECULATE
    assert [odds.shares([(n, 4)]) for n in range(4)] == [[0], [2], [4], [4]]
    assert odds.shares([(3, 2)]) == [2] and odds.shares([(3, 4)], most=0) == [0]
    assert odds.shares([(3, 4), (3, 4)]) == [2, 1]  # likeliest first, in all at most SPECULATE + 1 tokens
    assert odds.shares([(1, 4), (3, 4)]) == [0, 3]  # the likeliest guesses, whichever row's: a third after three ids
    assert odds.shares([(3, 1)] * 4) == [1, 0, 0, 0] and odds.shares([(3, 4)] * 5) == [0] * 5
    dear = Odds()  # passes measured: each token 30% of a one-token pass
    for tokens in range(1, 6):
        dear.passed(tokens, 0.05 * (1 + 0.3 * (tokens - 1)))
    assert [dear.shares([(n, 4)]) for n in (1, 2, 3)] == [[0], [1], [4]]
    flat = Odds()  # a pass of up to 5 tokens costs what one of 3 does: two rows gain from guesses
    for tokens in range(1, 6):
        flat.passed(tokens, 0.05 if tokens < 3 else 0.06)
    assert flat.shares([(1, 4), (1, 4)]) == [2, 1]
    missed = Odds()  # after three ids the guesses kept nothing, 200 times: none pays any more
    for _ in range(200):
        missed.guessed(3, 4, 0)
    assert missed.shares([(3, 4)]) == [0] and missed.shares([(2, 4)]) == [4]
    for _ in range(200):  # and a first guess always kept, the rest never: one
        missed.guessed(2, 4, 1)
    assert missed.shares([(2, 4)]) == [1]


def test_a_width_priced_out_by_one_slow_pass_is_tried_again_once_its_cost_is_old():
    odds = Odds()
    odds.passed(5, 0.2)  # one slow 5-token pass (the machine busy): 4 guesses look dear
    for _ in range(STALE_PASSES):
        odds.passed(1, 0.05)
    assert odds.shares([(3, 4)]) == [2]  # 3 and 4 tokens estimated from the nearest measured width
    odds.passed(1, 0.05)  # the 5-token cost is older than STALE_PASSES passes: forgotten
    assert 5 not in odds.seconds and odds.shares([(3, 4)]) == [4]  # estimated from one token's: tried again
    odds.passed(5, 0.055)  # and measured again, at what it costs now
    assert odds.seconds[5] == 0.055 and odds.shares([(3, 4)]) == [4]


def conversation(message):
    text = lm.tok.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return lm.tok(text).input_ids


def plain(i):
    return lm.tok(MESSAGES[i]).input_ids


def request(i, n):
    return GenerationParams(max_tokens=n, seed=i, temperature=0 if i % 2 else 0.8, top_p=0.9, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("model", ["exact", "echo"])
def test_an_answer_with_guesses_is_the_answer_without_them_alone_and_in_a_batch(dtype, model):
    net = (EchoModel if model == "echo" else ExactModel)(lm.load_tokenizer()).to(dtype)
    prompts = [conversation(m) for m in MESSAGES] + [plain(i) for i in range(len(MESSAGES))]
    n = 40

    async def run():
        expected = [
            await job_text(ThreadJob(p, request(i, n), model=model_of(net)).start()) for i, p in enumerate(prompts)
        ]
        guessing = BatchEngine(model_of(net), max_batch=8, policy=Qoe())
        alone = [await job_text(BatchedJob(guessing, p, request(i, n)).start()) for i, p in enumerate(prompts)]
        alone_metrics = guessing.metrics()
        together = await asyncio.gather(
            *(job_text(BatchedJob(guessing, p, request(i, n)).start()) for i, p in enumerate(prompts))
        )
        off = BatchEngine(model_of(net), max_batch=8, policy=Fifo(speculate=0))
        without = [await job_text(BatchedJob(off, p, request(i, n)).start()) for i, p in enumerate(prompts)]
        return expected, alone, list(together), without, alone_metrics, off.metrics()

    expected, alone, together, without, m, m_off = asyncio.run(run())
    assert alone == expected and together == expected and without == expected
    assert m["speculate"] == SPECULATE and m["tokens_guessed"] > 0 and m_off["tokens_guessed"] == 0
    assert m["tokens_generated"] == n * len(prompts) == m_off["tokens_generated"]
    # without guesses, alone: each answer's first token from its prompt's pass, the rest one row a
    # step; every prompt token computed in a step that prompts joined, or copied (the steady window's
    # counts, bench_qoe.py)
    assert m_off["rows_run"] == (n - 1) * len(prompts) and m_off["join_steps"] >= len(prompts)
    copied = m_off["prompt_tokens_shared"] + m_off["prompt_tokens_retained"]
    assert 0 < m_off["prompt_tokens_computed"] <= sum(map(len, prompts)) - copied
    assert m_off["join_forward_seconds"] > 0
    if model == "echo":  # the answer repeats its prompt: most guesses kept, fewer steps
        assert m["guesses_kept"] > m["tokens_guessed"] / 2
        assert m["steps"] < m_off["steps"] * 0.8  # (half the prompts are plain text: no message to echo)
    else:  # guesses thrown away, each costing nothing but its place in the pass
        assert m["guesses_kept"] < m["tokens_guessed"]


def test_speculate_is_a_server_option_with_its_metrics():
    assert server.config_of(server.parse_args(["--engine", "free"]), "cpu").speculate == SPECULATE
    assert server.config_of(server.parse_args(["--speculate", "0"]), "cpu").speculate == 0
    for bad in (["--speculate", "-1"], ["--speculate", str(MAX_SPECULATE + 1)]):
        with pytest.raises(SystemExit):
            server.parse_args(bad)
    body = {"messages": [{"role": "user", "content": MESSAGES[1]}], "max_tokens": 40, "seed": 1, "temperature": 0.8}
    texts, seen = [], []
    for flag in ("0", "4"):
        with ServerProcess("--speculate", flag, model="echo") as s:
            s.wait()
            reply = json.loads(http(s.port, "POST", "/v1/chat/completions", body)[2])
            texts.append(reply["choices"][0]["message"]["content"])
            seen.append(metrics(s.port))
    assert texts[0] == texts[1] == MESSAGES[1]  # the echo model's answer: its message
    assert seen[0]["speculate"] == 0 and seen[0]["tokens_guessed"] == 0
    assert seen[1]["speculate"] == 4 and seen[1]["guesses_kept"] > 0


def test_a_stop_during_a_guessing_step_lets_through_at_most_that_steps_first_token():
    net = EchoModel(lm.load_tokenizer())
    calls, seen = [0], {}
    forward = net.forward

    def stopping(*args, **kwargs):  # the reader leaves during the 4th pass (guesses ride in it)
        calls[0] += 1
        if calls[0] == 4:
            seen["produced"] = job.produced
            job.stop.set()
        return forward(*args, **kwargs)

    net.forward = stopping

    async def run():
        global job
        e = BatchEngine(model_of(net), max_batch=2, policy=Qoe())
        job = BatchedJob(e, conversation(MESSAGES[1]), request(1, 60))
        await job_text(job.start())
        return e.metrics()

    m = asyncio.run(run())
    assert m["guesses_kept"] > 0  # guesses were kept before the stop
    assert job.produced - seen["produced"] <= 1
    # counted as delivered: one token a pass (the prompt's, then each decode step's), the rest guesses kept
    assert m["tokens_generated"] == job.produced and m["guesses_kept"] == job.produced - calls[0]


@pytest.mark.parametrize("heads,kv_heads", [(14, 2), (4, 2), (6, 3), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_folded_attention_is_transformers_sdpa_after_earlier_tokens(heads, kv_heads, dtype):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from streaming.generation.attention import folded

    module = type("Layer", (), {"num_key_value_groups": heads // kv_heads, "training": False})()
    torch.manual_seed(0)
    for start, n in [(1, 2), (7, 5), (30, 17)]:
        q = torch.randn(1, heads, n, 64, dtype=dtype)
        k, v = (
            torch.randn(1, kv_heads, start + n, 64, dtype=dtype),
            torch.randn(1, kv_heads, start + n, 64, dtype=dtype),
        )
        rows, columns = torch.arange(n), torch.arange(start + n)
        mask = (columns[None, :] <= start + rows[:, None]).view(1, 1, n, start + n)
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
        got = folded(q, k, v, mask, heads // kv_heads, 0.125)
        assert got.shape == want.shape == (1, n, heads, 64)
        assert torch.allclose(got.float(), want.float(), atol=1e-5 if dtype == torch.float32 else 2e-2)
