"""Attention over the batch's slots (kv.py), as a transformers attention implementation.

The batched engine runs a step as one forward pass over a flat sequence of tokens, so the
model's own attention cannot know which token belongs to whom. transformers lets a model's
attention be any registered function (`AttentionInterface`), called by every layer with the
layer's queries and whatever the model was given as its attention mask: the engine passes the
step's `Layout` there, and `attend` reads the slots through it:

- the decode tokens, in a call for each block of slots (blocks.py: slots of like length, each
  block read to its own longest row): each a query of its own slot, masked to its slot's length
  (a slot that sits the step out gets a zero query, its answer dropped); a block of several rows
  of one length needs no mask and is `folded` too;
- each prompt piece, causal over its own slot up to its end (after a kept prefix or earlier
  chunks: an explicit mask, the query heads folded onto their key-value heads, `folded`; a
  whole prompt: SDPA's own causal mask). A row's guessed tokens (speculation.py) are such a
  piece.

The rest are transformers' own `sdpa_attention_forward`, so a request alone computes what it does
without the engine (the thread engine's arithmetic, to the bit: a lone row's block has no mask,
as without the engine); a call without a Layout (a prefix's prefill, the thread engine, tests)
goes to the attention the model had.

Leaves out: sliding-window layers (a model with them is refused: its windows would be ignored).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch

from streaming.generation.kv import Layout

PREFIX = "slots+"  # the registered name: slots+sdpa for a model whose attention was sdpa


def install(m: Any) -> None:
    """Route the model's attention through `attend` (once; a call without a Layout goes on as
    before). A model that reads its slots itself (the test models) is left as it is."""
    if getattr(m, "reads_slots", False):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = getattr(m, "config", None)
    was = getattr(config, "_attn_implementation", None)
    if config is None or not isinstance(was, str):
        raise ValueError("the batched engine needs a transformers model whose attention is chosen by name")
    if was.startswith(PREFIX):
        return
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError("the batched engine ignores sliding windows: run this model with --engine thread")
    name = PREFIX + was
    if name not in AttentionInterface._global_mapping:
        fallback = (
            AttentionInterface._global_mapping.get(was) or sys.modules[type(m).__module__].eager_attention_forward
        )
        AttentionInterface.register(name, functools.partial(attend, fallback=fallback))
        if was in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:  # masks for calls without a Layout
            masks = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, masks[was])  # type: ignore[arg-type]
    config._attn_implementation = name


def attend(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    *,
    fallback: Any,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One layer's attention: through the slots for a step with a Layout, else the model's own."""
    if not isinstance(attention_mask, Layout):
        return fallback(module, query, key, value, attention_mask, scaling=scaling, **kwargs)  # type: ignore[no-any-return]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = attention_mask
    keys, values = layout.kv.layer(module.layer_idx)
    heads, tokens = query.shape[1], query.shape[2]
    out = query.new_empty(1, tokens, heads, values.shape[-1])
    groups = getattr(module, "num_key_value_groups", 1)
    if r := layout.decoding:
        q = query[0, :, :r].transpose(0, 1).unsqueeze(2)  # (r, heads, 1, dim)
        for b in layout.blocks:
            k, v = keys[b.start : b.end, :, : b.longest], values[b.start : b.end, :, : b.longest]
            mine = q[b.first : b.last]
            if b.index is not None:  # zero queries for the slots that sit out
                mine = q.new_zeros(b.end - b.start, *q.shape[1:]).index_copy_(0, b.index, mine)
            if b.mask is None and groups > 1 and b.end - b.start > 1:  # rows of one length: see folded
                o = folded(mine, k, v, None, groups, scaling)
            else:
                o, _ = sdpa_attention_forward(module, mine, k, v, b.mask, scaling=scaling, is_causal=False)
            out[0, b.first : b.last] = o[:, 0] if b.index is None else o.index_select(0, b.index)[:, 0]
    for slot, start, n, offset, mask in layout.pieces:
        k, v = keys[slot : slot + 1, :, : start + n], values[slot : slot + 1, :, : start + n]
        q = query[:, :, offset : offset + n]
        if mask is not None and groups > 1:
            o = folded(q, k, v, mask, groups, scaling)
        else:
            o, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=scaling)
        out[0, offset : offset + n] = o[0]
    return out, None


def folded(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    groups: int,
    scaling: float | None,
) -> torch.Tensor:
    """Attention with each key-value head's query heads folded into its queries (transformers'
    pack_gqa, which it does for one query under a mask only), so each key is read once for all
    the heads that share it:
    - a piece after earlier tokens (an explicit mask): given a mask, transformers' SDPA copies
      every key and value `groups` times first (repeat_kv: 4.8 ms of a 69 ms step with 4 guessed
      tokens, the bundled model on the AVX2 kind);
    - a block of decode rows of one length (no mask): transformers' SDPA asks for `enable_gqa`,
      which reads each key once per query head (64 rows of 209 tokens, the bundled model's 24
      layers: 16.9 ms against 10.1 folded, the AMX Xeon). A row alone keeps transformers' own
      call: its arithmetic is the model's without the engine, to the bit (folded moves float32's
      last bits).
    Returns (b, n, heads, dim), as sdpa_attention_forward does."""
    b, heads, n, dim = query.shape
    q = query.reshape(b, heads // groups, groups * n, dim)  # head h is key-value head h // groups
    rows = None if mask is None else mask.expand(b, 1, n, mask.shape[-1]).repeat(1, 1, groups, 1)  # query j*n+i: row i
    o = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=rows, scale=scaling)
    return o.reshape(b, heads, n, dim).transpose(1, 2)
