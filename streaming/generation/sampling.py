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

# The likeliest tokens looked at for a nucleus in order (see choose_batch); a nucleus past the last
# tier is broad (temperature 1 after a long context: 4 of 60 positions measured had a 0.9-nucleus
# past 1,024 tokens, 1 past 8,192) and is found by buckets, not order (broad_pick).
TOP_K = (64, 1024)
# top(): the vocabulary cut into pieces of this many tokens for each tier, whose maxima say where
# the top-k lie (a top-64 of 8 rows of Qwen's vocabulary took 0.45 ms so against 1.11 for
# torch.topk here, a top-1,024 1.71 against 2.86).
CHUNK = {64: 128, 1024: 8}
# broad_pick: a float32 probability's top 16 bits (its exponent and 7 bits of mantissa) name its
# bucket; buckets are in the order of the probabilities they hold, each within 1% of itself.
BUCKET_SHIFT = 16
BUCKETS = 1 << 15  # the bucket numbers of non-negative float32 values (the sign bit is 0)
# broad_nucleus sums probabilities in float64 (a nucleus's edge is decided to the last bit of p),
# but MPS has no float64: there in float32
SUM_DTYPE = {"mps": torch.float32}
# Rows sampled together: 8 rows of float32 probabilities over Qwen's vocabulary are 4.9 MB, which
# stay in the cache; all 64 at once (39 MB, allocated afresh) took 71 ms against 16 in blocks of 8
# here (top_p 1), 125 against 78 (top_p 0.9, random logits).
SAMPLE_ROWS = 8
# pick_any: a row's probabilities summed in pieces of this many tokens first, then only the piece
# the draw lands in token by token (Qwen's 151,936 is 1,187 pieces of 128)
PICK_PIECE = 128
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
    probability zero. Found in two steps where the row divides into PICK_PIECE-token pieces: the
    pieces' sums say which piece the draw lands in, and only that piece is summed token by token:
    choose_batch at top_p 1 on the bundled model's logits (300-token context, medians of 15, in
    turn) took 0.92 against 1.34 ms for 8 rows, 6.26 against 8.18 for 48, the same tokens. Each
    row's token depends on its own probabilities and draw alone; it is the one running sum's token
    but where the two sums round differently at an edge (the same law: a seeded text may differ
    from an earlier version's, rarely)."""
    n, vocab = probs.shape
    if vocab % PICK_PIECE or vocab <= PICK_PIECE:
        return pick_flat(probs, us)
    pieces = probs.reshape(n, vocab // PICK_PIECE, PICK_PIECE)
    cdf = torch.cumsum(pieces.sum(-1), dim=-1)
    x = torch.tensor(us, device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    piece = torch.searchsorted(cdf, x, right=True).clamp_(max=cdf.shape[1] - 1)
    before = torch.nn.functional.pad(cdf, (1, 0)).gather(1, piece)  # the mass of the pieces before it
    inside = pieces[torch.arange(n, device=probs.device), piece.flatten()]  # (n, PICK_PIECE)
    index = torch.searchsorted(torch.cumsum(inside, dim=-1) + before, x, right=True)
    # (rare) rounding took the draw past its piece's last likely token: that row the plain way
    past = (index >= PICK_PIECE) | ~(inside.gather(1, index.clamp(max=PICK_PIECE - 1)) > 0)
    out = (piece * PICK_PIECE + index).flatten().tolist()
    for i in torch.nonzero(past.flatten()).flatten().tolist():
        out[i] = pick_flat(probs[i : i + 1], [us[i]])[0]
    return out


def pick_flat(probs: torch.Tensor, us: Sequence[float]) -> list[int]:
    """pick_any over each whole row at once: one running sum along it."""
    cdf = torch.cumsum(probs, dim=-1)
    x = torch.tensor(us, device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    out = torch.searchsorted(cdf, x, right=True).flatten().tolist()
    for i, index in enumerate(out):
        if index >= probs.shape[-1]:  # u * total rounded up to the total itself: the last likely token
            out[i] = int(torch.nonzero(probs[i])[-1])
    return out


def pick_heads(sorted_probs: torch.Tensor, ps: Sequence[float], us: Sequence[float]) -> torch.Tensor:
    """Rows of probabilities in descending order (each row's likeliest, enough to hold its
    nucleus), row i with top_p ps[i] and draw us[i]: each row's index into its own head (a column
    of indices, ready to gather the tokens with). A token
    stays in the nucleus if the tokens before it (more likely) add up to less than p (the first
    always stays); the draw is an inverse-CDF draw over those, the index whose cumulative share
    first passes u. All rows in a few calls: one row at a time cost about 0.2 ms a row here."""
    p = torch.tensor(ps, device=sorted_probs.device, dtype=sorted_probs.dtype).unsqueeze(1)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    kept = sorted_probs.masked_fill(before >= p, 0.0)
    cdf = torch.cumsum(kept, dim=-1)
    x = torch.tensor(us, device=cdf.device, dtype=cdf.dtype).unsqueeze(1) * cdf[:, -1:]
    index = torch.searchsorted(cdf, x, right=True)
    return torch.minimum(index, (kept > 0).sum(-1, keepdim=True) - 1)


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
    TOP_K[1], and those still short (a flat distribution) draw from buckets instead of an order
    (broad_pick). A row whose top_p is 1 (the OpenAI and Anthropic formats' default) keeps the whole
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
    if greedy:  # max's index, not argmax: the same first index of the largest (ties, NaN), 4x sooner
        best = torch.max(logits[greedy], dim=-1).indices.tolist()
        for i, token in zip(greedy, best, strict=True):
            out[i] = token
    sampled = [i for i, t in enumerate(temperatures) if t != 0]
    if not sampled:
        return out
    rows = logits if len(sampled) == len(draws) else logits[sampled]
    temps = torch.tensor([temperatures[i] for i in sampled], device=logits.device).unsqueeze(1)
    # divided in place, in a copy (float32 logits too: never the caller's): the same arithmetic, one
    # 4.9 MB buffer fewer for 8 rows (64 bfloat16 rows' softmax: 5.8 -> 5.1 ms here)
    probs = torch.softmax(rows.to(torch.float32, copy=True).div_(temps), dim=-1)
    whole = [r for r, i in enumerate(sampled) if top_ps[i] >= 1]
    if whole:  # the nucleus is every token: no order needed
        picked = pick_any(probs if len(whole) == len(sampled) else probs[whole], [us[sampled[r]] for r in whole])
        for r, token in zip(whole, picked, strict=True):
            out[sampled[r]] = token
    nucleus = {r: top_ps[i] for r, i in enumerate(sampled) if top_ps[i] < 1}
    heads, broad = descending_heads(probs, nucleus)
    for rs, sorted_probs, order in heads:  # each tier's rows at once
        index = pick_heads(sorted_probs, [nucleus[r] for r in rs], [us[sampled[r]] for r in rs])
        for r, token in zip(rs, order.gather(1, index).flatten().tolist(), strict=True):
            out[sampled[r]] = token
    if broad:  # past every tier
        picked = broad_pick(probs[broad], [nucleus[r] for r in broad], [us[sampled[r]] for r in broad])
        for r, token in zip(broad, picked, strict=True):
            out[sampled[r]] = token
    return out


def descending_heads(
    probs: torch.Tensor, ps: dict[int, float]
) -> tuple[list[tuple[list[int], torch.Tensor, torch.Tensor]], list[int]]:
    """For the rows r of `probs` in `ps` (r: its top_p), tier by tier: (the rows, their likeliest
    probabilities in descending order, their tokens), enough of them to hold each row's nucleus:
    the top TOP_K[0], else the next tier's; and the rows whose nucleus is past every tier, in
    order (broad_pick draws for them)."""
    vocab = probs.shape[-1]
    found: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    todo = list(ps)
    for k in TOP_K:
        if not todo:
            break
        k = min(k, vocab)
        top_probs, top_order = top(probs if len(todo) == len(probs) else probs[todo], k)
        sums = top_probs.sum(-1).tolist()
        held = [j for j, r in enumerate(todo) if sums[j] >= ps[r] or k == vocab]
        if len(held) == len(todo):
            found.append((todo, top_probs, top_order))
        elif held:
            found.append(([todo[j] for j in held], top_probs[held], top_order[held]))
        done = set(held)
        todo = [r for j, r in enumerate(todo) if j not in done]
    return found, todo


def top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) over rows (the same values, in descending order, and their indices; among
    equal values maybe others), found in the pieces of CHUNK[k] tokens with the k largest maxima:
    each of the top k lies in one of those (a piece holding one has its maximum at least that big,
    and k pieces with larger maxima would hold k larger values), so only k pieces are looked at."""
    n, vocab = x.shape
    chunk = CHUNK.get(k, 0)
    if not chunk or vocab % chunk or vocab // chunk <= k:
        return torch.topk(x, k)
    maxima = x.reshape(n, vocab // chunk, chunk).amax(-1)
    pieces = torch.topk(maxima, k).indices
    columns = (pieces.unsqueeze(-1) * chunk + torch.arange(chunk, device=x.device)).reshape(n, k * chunk)
    values, where = torch.topk(x.gather(1, columns), k)
    return values, columns.gather(1, where)


def broad_pick(probs: torch.Tensor, ps: Sequence[float], us: Sequence[float]) -> list[int]:
    """The draws us over the broad nuclei of rows of probabilities (row i: top_p ps[i]): an
    inverse-CDF draw over each nucleus in vocabulary order (broad_nucleus), a row at a time (its
    600 KB stay in the core's cache: 8 rows at once took 2.1 ms a row here against 0.9)."""
    return [pick_any(broad_nucleus(row, p).unsqueeze(0), [u])[0] for row, p, u in zip(probs, ps, us, strict=True)]


def broad_nucleus(probs: torch.Tensor, p: float) -> torch.Tensor:
    """One row's probabilities kept in its nucleus, the others zero, for a broad nucleus (past
    every TOP_K tier: a flat distribution), without sorting the vocabulary: sorting a row of
    Qwen's 151,936 cost 5-6 ms here, this about a tenth of it. The probabilities' buckets
    (BUCKET_SHIFT) are in their order, so one weighted count says which bucket the nucleus ends
    in: every bucket above it is in the nucleus whole, and only the boundary bucket's few tokens
    are sorted, to keep those of them that the smallest set reaching p holds (a token stays if the
    likelier ones add up to less than p, as in choose_batch; ties in the order of the vocabulary).
    broad_pick's draw over the nucleus in vocabulary order has the same distribution as over it
    sorted, a different token for the same u (each row's tokens depend on its own logits and draw
    alone, as before)."""
    wide = SUM_DTYPE.get(probs.device.type, torch.float64)
    bits = probs.view(torch.int32) >> BUCKET_SHIFT  # non-negative floats' bits are in their order
    mass = torch.bincount(bits, weights=probs.to(wide), minlength=BUCKETS)
    from_top = torch.cumsum(mass.flip(0), 0)
    k = min(int(torch.searchsorted(from_top, torch.tensor([p], dtype=wide, device=probs.device))), BUCKETS - 1)
    edge = BUCKETS - 1 - k  # the bucket the nucleus ends in
    above = float(from_top[k] - mass[edge])  # the mass of the buckets above it: less than p
    inside = torch.nonzero(bits == edge).flatten()
    values, order = torch.sort(probs[inside], descending=True, stable=True)
    before = above + torch.cumsum(values.to(wide), 0) - values.to(wide)
    kept = torch.where(bits > edge, probs, torch.zeros((), dtype=probs.dtype, device=probs.device))
    stays = inside[order[before < p]]
    kept[stays] = probs[stays]
    return kept
