"""A KV cache layer that grows in place: transformers' DynamicLayer concatenates at every update,
copying the layer's whole keys and values each step; this one keeps room at the end and writes
the new columns there (one copy when the room runs out).

Its own module because it subclasses a transformers class, and transformers takes seconds to
import: kv.py imports this only when a model runs (a --engine free server never does).
Leaves out: sliding-window and other layer kinds (kept as transformers makes them).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache, DynamicLayer

ROOM = 32  # columns of room a layer's keys and values gain when full, at least (a copy per 32 steps)
ROOM_SHARE = 4  # ... or a quarter of their length, whichever is more: at most 1/4 of memory unused


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of a larger tensor: an update writes its
    columns into the room at the end (one copy when the room runs out, not one per step). A
    tensor set from outside (kv's join and keep) is adopted: copied into new room at the next
    update."""

    def __init__(self) -> None:
        super().__init__()
        self.store: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values) with room

    def room_for(self, add: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The store, with room for `add` more columns after the current ones (the keys and
        values copied into a larger one if not)."""
        n = self.get_seq_length()
        store, keys_now, values_now = self.store, self.keys, self.values
        ours = (
            store is not None
            and store[0].shape[:2] == like.shape[:2]
            and (n == 0 or (keys_now is not None and keys_now.data_ptr() == store[0].data_ptr()))
            and (n == 0 or (keys_now is not None and keys_now.stride() == store[0].stride()))
        )
        if store is None or not ours or store[0].shape[2] < n + add:
            width = n + add + max(ROOM, (n + add) // ROOM_SHARE)
            b, h, _, d = like.shape
            keys = torch.empty(b, h, width, d, dtype=like.dtype, device=like.device)
            values = torch.empty_like(keys)
            if n and keys_now is not None and values_now is not None:
                keys[:, :, :n] = keys_now
                values[:, :, :n] = values_now
            store = self.store = (keys, values)
        return store

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:  # noqa: ARG002 - as DynamicLayer.update
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, add = self.get_seq_length(), key_states.shape[-2]
        keys, values = self.room_for(add, key_states)
        keys[:, :, n : n + add] = key_states
        values[:, :, n : n + add] = value_states
        self.keys, self.values = keys[:, :, : n + add], values[:, :, : n + add]
        return self.keys, self.values

    def add_column(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """After a narrowed step: a new column, `keys`/`values` ((k, H, 1, D)) for the rows at
        `rows`, zeros (masked) for the others."""
        n = self.get_seq_length()
        assert self.keys is not None, "a column is added to a layer that has keys"
        k, v = self.room_for(1, self.keys)
        k[:, :, n].zero_()
        v[:, :, n].zero_()
        k[:, :, n].index_copy_(0, rows, keys[:, :, 0])
        v[:, :, n].index_copy_(0, rows, values[:, :, 0])
        self.keys, self.values = k[:, :, : n + 1], v[:, :, : n + 1]


def new_cache(m: Any) -> DynamicCache:
    """A DynamicCache for the model whose plain layers are GrowingLayers."""
    cache = DynamicCache(config=m.config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if getattr(cache, "layer_class_to_replicate", None) is DynamicLayer:  # layers made on first use
        cache.layer_class_to_replicate = GrowingLayer
    return cache


def grown(layer: Any) -> GrowingLayer:
    """The layer as a GrowingLayer (one of another kind: a copy of its tensors in one)."""
    if isinstance(layer, GrowingLayer):
        return layer
    g = GrowingLayer()
    g.lazy_initialization(layer.keys, layer.values)
    g.keys, g.values = layer.keys, layer.values
    return g
