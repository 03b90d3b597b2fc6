"""The batched engine's start-up warm-up (streaming/generation/warm.py): synthetic requests run to
their end through the real engine, leave it as they found it, and count nowhere a reader sees."""

import asyncio

import pytest
import torch
from helpers import model_of
from test_engine import PROMPTS, alone_with_threads, exact, ids, params, text

import lm
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.job import Stats
from streaming.generation.policy import MAX_PREFILL
from streaming.generation.prefixes import PREFIX_MIN
from streaming.generation.warm import WARM_ROWS, WARM_TOKENS, prompts, warm


def test_the_synthetic_prompts_fill_one_step_and_share_no_beginning():
    vocab = len(lm.load_tokenizer())
    ps = prompts(WARM_ROWS, MAX_PREFILL // WARM_ROWS, vocab)
    assert len(ps) == WARM_ROWS and sum(map(len, ps)) == MAX_PREFILL  # one step's whole prefill budget
    assert all(0 <= t < vocab for p in ps for t in p)
    assert len({tuple(p[:PREFIX_MIN]) for p in ps}) == WARM_ROWS  # nothing for the prefix cache to keep
    assert all(0 <= t < 50 for p in prompts(4, 8, 50) for t in p)  # a tiny vocabulary too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_warming_runs_every_row_to_its_end_and_leaves_the_engine_as_it_was(dtype):
    net = exact(dtype)
    stats = Stats()

    async def run():
        e = BatchEngine(max_batch=16, prefill_chunk=64, model=model_of(net))
        expected = await alone_with_threads(net)
        tokens = await warm(e, len(lm.load_tokenizer()))
        empty = (
            len(e.batch.rows),
            len(e.batch.kv),
            e.batch.kv.rows(),
            e.batch.prefixes.hits,
            len(e.batch.prefixes.known),
        )
        after = [await text(BatchedJob(e, ids(i), params(i), stats=stats).start()) for i in range(len(PROMPTS))]
        return tokens, empty, expected, after, e.steps

    tokens, empty, expected, after, steps = asyncio.run(run())
    assert tokens == 16 * WARM_TOKENS  # rows capped at --max-batch, each to max_tokens
    assert empty == (0, 0, 0, 0, 0)  # no row, no slot, no memory held, no prefix kept
    assert after == expected  # what follows is what it would have been without the warm-up
    assert steps >= WARM_TOKENS and not stats.active
