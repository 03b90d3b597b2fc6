"""Weight-only quantized Linear layers on the CPU: fewer bytes read per token.

A decode step at batch 1 is bound by reading the weights (about 1 GB in bfloat16 for the bundled
0.5B model, at about 18 GB/s here). Storing them as int8 (one scale per output channel) or int4
(a scale and an offset per group of 64 inputs) halves or quarters those bytes; torch ships the CPU
kernels that multiply by them without widening the whole matrix first:

- int8: `torch.ops.aten._weight_int8pack_mm(x, w_int8, scales)`;
- int4: `torch.ops.aten._convert_weight_to_int4pack_for_cpu` once, then
  `torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)`;
- bf16: for a float32 model (the default where the CPU has no native bfloat16, e.g. AVX2 only),
  a bfloat16 copy of the weights, the rows rounded to bfloat16 too and the product widened back
  (`F.linear(x.bfloat16(), w_bf16).float()`): half the bytes of float32. Measured on an AVX2 EPYC
  at one row: 1.15 against 0.51 ms for 4864 x 896, 33.8 against 15.7 ms for the 151,936-row output
  layer (the emulated bfloat16 product is still bound by the bytes it reads); every other
  operation (norms, attention, softmax, the residual stream) stays float32. Prefills stay dense:
  there emulated bfloat16 is 2x slower than float32;
- fp16: a float16 copy of the weights packed for fbgemm (torch's x86 CPU library:
  `torch.ops.quantized.linear_prepack_fp16` once, then `linear_dynamic_fp16(x, packed)`), which
  widens them to float32 inside its blocked product: half the bytes of float32 and float32
  arithmetic, the rows untouched (float16's 10-bit mantissa: a product's error ~2e-4 of its size
  against bf16's ~3e-3). Measured on an AVX2 EPYC, 4864 x 896: 0.26 against 1.06 ms at one row,
  1.26 against 4.91 at 16, 3.77 against 7.09 at 64; the output layer's quarter 3.2 against 10.9 ms
  at one row. A bfloat16 model's rows are widened to float32 for it and its product rounded back;
- w8a8: int8 weights (a scale per output) and int8 rows, multiplied in integers by fbgemm's dynamic
  kernel (`torch.ops.quantized.linear_dynamic`; on a CPU with VNNI, `vpdpbusd`): what a step reads
  is the int8 weights, and the product runs at the integer units' rate, so it wins batched steps
  too. fbgemm quantizes its whole input with one scale, which would make each row's product
  depend on the other rows of the batch; so each row is first mapped onto exactly [-1, 1]
  (x' = (x - lo) / s - 1, s = (hi - lo) / 2: both ends come out exact in floating point), which
  gives every batch the same range and every row its own 8 bits, and the product is mapped back
  (y = s W x' + (lo + s) W 1); the weights are smoothed first (smooth.py), and get 8 bits with
  VNNI, 7 without (weight_levels: fbgemm's 16-bit pair sums would saturate). Measured on an AVX-512
  VNNI EPYC, fbgemm's kernel alone, 4864 x 896: 0.26 against 0.90 ms
  (bfloat16) at one row, 0.53 against 1.53 at 16, 1.11 against 3.57 at 64; the output layer's
  quarter 1.05 against 8.8 ms at one row. The down projection keeps its rows unquantized
  (smooth.py) and takes int8 weights, or float16 ones where torch's int8 kernel is slow (kept_mode).

Whether they win depends on the machine: on an AVX-512 one (the bundled model in bfloat16, one
decode step) 52 ms dense against 21 ms int8 at batch 1, but 146 against 116 ms at batch 32; on an
AVX2 one in float32 int8 is 2x slower than dense at 1 row and 40x at 32. So each layer keeps its
dense weight too and picks per call from the timings kernels.py takes at load: the quantized
kernel at the row counts where it is faster, a dense one elsewhere (so `--quantize` is never
slower than dense, only larger). Memory: the dense weights plus half (int8, w8a8) or a quarter (int4) more
(w8a8's down projection on AVX2 keeps a float16 copy: as large as a bfloat16 weight).

Quantizing takes about 1.3 s for the 0.5B model, so it is done at every load rather than cached.
The bf16 mode's rounding of the rows makes it a quantization of the activations as well as the
weights (scripts/perplexity.py measures what it costs).
Leaves out: GPUs. w8a8's packing makes one quantized tensor
per layer at load (torch has deprecated them as tensors a user handles; fbgemm still takes its
weights that way), and its warning is silenced there only.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

from streaming.model import kernels, smooth
from streaming.model.kernels import COPYING, ROWS, WEIGHT_COPIES, ChosenLinear

DENSE_FROM = 24  # until measured (--kernels linear): rows from which dense runs (AVX-512, bf16: 16 int8 wins, 32 dense)
BF16_DENSE_FROM = 4  # the same for bf16 weights (AVX2, float32: they win at 1-2 rows, lose 2x from 4)
FP16_DENSE_FROM = 1 << 10  # and for fbgemm's fp16 weights: faster than float32 at every decode row count (AVX2)
FP16_MAX = 65504.0  # float16's largest finite value: a weight past it cannot be stored
SPAN_MIN = 1e-30  # w8a8: a row whose values are all equal maps to [-1, 1] over this span (its product is W 1 x)
GROUP = 64  # int4: inputs per scale and offset (64 kept the perplexity closest of 32/64/128 for its bytes)
INNER_K_TILES = 2  # int4 packing layout the CPU kernel takes
W8A8_DENSE_FROM = 1 << 10  # and for w8a8: faster than bfloat16 at every decode row count (AVX-512 VNNI)
# w8a8: up to this many rows torch's int8 weight kernel is timed too ("i8w", from an int8 copy of the
# weight kept only where chosen). A small layer's product at one row is mostly the work around its
# kernel: on the AMX Xeon the attention's 1152 x 896 and 896 x 896 products chose `mv` over w8a8
# (its rows' mapping onto [-1, 1] and back), and `mv` read their bfloat16 weights at 13 GB/s in a
# real pass; int8 weights through `_weight_int8pack_mm` made a one-row step 42.0 -> 38.2 ms
# (medians of 15, three rounds), where the larger layers (gate and up, the output layer) lost with it.
I8W_ROWS = 4
MODES = ("none", "int8", "int4", "bf16", "fp16", "w8a8")
FBGEMM = ("fp16", "w8a8")  # the modes that run fbgemm's kernels (torch's x86 builds only)


class QuantLinear(ChosenLinear):
    """A Linear that can also multiply by int8 or int4 weights: its table (kernels.py, measured at
    load) says for each row count whether the quantized kernel or a dense one runs. Until
    measured: the quantized kernel up to DENSE_FROM rows, `linear` from there. A w8a8 layer where
    torch's int8 weight kernel is fast (int8_fast) also times that one at a few rows (I8W_ROWS)."""

    copying = (*COPYING, "i8w")

    w8: torch.Tensor  # int8: the weights, one scale per output (buffers)
    scales: torch.Tensor
    w4: torch.Tensor  # int4: packed for the CPU kernel, a scale and offset per group
    scales_and_zeros: torch.Tensor
    wh: torch.Tensor  # bf16: the weights in bfloat16
    packed: torch.ScriptObject  # fp16, w8a8: fbgemm's packed weights (not a tensor: the CPU only)
    smooth: torch.Tensor  # w8a8: each input channel's divisor, multiplied into the weights (smooth.py)
    ones: torch.Tensor  # w8a8: W 1, each output's sum of (smoothed) weights: the rows' shift comes back through it

    def __init__(
        self, linear: torch.nn.Linear, mode: str, dense_from: int | None = None, smooth: torch.Tensor | None = None
    ) -> None:
        super().__init__(linear)
        self.mode = mode
        self.int8_copy: tuple[torch.Tensor, torch.Tensor] | None = None  # w8a8's "i8w": while it may run
        if dense_from is None:
            dense_from = {"bf16": BF16_DENSE_FROM, "fp16": FP16_DENSE_FROM, "w8a8": W8A8_DENSE_FROM}.get(
                mode, DENSE_FROM
            )
        elif dense_from >= 1 << 30:
            self.fixed = mode  # every call quantized (scripts/perplexity.py measures its quality)
        self.table = [mode if n < dense_from else "linear" for n in ROWS]
        w = linear.weight.detach().to(torch.float32)
        if mode in FBGEMM and not fbgemm_available():
            raise ValueError(f"--quantize {mode} runs fbgemm's kernels, which this build of torch lacks (x86 only)")
        if mode == "bf16":
            if linear.weight.dtype != torch.float32:
                raise ValueError("--quantize bf16 halves a float32 model's weights: use --dtype float32")
            self.register_buffer("wh", linear.weight.detach().to(torch.bfloat16))
        elif mode == "fp16":
            if past_fp16(w):
                raise ValueError("--quantize fp16: a weight is past float16's range")
            self.packed = pack_fp16(w)
        elif mode == "w8a8":
            if smooth is None:
                raise ValueError("--quantize w8a8 needs each layer's smoothing factors (smooth.py)")
            self.register_buffer("smooth", smooth.to(torch.float32))
            smoothed = w * self.smooth
            self.packed = pack_int8(smoothed)
            self.register_buffer("ones", smoothed.sum(1))
        elif mode == "int8":
            w8, scales = int8_pair(linear.weight.detach())
            self.register_buffer("w8", w8)
            self.register_buffer("scales", scales)
        else:
            packed, scales_and_zeros = int4_pack(w)
            self.register_buffer("w4", packed)
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(linear.weight.dtype))

    def candidates(self, rows: int) -> list[str]:
        return [*super().candidates(rows), self.mode, *(["i8w"] if self.i8w(rows) else [])]

    def i8w(self, rows: int = 1) -> bool:
        """Whether the int8 weight kernel is a candidate at this many rows (w8a8, I8W_ROWS)."""
        return self.mode == "w8a8" and rows <= I8W_ROWS and int8_fast()

    def int8_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The int8 copy "i8w" multiplies by (int8_pair), made on first use."""
        if self.int8_copy is None:
            self.int8_copy = int8_pair(self.weight.detach())
        return self.int8_copy

    def run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name == "i8w":  # w8a8's: the unsmoothed weights in int8, a scale per output, the rows as they are
            y = torch.ops.aten._weight_int8pack_mm(x, *self.int8_weights())
        elif name != self.mode:
            return super().run(name, x)
        elif self.mode == "bf16":
            y = torch.nn.functional.linear(x.to(torch.bfloat16), self.wh).to(x.dtype)
        elif self.mode == "fp16":
            y = torch.ops.quantized.linear_dynamic_fp16(x.to(torch.float32), self.packed).to(x.dtype)
        elif self.mode == "w8a8":
            y = self.w8a8(x).to(x.dtype)
        elif self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.w8, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w4, GROUP, self.scales_and_zeros)
        return y if self.bias is None else y + self.bias

    def w8a8(self, x: torch.Tensor) -> torch.Tensor:
        """Each row smoothed, then onto exactly [-1, 1], fbgemm's int8 product, each row back (the
        docstring above). The division by the float32 factors widens a bfloat16 row as it goes.
        Each row's ends: torch.aminmax for one row, amin and amax for more: aminmax along the
        rows is slow past one (the AVX2 kind, rows of 896: 9 against 5 us for 3 rows, 86 against
        19 for 64, 689 against 82 for 512; in a pass with 2 guesses, 112 us a call, 8 of its 68
        ms). A lone reader's passes with guesses, alternating on captured passes: 2 to 5 tokens
        67.7-87.3 -> 60.1-79.0 ms, one token as before."""
        x = x / self.smooth  # a new tensor: the steps below work in place (the same bits, fewer allocations)
        lo, hi = torch.aminmax(x, dim=-1, keepdim=True) if len(x) == 1 else (x.amin(-1, True), x.amax(-1, True))
        s = hi.sub_(lo).div_(2).clamp_(min=SPAN_MIN)
        y = torch.ops.quantized.linear_dynamic(x.sub_(lo).div_(s).sub_(1), self.packed, False)  # 8-bit rows
        return lo.add_(s).mul(self.ones).addcmul_(y, s)

    def part(self, n: int) -> ChosenLinear | None:
        if self.mode == "int4":
            return None  # int4's packed layout is not cut by rows: time the whole layer
        piece = super().part(n)
        assert isinstance(piece, QuantLinear)
        if self.mode == "bf16":
            piece.wh = self.wh[:n]
        elif self.mode == "fp16":
            piece.packed = pack_fp16(self.weight.detach()[:n].to(torch.float32))
        elif self.mode == "w8a8":
            piece.packed = pack_int8(self.weight.detach()[:n].to(torch.float32) * self.smooth)
            piece.ones = self.ones[:n]
        else:
            piece.w8, piece.scales = self.w8[:n], self.scales[:n]
        return piece

    def shape(self) -> tuple[object, ...]:
        return (*super().shape(), self.mode, *(["i8w"] if self.i8w() else []))  # (a new key: timed again)


QuantLinear.copies = {**WEIGHT_COPIES, "i8w": ("int8_copy", QuantLinear.int8_weights)}


def int8_pair(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 weights, a scale per output (in the weight's dtype), as torch's int8 weight
    kernel `_weight_int8pack_mm` takes them."""
    w = weight.to(torch.float32)
    scale = w.abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.to(weight.dtype)


def fbgemm_available() -> bool:
    """Whether this torch has fbgemm's kernels, float16 and int8 (its x86 builds do; ARM's do not)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


def pack_fp16(w: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed float16 copy of a float32 weight (no bias: run() adds the layer's)."""
    return torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)


def pack_int8(w: torch.Tensor) -> torch.ScriptObject:
    """fbgemm's packed int8 copy of a float32 weight, symmetric, a scale per output (no bias), in
    weight_levels() steps each side of zero."""
    scale = (w.abs().amax(1) / weight_levels()).clamp(min=1e-8).to(torch.float64)
    with warnings.catch_warnings():  # torch's deprecation of quantized tensors: fbgemm's packing still takes one
        warnings.filterwarnings("ignore", "torch.quantize_per_tensor, torch.quantize_per_channel", UserWarning)
        q = torch.quantize_per_channel(w.contiguous(), scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
        return torch.ops.quantized.linear_prepack(q, None)


def past_fp16(weight: torch.Tensor) -> bool:
    """Whether a weight holds a value float16 cannot store (fp16 refuses it; w8a8 keeps int8)."""
    return float(weight.detach().abs().max()) > FP16_MAX


def kept_mode(weight: torch.Tensor | None = None) -> str:
    """w8a8's mode for the layers whose rows stay unquantized (smooth.KEEP: the down projection):
    int8 weights where torch's int8 weight kernel is vectorized (its CPU capability AVX512), float16
    weights through fbgemm elsewhere, unless the weight is past float16's range (int8 then: slow
    there, but w8a8 loads). Measured on the AVX2 EPYC, one row of the 896 x 4864 down projection,
    24 distinct weights in turn: int8 3.81 ms, dense float32 1.80, fp16 0.64: int8 there lost to
    dense, so the tables ran float32 and a w8a8 step read 17 MB a layer for it."""
    if int8_fast():
        return "int8"
    if weight is not None and past_fp16(weight):
        return "int8"
    return "fp16"


def int8_fast() -> bool:
    """Whether torch's int8 weight kernel is vectorized here (its CPU capability AVX512)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def weight_levels() -> int:
    """w8a8's int8 weights' largest magnitude: 127 where the CPU multiplies bytes with VNNI
    (`vpdpbusd`, 32-bit sums), else 63. Without VNNI fbgemm's `vpmaddubsw` adds each pair of
    products of an 8-bit row value (0..255) and a weight into 16 bits with saturation: full 8-bit
    weights could pass 32,767, weights within 63 cannot (2 x 255 x 63 = 32,130). The other way out,
    7-bit rows (linear_dynamic's reduce_range) and 8-bit weights, lost more: the AVX2 kind's
    perplexity (scripts/perplexity.py --dtype float32, all 20 texts; none 67.762) 68.986 (+1.8%)
    against 68.310 (+0.8%) with 7-bit weights and 8-bit rows (smoothing's alpha 0.3: 70.074, 0.5:
    69.769). The rows keep 8 bits on every CPU."""
    return 127 if vnni() else 63


@functools.cache
def vnni() -> bool:
    """Whether fbgemm multiplies bytes with VNNI here (`vpdpbusd`, 32-bit sums): AVX-512 VNNI,
    whose kernels fbgemm has. A CPU with 256-bit AVX-VNNI alone is not counted (whether fbgemm's
    kernels use it is not checked here): its weights get the levels that cannot saturate. Not
    where the flags cannot be read."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_vnni" in flags


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


def quantize(
    model: torch.nn.Module, mode: str, dense_from: int | None = None, calibration: torch.Tensor | None = None
) -> torch.nn.Module:
    """Replace every Linear of the model (the lm_head too) by a QuantLinear, in place.
    `dense_from`: rows from which the dense weights are used until measured (None: the mode's
    own; a huge one: the quantized kernel for everything, as scripts/perplexity.py measures
    quality). `calibration`: w8a8's token ids (smooth.calibration_ids), run once to smooth."""
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}: choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if mode != "w8a8":
        kernels.wrap(
            model,
            lambda child: (
                QuantLinear(child, mode, dense_from) if mode != "int4" or child.in_features % GROUP == 0 else None
            ),
        )
        return model
    if calibration is None:
        raise ValueError("--quantize w8a8 smooths on a text first: pass smooth.calibration_ids(tokenizer)")
    tops, names = smooth.input_maxima(model, calibration), {m: n for n, m in model.named_modules()}

    def make(child: torch.nn.Linear) -> QuantLinear | None:
        if smooth.kept(names, child):
            return QuantLinear(child, kept_mode(child.weight), dense_from)
        top = tops.get(child)  # None: a layer the forward pass never ran stays dense
        return None if top is None else QuantLinear(child, mode, dense_from, smooth.factors(top, child.weight))

    kernels.wrap(model, make)
    return model
