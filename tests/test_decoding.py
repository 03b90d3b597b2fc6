"""choose(): top-p keeps the smallest set reaching p, greedy at temperature 0, seeds repeat."""

import torch

from decoding import choose


def logits_for(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def sample_set(logits, p, n=400, **kw):
    g = torch.Generator().manual_seed(1)
    return {choose(logits, [], g, p=p, **kw) for _ in range(n)}


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    logits = logits_for([0.5, 0.3, 0.15, 0.05])
    assert sample_set(logits, p=0.5) == {0}  # 0.5 alone reaches 0.5
    assert sample_set(logits, p=0.6) == {0, 1}  # 0.5 < 0.6, 0.8 >= 0.6
    assert sample_set(logits, p=0.8) == {0, 1}
    assert sample_set(logits, p=0.81) == {0, 1, 2}
    assert sample_set(logits, p=1.0) == {0, 1, 2, 3}


def test_top_p_with_a_flat_distribution_over_a_large_vocabulary_falls_back_to_a_full_sort():
    logits = torch.zeros(5000)  # the top 1,024 hold only 20% of the mass: choose must sort all
    seen = sample_set(logits, p=0.9, n=2000)
    assert max(seen) > 1024 and len(seen) > 1500


def test_greedy_at_temperature_zero():
    logits = logits_for([0.2, 0.5, 0.3])
    g = torch.Generator().manual_seed(0)
    assert all(choose(logits, [], g, temperature=0) == 1 for _ in range(20))


def test_same_seed_same_tokens_and_different_seeds_differ():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return [choose(logits, [], g, p=0.95) for _ in range(50)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_temperature_sharpens():
    logits = logits_for([0.4, 0.35, 0.25])
    assert sample_set(logits, p=1.0, temperature=0.01) == {0}


def test_repetition_penalty_pushes_away_from_history():
    logits = torch.tensor([2.0, 1.9, -1.0])
    g = torch.Generator().manual_seed(0)
    assert choose(logits, [0], g, temperature=0) == 0
    assert choose(logits, [0], g, temperature=0, repetition_penalty=1.2) == 1  # 2.0/1.2 < 1.9
    # A negative logit is multiplied, so it moves further down, not up.
    assert choose(torch.tensor([-1.0, -1.1]), [0], g, temperature=0, repetition_penalty=1.5) == 1
