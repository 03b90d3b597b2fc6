"""Which model, on which device, in which dtype, quantized or not: the choice every program that
loads a model makes (--model, --device, --dtype, --quantize; else LM_MODEL and LM_QUANTIZE), each
value checked when it is made, with an error that says what to choose instead.

Leaves out: loading (loading.py) and what a model is made of (bundled.py, testing.py).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = ("bfloat16", "float16", "float32")
NAMED = ("bundled", "tiny", "exact", "echo")  # the names that are not a hub id, folder or .gguf path
QUANTIZE = ("none", "int8", "int4", "bf16", "fp16", "w8a8")  # quant.py
KERNELS = ("measure", "linear")  # kernels.py
FORWARDS = ("own", "transformers")  # the batched engine's step: generation/decoder.py, or the model's forward


class ModelError(RuntimeError):
    """A model could not be chosen or loaded; the message says what to do."""


@dataclass
class Choice:
    model: str = "bundled"
    device: str | None = None  # None: the best found (best_device)
    dtype: str | None = None  # None: per device (default_dtype)
    quantize: str | None = None  # None: per CPU (default_quantize)
    kernels: str | None = None  # None: measured for a real model, `linear` for the test models
    forward: str = "own"  # the batched engine's step through decoder.py where it knows the model

    @classmethod
    def from_env(cls) -> Choice:
        return cls(
            os.environ.get("LM_MODEL", "bundled"),
            quantize=os.environ.get("LM_QUANTIZE") or None,
            kernels=os.environ.get("LM_KERNELS") or None,
            forward=os.environ.get("LM_FORWARD") or "own",
        )

    def update(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        quantize: str | None = None,
        kernels: str | None = None,
        forward: str | None = None,
    ) -> None:
        """Set what is given, checking each value (ModelError names the choices)."""
        if model:
            self.model = model
        if device:
            check_device(device)
            self.device = device
        if dtype:
            if dtype not in DTYPES:
                raise ModelError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
            self.dtype = dtype
        if quantize:
            self.quantize = quantize
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ModelError(f"unknown quantization {self.quantize!r}: choose one of {', '.join(QUANTIZE)}")
        if kernels:
            self.kernels = kernels
        if self.kernels is not None and self.kernels not in KERNELS:
            raise ModelError(f"unknown kernels {self.kernels!r}: choose one of {', '.join(KERNELS)}")
        if forward:
            self.forward = forward
        if self.forward not in FORWARDS:
            raise ModelError(f"unknown forward {self.forward!r}: choose one of {', '.join(FORWARDS)}")
        check_model_name(self.model)

    def kernel_choice(self) -> str:
        """How Linear layers choose their kernel (kernels.py): timed at load on the CPU for a real
        model; the test models keep `linear` unless asked (timings of tiny weights are noise, and
        two processes must compute the same bits)."""
        if self.device_name() != "cpu":
            return "linear"
        return self.kernels or ("linear" if self.model in NAMED[1:] else "measure")

    def quantization(self) -> str:
        """--quantize as given, else what suits the CPU (default_quantize)."""
        return self.quantize or default_quantize(self)

    def device_name(self) -> str:
        return self.device or best_device()

    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype) if self.dtype else default_dtype(self.device_name())


def add_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The --model/--device/--dtype/--quantize flags every program that loads the model accepts."""
    parser.add_argument(
        "--model",
        default=None,
        help="bundled (default), tiny, a hub id, a model folder or a .gguf file (falls back to $LM_MODEL)",
    )
    parser.add_argument("--device", default=None, help="cuda, mps or cpu (default: the best found)")
    parser.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: per device)")
    parser.add_argument(
        "--quantize",
        default=None,
        choices=QUANTIZE,
        help="default: fp16 for a real model on an x86 CPU without native bfloat16 unless --dtype is given, else none; "
        "int8 or int4: weight-only quantized Linear layers on the CPU; bf16: a float32 model's weights in "
        "bfloat16; fp16: the weights in float16 through fbgemm (x86), float32 arithmetic; w8a8: int8 weights and int8 "
        "rows through fbgemm (x86); each used at the row counts where it is faster ($LM_QUANTIZE)",
    )
    parser.add_argument(
        "--kernels",
        default=None,
        choices=KERNELS,
        help="measure (default on the CPU): each Linear runs the product measured fastest at load for its row count; "
        "linear: torch's F.linear always ($LM_KERNELS)",
    )
    parser.add_argument(
        "--forward",
        default=None,
        choices=FORWARDS,
        help="own (default): the batched engine's step walks a Qwen2 or Llama model's layers itself, the same "
        "arithmetic in fewer calls (streaming/generation/decoder.py); transformers: through the model's own "
        "forward where it takes the step's layout (Qwen2; a Llama model refuses it and takes the own pass) ($LM_FORWARD)",
    )


def best_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX; Apple M2 and later).

    Where it does, bf16 is 3x float32 (measured on an AVX-512 BF16 EPYC: 46 ms against 133 ms a
    decode step). Where it doesn't, torch emulates it: on this project's AVX2-only Zen 1 a decode
    step is faster in bf16 (127 ms against 173 ms, less memory to read) but a 31-token prefill is
    2.2x slower (2.8 s against 1.3 s), and the prefill is the wait the reader feels first. So
    float32 there.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return sys.platform == "darwin" and platform.machine() == "arm64"
    return " avx512_bf16" in flags or " amx_bf16" in flags


def default_dtype(device: str) -> torch.dtype:
    """bfloat16 on CUDA and on a CPU with native bf16, float16 on MPS, else float32."""
    if device.startswith("cuda"):
        return torch.bfloat16
    if device == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def default_quantize(choice: Choice) -> str:
    """fp16 for a real model on an x86 CPU without native bfloat16 when no dtype was asked for,
    else none.

    Such a CPU computes in float32 (default_dtype), and there fbgemm's float16 weights run a decode
    step twice as fast as float32's (half the bytes a token; measured on the AVX2 kind: one reader
    12.8-13.2 against 6.0 tokens/s) with float32 arithmetic and the perplexity unchanged to the third
    decimal (67.762 both; README, "Choosing the model"): two-byte weights, as bfloat16 gives where
    the CPU has it. Left as it is: a dtype asked for (--dtype float32 is the model's own arithmetic,
    the article's), another device, the test models (their texts must be the same bits everywhere),
    and a torch without fbgemm (ARM)."""
    from streaming.model import quant  # (only here: quant imports the kernels' machinery)

    plain = choice.dtype is None and choice.device_name() == "cpu" and choice.torch_dtype() == torch.float32
    real = choice.model not in NAMED[1:]
    return "fp16" if plain and real and quant.fbgemm_available() else "none"


def check_device(device: str) -> None:
    """A device this torch can use, or a ModelError that says why not."""
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: this torch sees no CUDA device (a CPU-only build, or no GPU)")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError(f"--device {device}: this torch has no MPS (Apple silicon) backend here")
    if kind not in ("cpu", "cuda", "mps"):
        raise ModelError(f"unknown device {device!r}: choose cpu, cuda (cuda:N) or mps")


def check_model_name(name: str) -> None:
    if name.endswith(".gguf"):
        if not Path(name).is_file():
            raise ModelError(f"no such .gguf file: {name}")
        return
    if name in NAMED or Path(name).is_dir() or name.count("/") == 1:
        return
    raise ModelError(
        f"unknown model {name!r}: choose bundled (the default), tiny, exact, echo, a hub id such as "
        "Qwen/Qwen2.5-1.5B-Instruct, a model folder, or a path to a .gguf file"
    )
