"""choose(): top-p keeps the smallest set reaching p, greedy at temperature 0, seeds repeat, and
token i's draw depends only on the seed and i (a continuation samples as the original would)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding import Draws, choose, choose_batch, uniform


def logits_for(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def sample_set(logits, p, n=400, **kw):
    g = Draws(1)
    return {choose(logits, [], g, p=p, **kw) for _ in range(n)}


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert sample_set(logits, p=0.5) == {0}  # 0.5 alone reaches 0.5
    assert sample_set(logits, p=0.6) == {0, 1}  # 0.5 < 0.6, 0.8 >= 0.6
    assert sample_set(logits, p=0.8) == {0, 1}
    assert sample_set(logits, p=0.81) == {0, 1, 2}
    assert sample_set(logits, p=1.0) == {0, 1, 2, 3}


def test_top_p_with_a_flat_distribution_over_a_large_vocabulary_draws_past_every_top_k_tier():
    logits = torch.zeros(20000)  # the top 1,024 hold 5% of the mass: the nucleus is 18,000 tokens
    seen = sample_set(logits, p=0.9, n=2000)
    assert max(seen) > 8192 and len(seen) > 1500 and max(seen) < 18000


@pytest.mark.parametrize("spread", [0.3, 1.0, 3.0])
def test_a_broad_nucleus_found_by_buckets_is_the_one_a_full_sort_finds(spread):
    """broad_nucleus keeps exactly the smallest set of likeliest tokens reaching p, as sorting the
    whole row would (Qwen's vocabulary, flat and less flat rows, several p)."""
    from streaming.generation.sampling import broad_nucleus

    g = torch.Generator().manual_seed(int(spread * 10))
    for p in (0.5, 0.9, 0.99):
        probs = torch.softmax(torch.randn(151936, generator=g) * spread, -1)
        values, order = torch.sort(probs, descending=True)
        before = torch.cumsum(values.double(), 0) - values.double()
        expected = set(order[before < p].tolist())
        kept = broad_nucleus(probs, p)
        assert set(torch.nonzero(kept).flatten().tolist()) == expected
        assert torch.equal(kept[list(expected)], probs[list(expected)])


def test_greedy_at_temperature_zero():
    logits = logits_for([0.2, 0.5, 0.3])
    g = Draws(0)
    assert all(choose(logits, [], g, temperature=0) == 1 for _ in range(20))


def test_same_seed_same_tokens_and_different_seeds_differ():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))

    def run(seed):
        g = Draws(seed)
        return [choose(logits, [], g, p=0.95) for _ in range(50)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_temperature_sharpens():
    logits = logits_for([0.4, 0.35, 0.25])
    assert sample_set(logits, p=1.0, temperature=0.01) == {0}


def test_repetition_penalty_pushes_away_from_history():
    logits = torch.tensor([2.0, 1.9, -1.0])
    g = Draws(0)
    assert choose(logits, [0], g, temperature=0) == 0
    assert choose(logits, [0], g, temperature=0, repetition_penalty=1.2) == 1  # 2.0/1.2 < 1.9
    # A negative logit is multiplied, so it moves further down, not up.
    assert choose(torch.tensor([-1.0, -1.1]), [0], g, temperature=0, repetition_penalty=1.5) == 1


def test_the_draw_for_token_i_depends_only_on_the_seed_and_i():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    whole = Draws(7)
    tokens = [choose(logits, [], whole, p=0.95) for _ in range(30)]
    later = Draws(7, i=12)  # a continuation after 12 tokens: no replay of the first 12 draws
    assert [choose(logits, [], later, p=0.95) for _ in range(18)] == tokens[12:]
    greedy = Draws(7)
    choose(logits, [], greedy, temperature=0)
    assert greedy.i == 1  # a greedy token takes its draw too: i stays the token's index


def test_uniform_draws_are_exact_floats_in_the_unit_interval_and_spread_evenly():
    draws = [uniform(seed, i) for seed in (0, 1, 2**63 - 1) for i in range(2000)]
    assert all(0 <= u < 1 and u == float(torch.tensor(u, dtype=torch.float32)) for u in draws)
    assert uniform(0, 0) != uniform(0, 1) != uniform(1, 0)
    counts = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert counts.min() > 0.9 * len(draws) / 10  # even within 10% per tenth (6,000 draws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batch_samples_each_row_as_choose_does_alone_whichever_way_its_nucleus_is_found(dtype):
    """choose_batch against choose, row by row: a peaked row (the top-k holds p), one whose
    nucleus is a few hundred tokens, one of a few thousand (past the top-k tiers), a flat one, and
    a greedy one; bfloat16 logits too."""
    g = torch.Generator().manual_seed(5)
    vocab = 20480  # (whole pieces of PICK_PIECE: top_p 1's draw piece by piece)
    peaked = torch.randn(vocab, generator=g) * 4
    wider = torch.randn(vocab, generator=g) * 0.3
    wider[:300] += 4.0  # ~300 likely tokens
    broad = torch.randn(vocab, generator=g) * 0.3
    broad[:3000] += 4.0  # ~3,000 likely tokens: past TOP_K[1], drawn from buckets
    flat = torch.zeros(vocab)
    rows = torch.stack([peaked, wider, flat, peaked, broad, flat] * 3).to(dtype)  # 18 rows: in blocks
    temperatures, top_ps = [0.7, 1.0, 1.0, 0.0, 1.0, 1.0] * 3, [0.9, 0.9, 0.9, 0.9, 0.9, 1.0] * 3  # top_p 1: no order
    n = len(rows)
    for seed in range(10):
        batch = choose_batch(rows, [Draws(seed + r) for r in range(n)], temperatures, top_ps)
        alone = [choose(rows[r], [], Draws(seed + r), p=top_ps[r], temperature=temperatures[r]) for r in range(n)]
        assert batch == alone


def test_top_p_one_draws_from_the_whole_distribution_without_sorting_it_and_never_an_impossible_token():
    """With top_p 1 (the OpenAI format's default) the draw is taken over the probabilities in
    vocabulary order: each token as often as its probability, and a token of probability zero
    (a logit of -inf) never, even for the largest draws."""
    probs = torch.tensor([0.1, 0.0, 0.6, 0.0, 0.3, 0.0])
    logits = torch.log(probs)
    g = Draws(11)
    counts = torch.bincount(torch.tensor([choose(logits, [], g, p=1.0) for _ in range(3000)]), minlength=6)
    assert counts[1] == counts[3] == counts[5] == 0
    assert torch.allclose(counts.float() / 3000, probs, atol=0.03)
    from streaming.generation.sampling import pick_any

    assert pick_any(probs.unsqueeze(0).repeat(2, 1), [1 - 2**-24, 0.0]) == [4, 0]


@pytest.mark.parametrize("k", [64, 1024])
def test_the_top_k_found_in_pieces_is_torchs(k):
    """sampling.top: the same values as torch.topk, in the same order, each at an index that
    holds it, on Qwen's vocabulary (peaked, flat, ties); another vocabulary size is torch.topk's."""
    from streaming.generation.sampling import top

    g = torch.Generator().manual_seed(k)
    rows = torch.softmax(torch.randn(6, 151936, generator=g) * torch.tensor([[0.3], [1], [3], [6], [0], [2]]), -1)
    rows[5, 1000:1100] = rows[5].max()  # ties at the top
    values, indices = top(rows, k)
    expected = torch.topk(rows, k)
    assert torch.equal(values, expected.values) and torch.equal(rows.gather(1, indices), values)
    assert all(len(set(r)) == k for r in indices.tolist())
    odd = rows[:, :20001]  # not a whole number of pieces
    assert torch.equal(top(odd, k)[1], torch.topk(odd, k).indices)


def test_choose_batch_leaves_the_callers_logits_as_they_were():
    """The temperature divides a copy: float32 logits (which need no conversion) are not touched."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    choose_batch(logits, [Draws(i) for i in range(3)], [0.7, 1.3, 0], [0.9, 1.0, 0.9])
    assert torch.equal(logits, before)


@settings(max_examples=60, deadline=None)
@given(
    pieces=st.integers(2, 12),
    zeros=st.floats(0.0, 0.95),
    seed=st.integers(0, 2**32 - 1),
    edge=st.sampled_from([0.0, 0.5, 1 - 2**-24]),
)
def test_the_draw_found_piece_by_piece_is_never_an_impossible_token_and_mostly_the_plain_ones(
    pieces, zeros, seed, edge
):
    """pick_any over a row that divides into pieces (sums of pieces first, then one piece token by
    token): whatever the zeros (whole pieces of them, the last ones too) and draws (0, the
    largest), a token of probability zero never comes; and it is the plain running sum's token but
    where the two sums round differently at an edge (the same law)."""
    from streaming.generation.sampling import PICK_PIECE, pick_any, pick_flat

    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(3, pieces * PICK_PIECE, generator=g)
    probs[torch.rand(probs.shape, generator=g) < zeros] = 0.0
    probs[1, -PICK_PIECE:] = 0.0  # a last piece with nothing in it
    probs[2, : PICK_PIECE * (pieces // 2)] = 0.0  # nothing in the first half
    probs[:2, 5] = probs[2, PICK_PIECE * (pieces // 2)] = 0.5  # every row has a likely token
    probs /= probs.sum(-1, keepdim=True)
    for us in ([edge] * 3, [uniform(seed, i) for i in range(3)]):
        picked = pick_any(probs, us)
        assert all(probs[r, t] > 0 for r, t in enumerate(picked))
        assert picked == [pick_any(probs[r : r + 1], [us[r]])[0] for r in range(3)]  # each row on its own
    draws = [uniform(seed, i) for i in range(200)]
    agree = sum(pick_any(probs[:1], [u]) == pick_flat(probs[:1], [u]) for u in draws)
    assert agree >= 190
