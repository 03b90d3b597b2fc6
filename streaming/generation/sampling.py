"""choose(): pick the next token from the last position's logits (decoding.py is its facade).

Nucleus (top-p) sampling with one uniform draw a token, a temperature (0 means greedy), and an
optional repetition penalty over the tokens generated so far (CTRL's rule: divide a positive
logit by the penalty, multiply a negative one). Same logits, same seed: same token.

The draw for a request's i-th token depends only on its seed and i (`uniform(seed, i)`, a
counter-based generator: splitmix64 of the pair), not on a generator's hidden state. So a stream
taken over by another process after i tokens (streaming/server/resume/takeover.py) samples token i as the
original would have from the same logits, without replaying the first i draws.

Leaves out: top-k, min-p and logit bias. `choose_batch` does the same for a batch of rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TOP_K_FIRST = 1024  # tokens sorted before falling back to a full sort (see choose)
MASK64 = (1 << 64) - 1


def uniform(seed: int, i: int) -> float:
    """The i-th draw of a request seeded `seed`, in [0, 1): splitmix64 (Steele, Lea and Flood
    2014) of seed and i, its top 24 bits, so the value is exact in float32 and float64 alike."""
    x = (seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return (x >> 40) / (1 << 24)


class Draws:
    """A request's draws from token `i` on: draws() is uniform(seed, i), then i advances. Every
    token takes its draw, greedy ones too, so i is always the token's index in the answer."""

    def __init__(self, seed: int, i: int = 0) -> None:
        self.seed, self.i = seed, i

    def __call__(self) -> float:
        u = uniform(self.seed, self.i)
        self.i += 1
        return u


def choose(
    logits: torch.Tensor,
    history: Sequence[int],
    draws: Draws,
    p: float = 0.9,
    temperature: float = 1.0,
    repetition_penalty: float = 1.0,
) -> int:
    """Return the next token id (an int) from a 1-D tensor of logits over the vocabulary;
    `draws` gives this token's uniform draw (a Draws)."""
    u = draws()
    logits = logits.detach().to(torch.float32).flatten()
    if repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), device=logits.device)
        x = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(x > 0, x / repetition_penalty, x * repetition_penalty)
    if temperature == 0:
        return int(torch.argmax(logits))
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    probs = torch.softmax(logits / temperature, dim=-1)
    # The nucleus is nearly always among the few hundred likeliest tokens: a top-k of them is
    # 30x cheaper than sorting all 151,936 (27 ms a token here); sort everything only when the
    # top-k's probability falls short of p.
    k = min(TOP_K_FIRST, probs.numel())
    sorted_probs, order = torch.topk(probs, k)
    if float(sorted_probs.sum()) < p and k < probs.numel():
        sorted_probs, order = torch.sort(probs, descending=True)
    # Keep the smallest set of most likely tokens whose probability reaches p: a token stays if
    # the tokens before it (more likely) add up to less than p. The first token always stays.
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = sorted_probs.masked_fill(before >= p, 0.0)
    return int(order[pick(kept, u)])


def pick(kept: torch.Tensor, u: float) -> int:
    """Inverse-CDF sampling with the uniform draw u: the index into `kept` (probabilities, zeros
    past the nucleus) whose cumulative share first passes u. The same u gives the same index
    whether or not the zeros are in the tensor."""
    cdf = torch.cumsum(kept, dim=-1)
    x = torch.tensor([u], device=cdf.device, dtype=cdf.dtype) * cdf[-1]
    return min(int(torch.searchsorted(cdf, x, right=True)), int((kept > 0).sum()) - 1)


def choose_batch(
    logits: torch.Tensor, draws: Sequence[Draws], temperatures: Sequence[float], top_ps: Sequence[float]
) -> list[int]:
    """choose() for a batch: row i of `logits` (B, V) with its own draws, temperature and
    top_p; returns a list of B token ids. The softmax and top-k run once for the batch; each row's
    draw is the same inverse-CDF draw as choose()'s, so a row alone gives choose()'s token. (No
    repetition penalty: no request sets one.)"""
    logits = logits.detach().to(torch.float32)
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device).unsqueeze(1)
    probs = torch.softmax(logits / temps, dim=-1)
    k = min(TOP_K_FIRST, probs.shape[-1])
    top_probs, top_order = torch.topk(probs, k)
    sums = top_probs.sum(-1).tolist()
    greedy = torch.argmax(logits, dim=-1).tolist()
    out: list[int] = []
    for i, (d, t, p) in enumerate(zip(draws, temperatures, top_ps, strict=True)):
        u = d()
        if t == 0:
            out.append(greedy[i])
            continue
        sorted_probs, order = top_probs[i], top_order[i]
        if sums[i] < p and k < probs.shape[-1]:
            sorted_probs, order = torch.sort(probs[i], descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        kept = sorted_probs.masked_fill(before >= p, 0.0)
        out.append(int(order[pick(kept, u)]))
    return out
