"""A model folder in a real model's shape with seeded random weights: for timing the engine on a
machine that the weights cannot reach (a lent GPU takes 64 MiB of files; the bundled model's
weights are 2.4 GB), and for the article's Qwen2.5-1.5B, whose weights no package here holds.

    python scripts/shaped_model.py OUT [--shape bundled|1.5b] [--source FOLDER] [--device cuda]

The config and the tokenizer come from --source (default: the bundled model's folder, which
needs only its config.json and tokenizer files); `1.5b` changes the sizes to Qwen2.5-1.5B's.
Timings of such a model are the real model's (the same products, cache and sampling) as long as
every answer is made the same length (`ignore_eos`; the benchmarks do), and its distributions
are peaked as a trained model's are: the output layer is scaled so that logits spread by about
5, and the vocabulary's padding rows (past the tokenizer's ids) are zero, so that they are never
sampled (the peer's equal-work trick names one of them as its end of sequence).

Leaves out: the text. It is gibberish; nothing here measures quality.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

# Qwen2.5-1.5B-Instruct's config.json, the sizes that differ from the 0.5B's (the article's model)
SHAPES = {
    "bundled": {},
    "1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    },
}
LOGIT_SPREAD = 5.0  # std of the logits: a trained model's next token is a few candidates, not the vocabulary
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make(out: Path, shape: str, source: Path, device: str, dtype: torch.dtype) -> dict:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    config = json.loads((source / "config.json").read_text())
    config.update(SHAPES[shape])
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    config["architectures"] = ["Qwen2ForCausalLM"]
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    tok = AutoTokenizer.from_pretrained(str(out))
    # the real tokens: the GGUF's tokenizer names the vocabulary's padding rows [PAD<id>]
    vocab = next((i for i in range(len(tok)) if tok.convert_ids_to_tokens(i).startswith("[PAD")), len(tok))
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(Qwen2Config(**config)).to(dtype)
    with torch.no_grad():
        head = m.get_output_embeddings().weight
        # logits = normed hidden (RMS 1) . row: a row of std s spreads them by s * sqrt(hidden)
        head.mul_(LOGIT_SPREAD / (head.float().std().item() * config["hidden_size"] ** 0.5))
        head[vocab:] = 0
    m.config.dtype = str(dtype).removeprefix("torch.")
    m.save_pretrained(str(out))
    params = sum(p.numel() for p in m.parameters())
    return {"shape": shape, "parameters": params, "vocabulary": vocab, "folder": str(out)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", choices=list(SHAPES), default="bundled")
    p.add_argument("--source", type=Path, default=None, help="a folder with config.json and the tokenizer")
    p.add_argument("--device", default="cpu", help="where the weights are made (cuda: seconds for 1.5B)")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args(argv)
    if args.source is None:
        from streaming.model import bundled

        args.source = bundled.bundled_folder()
    t0 = time.perf_counter()
    facts = make(args.out, args.shape, args.source, args.device, getattr(torch, args.dtype))
    print(
        f"{facts['shape']}: {facts['parameters'] / 1e9:.2f} B parameters in {args.out} ({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
