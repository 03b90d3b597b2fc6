"""The KV of prompt beginnings that many requests share, computed once.

A chat template's system prompt begins every conversation (24 tokens of the bundled model's 67-
to 76-token chat prompts of prompts.json): the batched engine computes its keys and values once,
when two or more prompts starting together share it, and copies them into the slot of every
prompt that begins with it (kv.SlotKV.put), so a burst's prefill skips them. At most PREFIXES are
kept, the latest used last; a beginning shorter than PREFIX_MIN is not worth keeping.

A longer beginning shared with a prompt in the batch is copied from that row's slot (sharing.py).

Leaves out: a radix tree of every prompt's blocks (SGLang's RadixAttention): only whole shared
beginnings of prompts that start together are learned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PREFIX_MIN = 16  # shared prompt tokens worth keeping a KV copy of (the bundled chat template's share 24)
PREFIXES = 8  # shared prefixes kept: a server sees few system prompts

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (keys, values), (1, heads, n, dim)


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
