"""The batch's KV cache as the engine keeps it: one row per request, all rows left-padded to one
length, with the (B, L) attention mask that says which columns each row uses.

Plain tensor bookkeeping, no threads, so the tests can check it directly:

- `join(cache, mask)`: rows prefilled together (one or many) enter the batch; the shorter side is
  left-padded with zero keys and values that the mask hides;
- `keep(index)`: rows that ended leave (their memory goes with them), then the columns no
  remaining row uses are cut;
- `extend()` before a step of every row: one more column, used by all;
- `narrow(index)` / `widen(index)` around a step of some rows only (the QoE schedule): the chosen
  rows' keys and values are taken out as a smaller cache for the forward pass, and afterwards
  their new column is written into the batch's; a row that sat the step out gets a hidden
  (masked) column there. The holes cost memory, not correctness: attention never reads a masked
  column, and each row's positions are its own count of tokens (the engine passes them);
- `prefill(model, prompts)`: several prompts in one left-padded forward pass, as one cache,
  after the kept KV of a beginning they share (`Prefixes`).

Each layer's keys and values grow in place (growing.py's `GrowingLayer`): a step writes its column into
room kept at the end, where transformers' DynamicLayer concatenates, copying the whole cache at
every step. So a step of every row copies nothing, a narrowed step copies the rows it runs (their
gather; writing their column back is all of `widen`), and a join or leave copies the batch once.

Leaves out: paged memory (a join or leave copies the cache; a narrowed step gathers its rows).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

PREFIX_MIN = 16  # shared prompt tokens worth keeping a KV copy of (the bundled chat template's share 24)
PREFIXES = 8  # shared prefixes kept: a server sees few system prompts


class KVBatch:
    def __init__(self, device: str) -> None:
        self.device = device
        self.cache: Any = None  # a transformers DynamicCache with one row per request, or None
        self.mask: Any = None  # (B, L) long tensor: 1 where a row has a key, 0 for padding or a hole
        self.full: Any = None  # while narrowed: the whole batch's layers

    def __len__(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    def join(self, cache: Any, mask: Any) -> None:
        """Append the rows of `cache` (their mask (k, n)) to the batch."""
        if self.cache is None:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        merged = [
            (torch.cat([pad(k, width), pad(k2, width)]), torch.cat([pad(v, width), pad(v2, width)]))
            for (k, v), (k2, v2) in zip(layers(self.cache), layers(cache), strict=True)
        ]
        set_layers(self.cache, merged)
        self.mask = torch.cat([pad_mask(self.mask, width), pad_mask(mask.to(self.mask.dtype), width)])

    def keep(self, index: list[int]) -> None:
        """Keep these rows (in this order), drop the others and the leading columns none uses."""
        if not index:
            self.cache = self.mask = None
            return
        i = torch.tensor(index, device=self.device)
        mask = self.mask.index_select(0, i)
        start = int(mask.any(0).int().argmax())  # the first column some row uses
        self.mask = mask[:, start:]
        set_layers(
            self.cache,
            [(k.index_select(0, i)[:, :, start:], v.index_select(0, i)[:, :, start:]) for k, v in layers(self.cache)],
        )

    def extend(self) -> Any:
        """Before a step of every row: the mask gains a used column. Returns the mask to pass to
        the model, or None when no row has padding (the same arithmetic as a request alone)."""
        ones = torch.ones(len(self), 1, dtype=self.mask.dtype, device=self.device)
        self.mask = torch.cat([self.mask, ones], 1)
        return None if bool(self.mask.all()) else self.mask

    def narrow(self, index: list[int]) -> Any:
        """Before a step of these rows only: the cache holds just them (gathered) until widen().
        Returns their mask with the new column (always passed: rows narrowed out leave padding)."""
        from transformers import DynamicLayer

        i = torch.tensor(index, device=self.device)
        self.full = self.cache.layers
        small = []
        for layer in self.full:
            part = DynamicLayer()
            k, v = layer.keys.index_select(0, i), layer.values.index_select(0, i)
            part.lazy_initialization(k, v)
            part.keys, part.values = k, v
            small.append(part)
        self.cache.layers = small
        mask = self.mask.index_select(0, i)
        return torch.cat([mask, torch.ones(len(index), 1, dtype=mask.dtype, device=self.device)], 1)

    def widen(self, index: list[int]) -> None:
        """After the step of `index`'s rows: every row gets the new column, theirs used, the
        others' a hole; only the new column is written."""
        i = torch.tensor(index, device=self.device)
        from streaming.generation.growing import grown

        layers = [grown(big) for big in self.full]
        for big, small in zip(layers, self.cache.layers, strict=True):
            big.add_column(i, small.keys[:, :, -1:], small.values[:, :, -1:])
        self.cache.layers = layers
        column = torch.zeros(len(self), 1, dtype=self.mask.dtype, device=self.device)
        column[i] = 1
        self.mask = torch.cat([self.mask, column], 1)
        self.full = None

    def rows(self) -> int:
        """Rows in the cache's tensors (tests: memory released)."""
        return 0 if self.cache is None else int(self.cache.layers[0].keys.shape[0])


def new_cache(m: Any) -> Any:
    """A DynamicCache for the model whose plain layers grow in place (growing.py)."""
    from streaming.generation.growing import new_cache

    return new_cache(m)


def layers(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_layers(cache: Any, kv: list[tuple[Any, Any]]) -> None:
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k.contiguous(), v.contiguous()
        if getattr(layer, "store", None) is not None:
            layer.store = None  # a growing layer's old room goes now (a leave frees its rows' memory at once)


def pad(t: Any, width: int) -> Any:
    """Left-pad a (B, H, L, D) tensor with zeros to length `width` (masked out, never attended)."""
    missing = width - t.shape[2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))


def pad_mask(mask: Any, width: int) -> Any:
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.nn.functional.pad(mask, (missing, 0))


def ones(cache: Any, rows: int, device: str) -> Any:
    """The mask of a cache without padding."""
    return torch.ones(rows, cache.layers[0].keys.shape[2], dtype=torch.long, device=device)


def prefill(
    m: Any, prompts: list[list[int]], device: str, forward_kwargs: Any, prefix: tuple[int, Any] | None = None
) -> tuple[Any, Any, Any]:
    """Prefill prompts together: their cache, its mask (None without padding) and each prompt's
    last logits (B, V). `prefix`: (n, a one-row cache of the first n tokens, which every prompt
    shares): only the rest is computed, after a copy of that cache per row (the padding then sits
    between the prefix and each prompt's rest, masked like any other). One prompt, or prompts of
    one length, run without a mask: the arithmetic of a request alone."""
    n = 0
    if prefix is None:
        cache = new_cache(m)
    else:
        n, shared = prefix
        cache = copy.deepcopy(shared)
        set_layers(
            cache, [(k.expand(len(prompts), -1, -1, -1), v.expand(len(prompts), -1, -1, -1)) for k, v in layers(shared)]
        )
    ids, mask, positions = left_padded([p[n:] for p in prompts], device)
    padded = not bool(mask.all())
    if n:
        mask = torch.cat([torch.ones(len(prompts), n, dtype=mask.dtype, device=device), mask], 1)
        positions = positions + n
    out = m(
        input_ids=ids,
        attention_mask=mask if padded else None,
        position_ids=positions if padded else None,
        use_cache=True,
        **forward_kwargs(m, cache),
    )
    return cache, mask if padded else None, out.logits[:, -1]


class Prefixes:
    """The KV of prompt beginnings many requests share (a chat template's system prompt: 24 tokens
    of the bundled model's 67- to 76-token chat prompts of prompts.json): computed once, copied into every group
    prefilled after it, so a burst's prefill skips them. At most PREFIXES are kept, the latest
    used last; a prefix shorter than PREFIX_MIN is not worth keeping."""

    def __init__(self, device: str, keep: int = PREFIXES, shortest: int = PREFIX_MIN) -> None:
        self.device, self.keep, self.shortest = device, keep, shortest
        self.known: dict[tuple[int, ...], Any] = {}
        self.hits = 0  # prompts prefilled after a kept prefix (metrics, tests)

    def find(self, m: Any, prompts: list[list[int]], forward_kwargs: Any) -> tuple[int, Any] | None:
        """A prefix of every prompt (shorter than each): a kept one, or for two or more prompts
        their common beginning, computed now and kept."""
        limit = min(len(p) for p in prompts) - 1  # each keeps a token of its own: its logits
        best = max(
            (k for k in self.known if len(k) <= limit and all(p[: len(k)] == list(k) for p in prompts)),
            key=len,
            default=None,
        )
        common = common_prefix(prompts)[:limit] if len(prompts) > 1 else []
        if len(common) >= self.shortest and (best is None or len(common) > len(best)):
            cache = new_cache(m)
            m(input_ids=torch.tensor([common], device=self.device), use_cache=True, **forward_kwargs(m, cache))
            best = tuple(common)
            self.known[best] = cache
            while len(self.known) > self.keep:
                del self.known[next(iter(self.known))]
        if best is None:
            return None
        self.known[best] = self.known.pop(best)  # the latest used goes last
        self.hits += len(prompts)
        return len(best), self.known[best]


def common_prefix(prompts: list[list[int]]) -> list[int]:
    first = prompts[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in prompts):
        n += 1
    return first[:n]


def left_padded(prompts: list[list[int]], device: str) -> tuple[Any, Any, Any]:
    """Several prompts as one left-padded batch: input ids, attention mask and each row's positions
    (counted from its first real token, so padding does not shift them)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions
