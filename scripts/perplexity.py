"""Quality of a quantized model: its perplexity on the human continuations of prompts.json.

Each of prompts.json's prompts is followed by the text a person wrote; the perplexity is
exp(mean negative log-likelihood) of those continuation tokens given the prompt, for each
`--quantize` mode in one run (every product through the quantized kernel, as at batch 1) (the same model, dtype and texts), with the decode speed of each at
batch 1. The issue's bar: int8 within 2% of the dense model.

    python scripts/perplexity.py [--model bundled] [--modes none int8 int4] [--texts 20]

Saves results/perplexity.json. Leaves out: longer benchmarks of quality (a 20-text perplexity
says whether the quantization broke something, not a fine ranking).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import lm  # noqa: E402
from streaming.model import quant, smooth  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def texts(n: int) -> list[tuple[list[int], list[int]]]:
    items = json.loads((ROOT / "prompts.json").read_text())[:n]
    out = []
    for item in items:
        prompt = lm.tok(item["prompt"]).input_ids
        whole = lm.tok(item["prompt"] + item["human"]).input_ids
        out.append((whole[: len(prompt)], whole[len(prompt) :]))  # the prompt's tokens, then the human's
    return out


def perplexity(m, pairs) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for prompt, human in pairs:
            ids = torch.tensor([prompt + human], device=lm.DEVICE)
            logits = m(input_ids=ids).logits[0, len(prompt) - 1 : -1].to(torch.float32)
            nll += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum"))
            count += len(human)
    return math.exp(nll / count)


def decode_ms(m, steps: int = 16) -> float:
    """Median time of a batch-1 decode step after a 32-token prompt."""
    from transformers import DynamicCache

    cache = DynamicCache(config=m.config)
    times = []
    with torch.inference_mode():
        m(input_ids=torch.arange(100, 132, device=lm.DEVICE)[None], **lm.forward_kwargs(m, cache))
        for i in range(steps):
            t0 = time.perf_counter()
            m(input_ids=torch.tensor([[200 + i]], device=lm.DEVICE), **lm.forward_kwargs(m, cache))
            times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[steps // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    lm.add_arguments(p)
    p.add_argument("--modes", nargs="+", default=list(quant.MODES), choices=quant.MODES)
    p.add_argument("--texts", type=int, default=20)
    p.add_argument("--results", default=str(ROOT / "results"))
    args = p.parse_args()
    # Plain Linear layers (no kernel tables): quantize() replaces torch Linears only, and every
    # product of a mode must go through its kernel (with measured tables the layers were already
    # wrapped, nothing was quantized, and every mode scored as the dense model).
    args.quantize, args.kernels = "none", "linear"
    lm.configure(args)
    pairs = texts(args.texts)
    dense = lm.model()
    rows = {}
    ids = smooth.calibration_ids(lm.tok)  # w8a8's calibration text (the other modes ignore it)
    for mode in args.modes:
        t0 = time.perf_counter()
        m = quant.quantize(copy.deepcopy(dense), mode, 1 << 30, ids) if mode != "none" else dense
        if mode != "none" and not any(isinstance(x, quant.QuantLinear) for x in m.modules()):
            raise SystemExit(f"--quantize {mode} replaced no layer: nothing to measure")
        took = time.perf_counter() - t0
        rows[mode] = {"perplexity": round(perplexity(m, pairs), 4), "decode_ms": round(decode_ms(m), 1)}
        rows[mode]["quantize_s"] = round(took, 2)
    base = rows.get("none", {}).get("perplexity")
    print(f"model {lm.model_name()}, {lm.dtype()}, {sum(len(h) for _, h in pairs)} tokens of {len(pairs)} texts")
    print(f"{'mode':6} {'perplexity':>10} {'vs none':>8} {'decode ms':>10} {'tokens/s':>9}")
    for mode, r in rows.items():
        ratio = f"{r['perplexity'] / base - 1:+.1%}" if base else ""
        print(f"{mode:6} {r['perplexity']:>10.3f} {ratio:>8} {r['decode_ms']:>10.1f} {1000 / r['decode_ms']:>9.1f}")
    out = Path(args.results) / "perplexity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": lm.model_name(), "dtype": str(lm.dtype()), "modes": rows}, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
