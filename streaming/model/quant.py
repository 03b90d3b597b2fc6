"""Weight-only quantized Linear layers on the CPU: fewer bytes read per token.

A decode step at batch 1 is bound by reading the weights (about 1 GB in bfloat16 for the bundled
0.5B model, at about 18 GB/s here). Storing them as int8 (one scale per output channel) or int4
(a scale and an offset per group of 64 inputs) halves or quarters those bytes; torch ships the CPU
kernels that multiply by them without widening the whole matrix first:

- int8: `torch.ops.aten._weight_int8pack_mm(x, w_int8, scales)`;
- int4: `torch.ops.aten._convert_weight_to_int4pack_for_cpu` once, then
  `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`.

The kernels win while few rows multiply (measured here on the bundled model in bfloat16, one
decode step: 52 ms dense against 21 ms int8 at batch 1, but 146 against 116 ms at batch 32), so
each layer keeps its dense weight too and picks per call: the quantized kernel up to DENSE_FROM
rows, the dense one from there (prefills and big batches). Memory: the dense weights plus half
(int8) or a quarter (int4) more.

Quantizing takes about 1.3 s for the 0.5B model, so it is done at every load rather than cached.
Leaves out: activation quantization (the dynamic int8 of torch.ao, deprecated), and GPUs.
"""

from __future__ import annotations

import torch

DENSE_FROM = (
    24  # rows (batch x new tokens) from which the dense kernel is faster here (measured: 16 int8 wins, 32 dense)
)
GROUP = 64  # int4: inputs per scale and offset (64 kept the perplexity closest of 32/64/128 for its bytes)
INNER_K_TILES = 2  # int4 packing layout the CPU kernel takes
MODES = ("none", "int8", "int4")


class QuantLinear(torch.nn.Module):
    """A Linear whose product runs on int8 or int4 weights for a few rows, dense for many."""

    def __init__(self, linear: torch.nn.Linear, mode: str, dense_from: int = DENSE_FROM) -> None:
        super().__init__()
        self.mode, self.dense_from = mode, dense_from
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().to(torch.float32)
        if mode == "int8":
            scale = w.abs().amax(1).clamp(min=1e-8) / 127
            self.register_buffer("w8", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scale.to(linear.weight.dtype))
        else:
            packed, scales_and_zeros = int4_pack(w)
            self.register_buffer("w4", packed)
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] >= self.dense_from:
            y = torch.nn.functional.linear(flat, self.weight)
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(flat, self.w8, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.w4, GROUP, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def int4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of GROUP inputs: q in 0..15, w ~ (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = lo + scale * 8
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INNER_K_TILES)
    scales_and_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # (k/GROUP, n, 2)
    return packed, scales_and_zeros


def quantize(model: torch.nn.Module, mode: str, dense_from: int = DENSE_FROM) -> torch.nn.Module:
    """Replace every Linear of the model (the lm_head too) by a QuantLinear, in place.
    `dense_from`: rows from which the dense weights are used (a huge one: the quantized kernel
    for everything, as scripts/perplexity.py measures quality)."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear) and (mode == "int8" or child.in_features % GROUP == 0):
                setattr(parent, name, QuantLinear(child, mode, dense_from))
    return model
