"""Speculative decoding by prompt lookup: a few guessed tokens ride in a small decode step, and
the row keeps those its own sampling would have chosen anyway. Pure: ids in, ids out.

A lone reader's step is bound by reading the weights, not by the tokens it computes: on the AVX2
kind a pass of 5 tokens cost 1.2-1.3x a pass of 1 (fp16 weights: 67 against 55 ms alone, 80.2
against 62.5 in the engine; w8a8: 61 against 47), 7 tokens 1.7x (fbgemm's fp16 product reads
every weight again for each 6 rows, costs.py). So a row that is alone, or nearly, can check
guesses at next to no cost. The guesses come from the
row's own text (Saxena's prompt lookup decoding, vLLM's `ngram` speculator): the last few tokens
looked up where they occurred before, and what followed them there proposed (`Lookup`). Readers
of an answer that quotes its prompt, or repeats itself, gain the most: on the bench's chat
prompts (the bundled model, temperature 0.7, 200 tokens each) 1.4-1.9 tokens a step were kept,
and a lone reader got 1.29-1.34x the tokens a second (README, "Guessed tokens"). How many guesses
a row carries is what pays by the engine's own counts and costs (`Odds`).

Exact: the row's token i is sampled from its logits at i with its draw i (sampling.Draws), as
without speculation. The pass computes the logits at every guessed position; token i is sampled
there, and position i+1's logits count only if token i equals the guess fed at i+1 (`kept`), since
only then were they computed from the context the row really has. The first token that differs
is the row's own token, so every step keeps at least one: the answer is the one the row would
have had, token for token, where the arithmetic is exact (the tests: the `exact` and `echo`
models; a real model's last bits depend on the pass's shape, as in a batch). The keys and
values of the guesses not kept are left in the slot past the row's length, where nothing reads
them (a later step writes over them).

Leaves out: a draft model (the bundled model is its family's smallest), trees of guesses, and
guessing in steps that prompts join (their pass is compute-bound already).
"""

from __future__ import annotations

from collections.abc import Sequence

SPECULATE = 4  # guessed tokens a decode step may carry in all, and rows + guesses at most 5 (Odds.shares)
# --speculate's most: each guess costs a token of the pass, and past a dozen tokens a CPU's pass is
# bound by arithmetic (the AVX2 kind: 9 tokens cost 1.9x 1), so more guesses only slow the reader
MAX_SPECULATE = 16
LONGEST_MATCH = 3  # the longest tail of the text looked up (the offline runs: 3 kept 1.9 a step, 4 no more)
# How often the j-th guess and all before it were kept, by the length of the match they followed
# (1, 2, 3 ids): the offline runs (fp16 weights, the chat prompts whose answers do not repeat);
# the engine's own counts take over from these (`Odds`). After one id alone, a second guess is
# rarely worth its place.
PRIOR = ((), (0.26, 0.13, 0.07, 0.06), (0.52, 0.30, 0.24, 0.22), (0.84, 0.75, 0.68, 0.62))  # by match: 0..LONGEST_MATCH
# A row's prompt is looked up in its last this many ids only: the index is built at the row's first
# small step, inside that step (a 32k-token prompt's whole index: ~100k entries, tens of ms)
LOOKUP_WINDOW = 4096
PRIOR_WEIGHT = 20  # the prior counts as this many observations of each
GUESS_COST = 0.09  # a guess's share of a one-token pass until passes are measured (fp16, AVX2: +9%; w8a8 +17%)
COST_WEIGHT = 0.1  # the latest pass's weight in its moving average (the machine drifts)
# A width's cost not measured again within this many passes is forgotten (estimated from the nearest
# width measured since): a width is measured only when chosen, so one slow pass (the machine busy,
# a first touch) kept it unchosen: bfloat16's first 5-token pass in a process cost 60.6 ms
# against 45.9 later, and a lone row carried 3 guesses where 4 paid over its first three answers
STALE_PASSES = 64


def prior(p: Sequence[float], j: int) -> float:
    """The prior's odds of the j-th guess: past its last, each a further guess falls as the last two did."""
    if j < len(p):
        return p[j]
    if len(p) < 2:
        return p[-1] if p else 0.0
    return p[-1] * (p[-1] / p[-2]) ** (j - len(p) + 1)


class Odds:
    """What guessing is worth on this engine: how often the j-th guess after a match of n ids was
    kept with all before it (counts over the prior), and what a pass of t tokens costs (moving
    averages of the engine's own passes, by the tokens in them). `shares`: how many of the guesses
    proposed for a step's rows give it the most tokens a second, none where none pays (w8a8 on the
    AVX2 kind: dear passes, rarer hits). A width's cost unmeasured for STALE_PASSES passes is
    forgotten, so a width one slow pass priced out is tried again."""

    def __init__(self) -> None:
        self.offered = [[float(PRIOR_WEIGHT)] * MAX_SPECULATE for _ in PRIOR]
        self.hits = [[PRIOR_WEIGHT * prior(p, j) for j in range(MAX_SPECULATE)] for p in PRIOR]
        self.seconds: dict[int, float] = {}  # tokens in a pass -> its cost lately
        self.measured: dict[int, int] = {}  # tokens in a pass -> the pass (counted in `passes`) that last measured it
        self.passes = 0

    def passed(self, tokens: int, seconds: float) -> None:
        self.passes += 1
        self.forget()
        was = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if was is None else was + COST_WEIGHT * (seconds - was)
        self.measured[tokens] = self.passes

    def forget(self) -> None:
        """Drop the widths not measured within STALE_PASSES passes (cost() estimates them again)."""
        for tokens in [t for t, at in self.measured.items() if self.passes - at > STALE_PASSES]:
            del self.seconds[tokens], self.measured[tokens]

    def guessed(self, match: int, guesses: int, kept_guesses: int) -> None:
        match = min(match, len(PRIOR) - 1)
        for j in range(guesses):
            self.offered[match][j] += 1
            self.hits[match][j] += j < kept_guesses

    def cost(self, tokens: int) -> float:
        """A pass of `tokens` tokens lately, or, unmeasured, from the nearest measured pass at
        GUESS_COST a token (relative figures: only ratios of costs are used)."""
        if tokens in self.seconds:
            return self.seconds[tokens]
        if not self.seconds:
            return 1 + GUESS_COST * (tokens - 1)
        near = min(self.seconds, key=lambda t: (abs(t - tokens), t))
        return self.seconds[near] * (1 + GUESS_COST * (tokens - 1)) / (1 + GUESS_COST * (near - 1))

    def odds(self, match: int, j: int) -> float:
        """How likely the j-th guess (from 0) after a match of `match` ids is kept with all before it."""
        match = min(match, len(PRIOR) - 1)
        return self.hits[match][j] / self.offered[match][j]

    def shares(self, proposals: Sequence[tuple[int, int]], most: int = SPECULATE) -> list[int]:
        """How many guesses each row of a step carries, given each row's (match length, guesses it
        can propose): the guesses likeliest to be kept first (a row's in order), as many as give
        the step the most tokens kept a second by the measured costs of passes, at most `most`
        guesses and most + 1 tokens in all (the cheap width; none in a step of more rows)."""
        rows = len(proposals)
        counts, order = [0] * rows, []
        for _ in range(max(0, min(most, most + 1 - rows))):
            open_ = [i for i, (_, k) in enumerate(proposals) if counts[i] < min(k, MAX_SPECULATE)]
            p, i = max(
                ((self.odds(proposals[i][0], counts[i]), i) for i in open_),
                key=lambda x: (x[0], -x[1]),
                default=(0.0, -1),
            )  # ties: the first row
            if p <= 0:
                break
            counts[i] += 1
            order.append((i, p))
        best, rate, tokens = 0, rows / self.cost(rows), float(rows)
        for g, (_, p) in enumerate(order, 1):
            tokens += p
            if tokens / self.cost(rows + g) > rate:
                best, rate = g, tokens / self.cost(rows + g)
        out = [0] * rows
        for i, _ in order[:best]:
            out[i] += 1
        return out


def kept(guesses: Sequence[int], sampled: Sequence[int]) -> int:
    """How many tokens a row keeps from a pass that fed it `guesses` after its next token:
    `sampled[j]` is its token sampled at the j-th position (len(guesses) + 1 of them); it keeps
    them up to and including the first that differs from the guess fed after it."""
    n = 0
    while n < len(guesses) and sampled[n] == guesses[n]:
        n += 1
    return n + 1


class Lookup:
    """A row's text as ids, and where each of its short runs of ids last occurred with something
    after it: `propose(k)` looks up the text's last LONGEST_MATCH ids (then fewer) and proposes
    the k ids that followed them. Indexed as it is asked (a row that never speculates costs an
    append a token)."""

    def __init__(self, ids: Sequence[int], longest: int = LONGEST_MATCH) -> None:
        self.ids = list(ids)
        self.longest = longest
        self.after: list[dict[tuple[int, ...], int]] = [{} for _ in range(longest + 1)]  # by run length
        self.indexed = max(0, len(self.ids) - LOOKUP_WINDOW)  # ids[:indexed]: in the index, or left out

    def extend(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)

    def propose(self, k: int) -> tuple[int, list[int]]:
        """Up to k ids that followed the latest earlier occurrence of the text's tail (the
        longest tail that occurred before), with that tail's length; (0, []) if no tail did."""
        if k <= 0:
            return 0, []
        ids = self.ids
        for p in range(max(1, self.indexed), len(ids)):  # ids[p] followed the runs that end before it
            for n in range(1, min(self.longest, p) + 1):
                self.after[n][tuple(ids[p - n : p])] = p
        self.indexed = len(ids)
        for n in range(min(self.longest, len(ids)), 0, -1):
            start = self.after[n].get(tuple(ids[-n:]))
            if start is not None:
                return n, ids[start : start + k]
        return 0, []
