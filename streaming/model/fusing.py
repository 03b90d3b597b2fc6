"""Linear layers that read the same input, multiplied as one product: each decoder layer's query,
key and value projections, and its MLP's gate and up projections.

A decode step calls seven products a layer, and at a few rows each call costs more than its
share of the weights it reads. Measured on an Intel Xeon with AMX (the bundled model's shapes in
bfloat16, a layer's worth): at one row gate and up 1.36 ms apart against 1.23 as one product
(torch.mv 0.94 against 0.81), query, key and value 0.23 against 0.15; at 16 rows 1.50 against
1.26 and 0.26 against 0.15; at 525 (a prefill step) 2-3% less.

The model's own code is untouched: each layer keeps its name and its call, and becomes a `Part`
of a `Shared` product (one Linear of the concatenated weights, which kernels.py times and
quant.py quantizes like any other). The first call with an input computes the whole product;
the others with that very input (the same tensor object: the model passes one hidden state to
all of them, and nothing writes to it in between) take their slice of it. A call with another
input computes the product again: slower, never wrong.

Done at load where the CPU's kernels are measured (loading.py). Leaves out: groups whose layers
differ in bias or input (none in the models here; such a group is left as it is).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # layers that read one input
# Groups kept apart under a quantization: torch's int8 weight kernel (_weight_int8pack_mm) read
# a 9,728-row weight slower than two 4,864-row ones here (one row: 0.73 against 2 x 0.18 ms in a
# slow hour, 0.30 against 2 x 0.13 in a fast one), so with --quantize int8 the gate and up
# projections stay two products (fbgemm's w8a8 and the int4 kernel run the fused one as fast or
# faster: 0.24 against 2 x 0.14, 0.29 against 2 x 0.15).
APART = {"int8": (GROUPS[1],)}


class Shared(torch.nn.Module):
    """One product for several layers: `linear` (their weights stacked), and the last one
    computed, until its last part has been served."""

    def __init__(self, layers: list[torch.nn.Linear]) -> None:
        super().__init__()
        first = layers[0]
        self.ends = list(itertools.accumulate(x.out_features for x in layers))  # each part's slice ends here
        self.linear = torch.nn.Linear(first.in_features, self.ends[-1], bias=first.bias is not None, device="meta")
        self.linear.weight = torch.nn.Parameter(torch.cat([x.weight.detach() for x in layers]), requires_grad=False)
        if first.bias is not None:
            biases = [x.bias.detach() for x in layers if x.bias is not None]
            self.linear.bias = torch.nn.Parameter(torch.cat(biases), requires_grad=False)
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, its product)

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        seen = self.seen
        if seen is None or seen[0] is not x:
            seen = self.seen = (x, self.linear(x))
        if i == len(self.ends) - 1:
            self.seen = None  # the last part served: the input and product are let go
        return seen[1][..., self.ends[i - 1] if i else 0 : self.ends[i]]


class Part(torch.nn.Module):
    """What a fused layer becomes: its slice of the shared product (its shape and call as before)."""

    shared: Shared

    def __init__(self, shared: Shared, i: int, layer: torch.nn.Linear) -> None:
        super().__init__()
        object.__setattr__(self, "shared", shared)  # not a child: its parent holds it, once
        self.i, self.in_features, self.out_features = i, layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared.part(x, self.i)

    def extra_repr(self) -> str:
        return f"part {self.i} of a shared product, in_features={self.in_features}, out_features={self.out_features}"


def fuse(model: torch.nn.Module, quantize: str = "none") -> int:
    """Fuse every group of GROUPS found in one module of `model`, in place, but those kept
    APART under the quantization `model` will get; returns how many were fused."""
    n = 0
    for parent in list(model.modules()):
        for group in GROUPS:
            if group in APART.get(quantize, ()):
                continue
            layers: list[Any] = [getattr(parent, name, None) for name in group]
            if not all(type(x) is torch.nn.Linear for x in layers) or not same_input(layers):
                continue
            shared = Shared(layers)
            setattr(parent, "fused_" + "_".join(name.removesuffix("_proj") for name in group), shared)
            for i, (name, layer) in enumerate(zip(group, layers, strict=True)):
                setattr(parent, name, Part(shared, i, layer))
            n += 1
    return n


def same_input(layers: list[torch.nn.Linear]) -> bool:
    first = layers[0]
    return all(
        x.in_features == first.in_features
        and x.weight.dtype == first.weight.dtype
        and x.weight.device == first.weight.device
        and (x.bias is None) == (first.bias is None)
        for x in layers
    )
