"""The batched engine's step through a Llama-family decoder (Qwen2, Llama) by its own hand: the
same layers, weights and arithmetic as transformers' forward, in fewer calls.

A lone reader's step is bound by reading the weights, yet transformers' forward spends a good
part of it on bookkeeping: each of its layers makes about 100 tensor calls, most of them views,
casts and checks, through six nested modules with their hooks and keyword plumbing (the bundled
model alone with --quantize w8a8 on the AVX2 kind, one row: 45 ms a step, the Linear products 20
of it; this pass 39 ms). In the engine, one reader without guesses (README, "The engine's own
pass"): a forward pass of 48.9-49.5 against 52.4-54.3 ms with w8a8, 49.5-54.1 against 58.1-62.9
with the default fp16 weights, the logits bit for bit the same. So where the model is one whose
layers it knows, the step walks them itself:

    x = embed(ids);  cos, sin = rotary(positions)
    per layer:  h = norm1(x);  q, k, v = qkv(h) (one product where fusing.py shared it), rotated;
                the keys and values into their slots (kv.py), attention through them (attention.py);
                x = x + o(attn);  h = norm2(x);  x = x + down(act(gate(h)) * up(h))
    logits = head(norm(x)[keep])

calling the model's own modules for every product (the kernels chosen per row count, the
quantized layers, the fused products all run as in transformers' forward) and repeating its norm
and rotary arithmetic, in the order transformers does, so every value is the same (tests: the
logits of both passes equal at every step of a batch, in both dtypes: decode steps, prompt
pieces, guesses). Another model, or `--forward transformers`, runs the model's own forward with
the step's layout as its attention mask; but transformers' Llama makes its own masks and refuses
the layout, so a Llama model runs batched through this pass only, whatever --forward says.

Leaves out: models whose layers it does not know (Qwen2-MoE, Gemma's scaled embeddings, ...):
they take the model's forward, slower and the same.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from streaming.generation import attention
from streaming.generation.kv import Layout, SlotKV
from streaming.model import fusing
from streaming.model.kernels import ChosenLinear
from streaming.model.loading import step_kwargs

# The decoder layers whose forward this pass repeats (read in transformers 5's modeling_qwen2.py
# and modeling_llama.py: the same residual order, rotary embedding and MLP)
KNOWN_LAYERS = ("Qwen2DecoderLayer", "LlamaDecoderLayer")
KNOWN_PARTS = ("Qwen2Attention", "LlamaAttention", "Qwen2MLP", "LlamaMLP")  # their attention and MLP, unreplaced
KNOWN_NORMS = ("Qwen2RMSNorm", "LlamaRMSNorm")  # the same arithmetic (`normed`)
# The layers whose model's forward takes the step's layout as its mask mapping: transformers'
# Llama makes its own masks and refuses it, so a Llama model takes this pass even when told not to
LAYOUT_AS_MASK = ("Qwen2DecoderLayer",)
KNOWN: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()  # own(), by model


def own(m: Any) -> bool:
    """Whether this pass knows `m`'s layers: a transformers causal LM of KNOWN_LAYERS and
    KNOWN_NORMS without sliding windows (the test models, which read their slots themselves, are
    not). Asked at every step: answered once per model."""
    known = KNOWN.get(m)
    if known is None:
        known = KNOWN[m] = knows(m)
    return known


def knows(m: Any) -> bool:
    inner = getattr(m, "model", None)
    layers = getattr(inner, "layers", None)
    if getattr(m, "reads_slots", False) or inner is None or not layers or not hasattr(m, "lm_head"):
        return False
    if not all(hasattr(inner, n) for n in ("embed_tokens", "rotary_emb", "norm")):
        return False
    if "sliding_attention" in (getattr(m.config, "layer_types", None) or ()):
        return False
    if len(layers) != getattr(m.config, "num_hidden_layers", len(layers)):
        return False  # (transformers walks the first num_hidden_layers only)
    if not all(transformers_class(x, KNOWN_LAYERS) for x in layers):
        return False
    parts = [p for x in layers for p in (x.self_attn, x.mlp)]
    norms = [inner.norm, *(n for x in layers for n in (x.input_layernorm, x.post_attention_layernorm))]
    return all(transformers_class(p, KNOWN_PARTS) for p in parts) and all(
        transformers_class(n, KNOWN_NORMS) for n in norms
    )


def transformers_class(module: Any, names: tuple[str, ...]) -> bool:
    """Whether a module is one of transformers' own classes of these names (not a replacement,
    nor remote code that borrowed the name)."""
    return type(module).__name__ in names and type(module).__module__.startswith("transformers.models.")


def chosen(m: Any, own_pass: bool) -> str:
    """Which pass a step of `m` takes: "own" (this one) where it knows the model and `own_pass`,
    or where the model's forward would refuse the layout; else "transformers"."""
    if own(m) and (own_pass or type(m.model.layers[0]).__name__ not in LAYOUT_AS_MASK):
        return "own"
    return "transformers"


def step(
    m: Any, by: str, layout: Layout, kv: SlotKV, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """The logits at `keep` (len(keep), vocabulary) of one step over the flat tokens `ids` at
    `positions`, by this pass ("own") or the model's forward ("transformers"): `chosen`."""
    if by == "own":
        return forward(m, ids, positions, layout, kv, keep)
    attention.install(m)
    out = m(
        input_ids=ids[None],
        position_ids=positions[None],
        attention_mask={"full_attention": layout, "sliding_attention": layout},
        use_cache=True,
        **step_kwargs(m, kv, keep),
    )
    logits = out.logits[0]
    return logits if logits.shape[0] == len(keep) else logits[keep]


def forward(
    m: Any, ids: torch.Tensor, positions: torch.Tensor, layout: Layout, kv: SlotKV, keep: torch.Tensor
) -> torch.Tensor:
    """transformers' forward of a Llama-family causal LM over one step (the module docstring)."""
    inner = m.model
    x = inner.embed_tokens(ids)  # (tokens, width): the step's flat rows, as every product takes them
    cos, sin = inner.rotary_emb(x, positions[None])  # (1, tokens, head dim)
    half = sin.shape[-1] // 2  # rotate_half(x) sin = cat(x2, x1) cat(-sin1, sin2): no negation per layer
    cos, signed = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    for layer in inner.layers:
        x = decoder_layer(layer, x, cos, signed, layout, kv)
    return product(m.lm_head, normed(inner.norm, x)[keep])


def decoder_layer(
    layer: Any, x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor, layout: Layout, kv: SlotKV
) -> torch.Tensor:
    """One decoder layer over the step's tokens: transformers' Qwen2DecoderLayer.forward, the
    same arithmetic in the same order, without the module plumbing around it."""
    a, mlp = layer.self_attn, layer.mlp
    q, k, v = attention_inputs(a, normed(layer.input_layernorm, x), cos, signed)
    kv.update(k, v, a.layer_idx)
    o, _ = attention.attend(a, q, k, v, layout, fallback=None, scaling=a.scaling)
    x = x + product(a.o_proj, o.reshape(x.shape[0], -1))
    h = normed(layer.post_attention_layernorm, x)
    if (whole := shared_product(h, mlp.gate_proj, mlp.up_proj)) is not None:
        gate, up = whole.split([mlp.gate_proj.out_features, mlp.up_proj.out_features], -1)
    else:
        gate, up = product(mlp.gate_proj, h), product(mlp.up_proj, h)
    return x + product(mlp.down_proj, mlp.act_fn(gate) * up)


def attention_inputs(
    a: Any, h: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The queries, keys and values of a layer's input (1, heads, tokens, head dim), the queries
    and keys rotated: from one product, rotated together, where fusing.py shared it."""
    shape = (1, h.shape[0], -1, a.head_dim)
    if (whole := shared_product(h, a.q_proj, a.k_proj, a.v_proj)) is not None:
        heads = (a.q_proj.out_features + a.k_proj.out_features) // a.head_dim  # queries' and keys'
        split = heads * a.head_dim
        qk = rotated(whole[..., :split].view(shape).transpose(1, 2), cos, signed)
        nq = a.q_proj.out_features // a.head_dim
        return qk[:, :nq], qk[:, nq:], whole[..., split:].view(shape).transpose(1, 2)
    q, k, v = (product(p, h).view(shape).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
    return rotated(q, cos, signed), rotated(k, cos, signed), v


def shared_product(h: torch.Tensor, *layers: Any) -> torch.Tensor | None:
    """The one product of `h` whose parts, in order, the layers are (fusing.py); None if they
    are not exactly that."""
    first = layers[0]
    if not isinstance(first, fusing.Part) or len(layers) != len(first.shared.ends):
        return None
    if not all(isinstance(p, fusing.Part) and p.shared is first.shared and p.i == i for i, p in enumerate(layers)):
        return None
    return product(first.shared.linear, h)


def product(layer: Any, h: torch.Tensor) -> torch.Tensor:
    """`layer(h)` over the step's rows (tokens, width). A kernel-choosing layer (kernels.py) runs
    `rows`, what its forward runs, less the module call and the reshapes around it: about 20 us a
    product (97 products a step here); a layer with hooks, or any other module, is called."""
    if type(layer).forward is ChosenLinear.forward and not (layer._forward_hooks or layer._forward_pre_hooks):
        return layer.rows(h)  # type: ignore[no-any-return]
    return layer(h)  # type: ignore[no-any-return]


def normed(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2RMSNorm and LlamaRMSNorm forward (the same), without the module call."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(dtype)  # type: ignore[no-any-return]


def rotated(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: x cos + rotate_half(x) sin, with
    rotate_half's negation carried by `signed` (cat(-sin1, sin2)): (-a) b and a (-b) are the
    same number, so the bits are transformers'."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed
