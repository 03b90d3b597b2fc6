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

# The likeliest tokens looked at for a nucleus before a full sort (see choose_batch). The last
# tier is for flat distributions (temperature 1 after a long context: 4 of 60 positions measured
# had a 0.9-nucleus past 1,024 tokens, 1 past 8,192): a top-8,192 of 8 rows took 7 ms here where
# sorting their whole vocabulary took 44.
TOP_K = (64, 1024, 8192)
# Rows sampled together: 8 rows of float32 probabilities over Qwen's vocabulary are 4.9 MB, which
# stay in the cache; all 64 at once (39 MB, allocated afresh) took 71 ms against 16 in blocks of 8
# here (top_p 1), 125 against 78 (top_p 0.9, random logits).
SAMPLE_ROWS = 8
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
    `draws` gives this token's uniform draw (a Draws). The batch's own routine on one row, so a
    row alone and the same row in a batch get the same token."""
    logits = logits.detach().to(torch.float32).flatten()
    if repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)), device=logits.device)
        x = logits[seen]
        logits = logits.clone()
        logits[seen] = torch.where(x > 0, x / repetition_penalty, x * repetition_penalty)
    if temperature != 0 and not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    return choose_batch(logits.unsqueeze(0), [draws], [temperature], [p])[0]


def pick_any(probs: torch.Tensor, us: Sequence[float]) -> list[int]:
    """Inverse-CDF sampling over rows of probabilities in any order (some may be zero), row i
    with draw us[i]: the index whose cumulative share first passes the draw, never one of
    probability zero."""
    cdf = torch.cumsum(probs, dim=-1)
    x = torch.tensor(us, device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    out = torch.searchsorted(cdf, x, right=True).flatten().tolist()
    for i, index in enumerate(out):
        if index >= probs.shape[-1]:  # u * total rounded up to the total itself: the last likely token
            out[i] = int(torch.nonzero(probs[i])[-1])
    return out


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
    """choose() for a batch: row i of `logits` (B, V) with its own draws, temperature and top_p;
    returns a list of B token ids. Greedy rows take their argmax; the others' softmax and top-k
    run once for all of them, and each row's draw is an inverse-CDF draw over its nucleus. (No
    repetition penalty: no request sets one.)

    The nucleus (the smallest set of likeliest tokens whose probability reaches top_p) is nearly
    always among a few dozen tokens: a top-k of TOP_K[0] is found for every row (2.4x cheaper than
    one of 1,024 at 64 rows here), the rows whose top-k falls short of top_p look again with
    TOP_K[1] and then TOP_K[2], and those still short sort the whole vocabulary (a flat
    distribution), all in one call. A row whose top_p is 1 (the OpenAI and Anthropic formats' default) keeps the whole
    vocabulary, so it needs no order at all: its draw is taken over the probabilities as they lie
    (a sort of 151,936 of them cost 5-10 ms a row here: 119 against 5 ms for 16 such rows).
    Rows go SAMPLE_ROWS at a time."""
    if len(draws) > SAMPLE_ROWS:  # in blocks; each row's tokens are its own either way
        return [
            token
            for i in range(0, len(draws), SAMPLE_ROWS)
            for token in choose_batch(
                logits[i : i + SAMPLE_ROWS],
                draws[i : i + SAMPLE_ROWS],
                temperatures[i : i + SAMPLE_ROWS],
                top_ps[i : i + SAMPLE_ROWS],
            )
        ]
    logits = logits.detach()
    out = [0] * len(draws)
    us = [d() for d in draws]  # every token takes its draw, greedy ones too
    greedy = [i for i, t in enumerate(temperatures) if t == 0]
    if greedy:
        best = torch.argmax(logits[greedy], dim=-1).tolist()
        for i, token in zip(greedy, best, strict=True):
            out[i] = token
    sampled = [i for i, t in enumerate(temperatures) if t != 0]
    if not sampled:
        return out
    rows = logits if len(sampled) == len(draws) else logits[sampled]
    temps = torch.tensor([temperatures[i] for i in sampled], device=logits.device).unsqueeze(1)
    probs = torch.softmax(rows.to(torch.float32) / temps, dim=-1)
    whole = [r for r, i in enumerate(sampled) if top_ps[i] >= 1]
    if whole:  # the nucleus is every token: no order needed
        picked = pick_any(probs if len(whole) == len(sampled) else probs[whole], [us[sampled[r]] for r in whole])
        for r, token in zip(whole, picked, strict=True):
            out[sampled[r]] = token
    nucleus = {r: top_ps[i] for r, i in enumerate(sampled) if top_ps[i] < 1}
    for r, (sorted_probs, order) in descending_heads(probs, nucleus).items():
        i = sampled[r]
        # Keep the smallest set of most likely tokens whose probability reaches p: a token stays
        # if the tokens before it (more likely) add up to less than p. The first token always stays.
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        kept = sorted_probs.masked_fill(before >= top_ps[i], 0.0)
        out[i] = int(order[pick(kept, us[i])])
    return out


def descending_heads(probs: torch.Tensor, ps: dict[int, float]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """For each row r of `probs` in `ps` (r: its top_p), its likeliest probabilities in descending
    order and their tokens, enough of them to hold its nucleus: the top TOP_K[0], else the next
    tier's, else the whole vocabulary sorted (the rows still short, in one call)."""
    vocab = probs.shape[-1]
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    todo = list(ps)
    for k in TOP_K:
        if not todo:
            break
        k = min(k, vocab)
        top_probs, top_order = torch.topk(probs if len(todo) == len(probs) else probs[todo], k)
        sums = top_probs.sum(-1).tolist()
        left = []
        for j, r in enumerate(todo):
            if sums[j] >= ps[r] or k == vocab:
                found[r] = (top_probs[j], top_order[j])
            else:
                left.append(r)
        todo = left
    if todo:  # flat distributions
        values, orders = torch.sort(probs[todo], dim=-1, descending=True)
        found |= {r: (values[j], orders[j]) for j, r in enumerate(todo)}
    return found
