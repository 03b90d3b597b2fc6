"""What `--quantize w8a8` measures at load: each layer's largest input per channel, and from it
the factors that move the activations' outlier channels into the weights (SmoothQuant).

Eight bits a row hold a row well only when no channel of it is far larger than the rest, and a
transformer's activations have a few channels that are (the RMS norms' weights amplify them).
SmoothQuant (Xiao et al. 2023) divides each input channel j by s_j = max|X_j|^α / max|W_j|^(1-α)
and multiplies the weight's column j by it: the product is the same, the rows are flatter, the
weights a little less so. max|X_j| is read once at load, from a forward pass over CALIBRATION (a
fixed text, none of prompts.json, so the perplexity measured on those is not fitted to).

And one layer is not quantized in its rows at all: the MLP's down projection (KEEP), whose input
(the gate times the up projection) has channels hundreds of times the median, which no smoothing
made fit. It gets int8 weights only (float16 where torch's int8 kernel is slow: quant.kept_mode).
Measured on an AVX-512 BF16 EPYC (the bundled model in bfloat16, perplexity over all 20 texts of prompts.json; dense 67.837): every layer w8a8 and no
smoothing 74.311 (+9.5%); the down projection kept 70.533 (+4.0%); that and smoothing on an
earlier wording of this text, α 0.3 68.876, 0.4 67.413, 0.5 69.124 (and with the down projection
smoothed and in w8a8 too, α 0.3 72.088, 0.5 71.331, 0.7 91.622); as shipped (this text, α 0.4:
`scripts/perplexity.py --modes none int8 w8a8`) 67.972 (+0.2%; int8 weights alone 68.010).

Leaves out: smoothing folded into the norms (one less product a call, but the dense fallback
would need the smoothed weights too), and per-layer α.
"""

from __future__ import annotations

from typing import Any

import torch

ALPHA = 0.4  # how much of a channel's range moves into the weight (the measured best of 0.3-0.5)
KEEP = ("down_proj",)  # layers (by attribute name) that keep rows unquantized: weights only (quant.kept_mode)
FLOOR = 1e-5  # a channel that never moved (or a zero weight column) is not divided by zero
CALIBRATION = (
    "The committee met on Tuesday to review the budget for the coming year. Revenue rose by four percent, "
    "but the cost of maintaining the old bridge doubled after the spring floods.\n"
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n"
    'She said the results were "promising, though not conclusive", and asked for another month of data. '
    "1, 2, 3, 5, 8, 13, 21."
)


def calibration_ids(tokenizer: Any) -> torch.Tensor:
    return torch.tensor([tokenizer(CALIBRATION).input_ids])


def input_maxima(model: torch.nn.Module, ids: torch.Tensor) -> dict[torch.nn.Module, torch.Tensor]:
    """Every plain Linear's largest |input| per channel over one forward pass of `ids`."""
    seen: dict[torch.nn.Module, torch.Tensor] = {}

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0].detach().to(torch.float32)
        top = x.abs().reshape(-1, x.shape[-1]).amax(0)
        seen[module] = torch.maximum(seen[module], top) if module in seen else top

    hooks = [m.register_forward_pre_hook(hook) for m in model.modules() if type(m) is torch.nn.Linear]
    try:
        with torch.inference_mode():
            model(input_ids=ids.to(next(model.parameters()).device))
    finally:
        for h in hooks:
            h.remove()
    return seen


def factors(top: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """s_j, by which input channel j is divided and the weight's column j multiplied."""
    w = weight.detach().to(torch.float32).abs().amax(0).clamp(min=FLOOR)
    return (top.clamp(min=FLOOR) ** ALPHA / w ** (1 - ALPHA)).clamp(min=FLOOR)


def kept(names: dict[torch.nn.Module, str], layer: torch.nn.Module) -> bool:
    return names.get(layer, "").rsplit(".", 1)[-1] in KEEP
