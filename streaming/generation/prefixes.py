"""The KV of prompt beginnings that many requests share, computed once, and of answers that ended.

A chat template's system prompt begins every conversation (24 tokens of the bundled model's 67-
to 76-token chat prompts of prompts.json): the batched engine computes its keys and values once,
when two or more prompts starting together share it, and copies them into the slot of every
prompt that begins with it (kv.SlotKV.put), so a burst's prefill skips them. At most PREFIXES are
kept, the latest used last; a beginning shorter than PREFIX_MIN is not worth keeping.

A row that leaves the batch leaves its keys and values here too (`retain`: its prompt and the
answer fed so far), up to `retain_memory` bytes in all, the least recently used dropped first:
a conversation's next turn resends the whole of it, and copies the beginning it shares with the
last turn instead of computing it (vLLM's automatic prefix cache keeps finished requests' blocks
for the same reason). A retained text is matched token by token (its longest beginning shared
with the prompt), a learned prefix only whole.

A longer beginning shared with a prompt in the batch is copied from that row's slot (sharing.py).

Tenants apart: a request's `cache_salt` (vLLM's extension) is part of every key here, so a
salted prompt copies only what requests of the same salt computed, and one without a salt only
what others without one did. Without it a sooner first text tells a client that someone sent the
same beginning (a system prompt, or a whole earlier conversation, retained).

Leaves out: a radix tree of every prompt's blocks (SGLang's RadixAttention): each retained text
is a copy of its own, so two that share a beginning hold it twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import torch

from streaming.generation.kv import SlotKV

PREFIX_MIN = 16  # shared prompt tokens worth keeping a KV copy of (the bundled chat template's share 24)
PREFIXES = 8  # shared prefixes kept: a server sees few system prompts
RETAIN_MEMORY = 256 * 2**20  # bytes of ended rows' keys and values kept (the bundled model in float32: ~10,900 tokens)
RETAIN_TEXTS = 64  # and texts: a joining prompt is compared with each of them at every step until it starts
# tokens a step's leaving rows may leave in all (the rest leave nothing): on the AVX2 kind, the bundled
# model in float32, copying 270 tokens took 0.76 ms (4.5 with fresh pages), 1,024 tokens 1.7 (8.9); a
# burst of 48 ending together would stall every stream for texts the budget would mostly drop at once
RETAIN_STEP = 1024

T = TypeVar("T")
Layers = list[tuple[torch.Tensor, torch.Tensor]]  # each layer's (keys, values), (1, heads, n, dim)
Key = tuple[str | None, tuple[int, ...]]  # (cache_salt, the token ids whose keys and values they are)


class Prefixes:
    def __init__(
        self, device: str, keep: int = PREFIXES, shortest: int = PREFIX_MIN, retain_memory: int = RETAIN_MEMORY
    ) -> None:
        self.device, self.keep, self.shortest, self.retain_memory = device, keep, shortest, retain_memory
        self.known: dict[Key, Layers] = {}
        self.retained: dict[Key, Layers] = {}  # ended rows' texts, the latest used last
        self.retained_bytes = 0
        self.hits = 0  # prompts started after a kept prefix (metrics, tests)
        self.retained_hits = 0  # ... after a retained text's beginning
        self.retained_tokens = 0  # prompt tokens copied from retained texts

    def learn(
        self,
        m: Any,
        prompts: list[list[int]],
        forward_kwargs: Callable[[Any, Any], dict[str, Any]],
        salt: str | None,
    ) -> None:
        """Prompts of one salt that start together: their common beginning (each keeps a token of
        its own, for its logits), computed and kept if it is long enough and longer than a kept one."""
        if len(prompts) < 2:
            return
        common = common_prefix(prompts)[: min(len(p) for p in prompts) - 1]
        if len(common) < self.shortest or self.length([*common, -1], salt) >= len(common):  # kept or retained whole
            return
        from transformers import DynamicCache

        cache = DynamicCache(config=m.config)
        m(input_ids=torch.tensor([common], device=self.device), use_cache=True, **forward_kwargs(m, cache))
        self.known[salt, tuple(common)] = [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]
        while len(self.known) > self.keep:
            del self.known[next(iter(self.known))]

    def lookup(self, prompt: list[int], salt: str | None) -> tuple[int, Layers] | None:
        """The longest kept or retained beginning of `prompt` (shorter than it) of its salt: (its
        length, the layers whose first that many keys and values it is)."""
        store, key, n = self.beginning(prompt, salt)
        if store is None or key is None:
            return None
        store[key] = store.pop(key)  # the latest used goes last
        if store is self.retained:
            self.retained_hits += 1
            self.retained_tokens += n
        else:
            self.hits += 1
        return n, store[key]

    def length(self, prompt: list[int], salt: str | None) -> int:
        """How much of `prompt` lookup would copy (what a prompt not started need not compute)."""
        return self.beginning(prompt, salt)[2]

    def beginning(self, prompt: list[int], salt: str | None) -> tuple[dict[Key, Layers] | None, Key | None, int]:
        """What lookup copies for `prompt` of this salt: the store (kept or retained), the key in
        it and how many tokens; a retained text where it shares more than a kept prefix is long.
        (None, None, 0): nothing."""
        best = self.best(prompt, len(prompt) - 1, salt)
        text, shared = self.retained_beginning(prompt, salt)
        if text is not None and shared > (len(best[1]) if best is not None else 0):
            return self.retained, text, shared
        return (None, None, 0) if best is None else (self.known, best, len(best[1]))

    def retained_beginning(self, prompt: list[int], salt: str | None) -> tuple[Key | None, int]:
        """The retained text of this salt sharing the longest beginning with `prompt` (at most all
        of it but its last token, at least `shortest` tokens), and how long that is."""
        texts = ((k, k[1]) for k in self.retained if k[0] == salt)
        return shared_beginning(tuple(prompt), texts, self.shortest)

    def retain(self, text: list[int], kv: SlotKV, slot: int, salt: str | None) -> None:
        """Keep a leaving row's keys and values: the first len(text) of its slot, whose tokens
        `text` are. Within retain_memory and RETAIN_TEXTS, the least recently used dropped first;
        a retained text that `text` begins is only marked used, one that begins `text` is
        replaced (of the same salt); a text shorter than `shortest`, or larger than the whole
        budget, is not kept."""
        n, ids = len(text), tuple(text)
        size = n * kv.token_bytes()
        if n < self.shortest or not kv.keys or size > self.retain_memory:
            return
        longer = next((k for k in self.retained if k[0] == salt and len(k[1]) >= n and k[1][:n] == ids), None)
        if longer is not None:
            self.retained[longer] = self.retained.pop(longer)
            return
        for old in [k for k in self.retained if k[0] == salt and ids[: len(k[1])] == k[1]]:
            self.drop(old)
        while self.retained and (self.retained_bytes + size > self.retain_memory or len(self.retained) >= RETAIN_TEXTS):
            self.drop(next(iter(self.retained)))
        try:
            layers = kv.taken(slot, n)
        except RuntimeError:  # out of memory (torch.OutOfMemoryError is one): a cache keeps what it can
            return
        self.retained[salt, ids] = layers
        self.retained_bytes += sum(k.nbytes + v.nbytes for k, v in layers)

    def drop(self, key: Key) -> None:
        layers = self.retained.pop(key)
        self.retained_bytes -= sum(k.nbytes + v.nbytes for k, v in layers)

    def best(self, prompt: list[int], longest: int, salt: str | None) -> Key | None:
        """The longest kept beginning of `prompt` of this salt, of at most `longest` tokens."""
        fits = (k for k in self.known if k[0] == salt and len(k[1]) <= longest and prompt[: len(k[1])] == list(k[1]))
        return max(fits, key=lambda k: len(k[1]), default=None)


def shared_beginning(
    ids: Sequence[int], others: Iterable[tuple[T, Sequence[int]]], at_least: int
) -> tuple[T | None, int]:
    """The other prompt that shares the longest beginning with `ids`, and how long it is: at most
    all of `ids` but its last token (which the prompt computes for its own logits), and at least
    `at_least` tokens, else (None, 0). (`ids` and the others of one kind: a list slice never
    equals a tuple's.) Slices compared in C, the length found by halving: a burst
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


def common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in prompts):
        n += 1
    return first[:n]
