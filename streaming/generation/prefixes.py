"""The KV of prompt beginnings that many requests share, computed once.

A chat template's system prompt begins every conversation (24 tokens of the bundled model's 67-
to 76-token chat prompts of prompts.json): the batched engine computes its keys and values once,
when two or more prompts starting together share it, and copies them into the slot of every
prompt that begins with it (kv.SlotKV.put), so a burst's prefill skips them. At most PREFIXES are
kept, the latest used last; a beginning shorter than PREFIX_MIN is not worth keeping.

And a prompt that shares a longer beginning with a prompt already in the batch (the same question
asked twice, or one conversation's earlier turns) copies that row's keys and values instead of
computing them (`shared_beginning`, batch.py): a burst of 48 chat prompts drawn from prompts.json's
20 had ~2,300 prompt tokens to compute, ~900 of them distinct, what vLLM's automatic prefix cache
and SGLang's RadixAttention skip.

Leaves out: a radix tree of every prompt's blocks (SGLang's RadixAttention): a beginning is shared
only with the prompts in the batch now (a row that has left takes its keys with it) and the kept
beginnings learned from prompts that start together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

PREFIX_MIN = 16  # shared prompt tokens worth keeping a KV copy of (the bundled chat template's share 24)
PREFIXES = 8  # shared prefixes kept: a server sees few system prompts

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (keys, values), (1, heads, n, dim)
T = TypeVar("T")


class Prefixes:
    def __init__(self, device: str, keep: int = PREFIXES, shortest: int = PREFIX_MIN) -> None:
        self.device, self.keep, self.shortest = device, keep, shortest
        self.known: dict[tuple[int, ...], Layers] = {}
        self.hits = 0  # prompts started after a kept prefix (metrics, tests)

    def learn(self, m: Any, prompts: list[list[int]], forward_kwargs: Callable[[Any, Any], dict[str, Any]]) -> None:
        """Prompts that start together: their common beginning (each keeps a token of its own,
        for its logits), computed and kept if it is long enough and longer than a kept one."""
        if len(prompts) < 2:
            return
        common = common_prefix(prompts)[: min(len(p) for p in prompts) - 1]
        best = self.best(common, len(common))
        if len(common) < self.shortest or (best is not None and len(best) >= len(common)):
            return
        from transformers import DynamicCache

        cache = DynamicCache(config=m.config)
        m(input_ids=torch.tensor([common], device=self.device), use_cache=True, **forward_kwargs(m, cache))
        self.known[tuple(common)] = [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]
        while len(self.known) > self.keep:
            del self.known[next(iter(self.known))]

    def lookup(self, prompt: list[int]) -> tuple[int, Layers] | None:
        """The longest kept beginning of `prompt` (shorter than it): (its length, its layers)."""
        best = self.best(prompt, len(prompt) - 1)
        if best is None:
            return None
        self.known[best] = self.known.pop(best)  # the latest used goes last
        self.hits += 1
        return len(best), self.known[best]

    def best(self, prompt: list[int], longest: int) -> tuple[int, ...] | None:
        """The longest kept beginning of `prompt` of at most `longest` tokens."""
        fits = (k for k in self.known if len(k) <= longest and prompt[: len(k)] == list(k))
        return max(fits, key=len, default=None)


def common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in prompts):
        n += 1
    return first[:n]


def shared_beginning(ids: list[int], others: Iterable[tuple[T, list[int]]], at_least: int) -> tuple[T | None, int]:
    """The other prompt that shares the longest beginning with `ids`, and how long it is: at most
    all of `ids` but its last token (which the prompt computes for its own logits), and at least
    `at_least` tokens, else (None, 0). Slices compared in C, the length found by halving: a burst
    of 48 prompts against 48 others costs about a millisecond."""
    best, most = None, max(1, at_least) - 1
    limit = len(ids) - 1
    for key, other in others:
        hi = min(limit, len(other))
        if hi <= most or other[: most + 1] != ids[: most + 1]:
            continue
        lo = most + 1  # shared so far; the longest shared is in lo..hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if other[:mid] == ids[:mid]:
                lo = mid
            else:
                hi = mid - 1
        best, most = key, lo
    return best, (most if best is not None else 0)
