"""`Model`: a chosen model, loaded on first use, as the generation layer receives it.

A `Model` holds a `Choice` (choice.py) and loads its tokenizer and its network once, when first
asked (the server listens first and loads in a thread): the bundled model and .gguf files from
their converted folders (bundled.py), `tiny` and `exact` made in place (testing.py), a hub id or a
folder through transformers; in the chosen dtype, on the chosen device, quantized if asked
(quant.py). It also knows what every engine asks of a model: the ids that end an answer, the
context length, the keywords of a forward call with a KV cache in this transformers version, and
the facts /metrics.json shows. Tests make one around a network of their own (`net=`).

Leaves out: multi-device placement, and batching (the engines' business).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from streaming.model import bundled, fusing, kernels, quant, smooth
from streaming.model.choice import NAMED, Choice, ModelError, check_model_name
from streaming.model.testing import EchoModel, ExactModel, tiny_model

log = logging.getLogger("streaming.model")


class Model:
    def __init__(self, choice: Choice | None = None, *, net: Any = None, tokenizer: Any = None) -> None:
        self.choice = choice or Choice()
        self._net, self._tokenizer = net, tokenizer
        self._stop_ids: frozenset[int] | None = None
        self._vocabulary: int | None = None
        # The context length as told by an engine process that loaded the network (process.py):
        # this process then never loads it (its tokenizer encodes prompts).
        self.known_context: int | None = None
        self.context_told = False
        self.lock = threading.Lock()  # the loader thread and a first request may both ask

    @property
    def device(self) -> str:
        return self.choice.device_name()

    @property
    def loaded(self) -> bool:
        return self._net is not None

    def choose(
        self,
        model: str | None = None,
        device: str | None = None,
        dtype: str | None = None,
        quantize: str | None = None,
        kernels: str | None = None,
        forward: str | None = None,
    ) -> None:
        """Change the choice (checked); only before the tokenizer or the network is loaded (the
        forward may change later: it is read at each step)."""
        if (self._net is not None or self._tokenizer is not None) and (model or device or dtype or quantize or kernels):
            raise ModelError("configure() must come before the model or tokenizer is first used")
        self.choice.update(model, device, dtype, quantize, kernels, forward)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            with self.lock:
                if self._tokenizer is None:
                    self._tokenizer = load_tokenizer(self.choice)
        return self._tokenizer

    @property
    def net(self) -> Any:
        """The network, in eval mode on the device in the chosen dtype; loaded on the first use."""
        if self._net is None:
            tokenizer = self.tokenizer
            with self.lock:
                if self._net is None:
                    self._net = load_net(self.choice, tokenizer)
        return self._net

    def stop_ids(self) -> frozenset[int]:
        """Token ids that end an answer: EOS, and <|endoftext|> for Qwen (raw continuations end so)."""
        if self._stop_ids is None:
            self._stop_ids = stop_ids(self.tokenizer)
        return self._stop_ids

    def vocabulary(self) -> int:
        """How many token ids the network reads: its embedding's rows, else its config's vocab_size.
        An id past them is an index error on a CPU but a device-side assert on a GPU, after which
        every CUDA call of the process fails: Job.begin refuses such an id before any kernel runs."""
        if self._vocabulary is None:
            embed = self.net.get_input_embeddings() if hasattr(self.net, "get_input_embeddings") else None
            self._vocabulary = int(getattr(embed, "num_embeddings", 0) or self.net.config.vocab_size)
        return self._vocabulary

    def context(self) -> int | None:
        """The most tokens it reads (prompt and answer), if its config says."""
        if self._net is None and self.context_told:
            return self.known_context
        return getattr(self.net.config, "max_position_embeddings", None)

    def facts(self) -> dict[str, Any]:
        """For /metrics.json: which model, where, in what."""
        return {
            "model": self.choice.model,
            "device": self.device,
            "dtype": str(self.choice.torch_dtype()).removeprefix("torch."),
            "quantize": self.choice.quantization(),
            "kernels": getattr(self._net, "kernel_tables", None) or self.choice.kernel_choice(),
        }

    def served_name(self) -> str:
        return served_name(self.choice.model)


def load_and_say(model: Model, where: str = "") -> str:
    """Load the network and say what was loaded, in the line the server prints and its launcher
    waits for ('model ... ready in 2.2 s; kernels: ...'): the same whether the server or its
    engine process (`where`) loaded it."""
    t0 = time.perf_counter()
    net = in_one_line(model, lambda: model.net)
    took = time.perf_counter() - t0
    facts = model.facts()
    dtype = facts["dtype"] + (f", {facts['quantize']} Linear layers" if facts["quantize"] != "none" else "")
    tables = getattr(net, "kernel_tables", None)
    chosen = kernels.describe(tables) if tables else "F.linear at every row count"
    return f"model {facts['model']} on {facts['device']} in {dtype}, ready in {took:.1f} s{where}; kernels: {chosen}"


def in_one_line(model: Model, load: Callable[[], Any]) -> Any:
    """`load()` (the model's network or tokenizer), any failure a ModelError of one line: the
    server prints it and exits, whichever process loaded what."""
    try:
        from huggingface_hub.utils import logging as hub_logging

        hub_logging.set_verbosity_error()  # a hub id offline: one line at the end, not five retry warnings
        return load()
    except ModelError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' many ways to fail (offline hub, bad folder): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"could not load the model {model.choice.model}: {first}") from None


def load_tokenizer(choice: Choice) -> Any:
    from transformers import AutoTokenizer  # (seconds to import: only when a model is used)

    name = choice.model
    check_model_name(name)
    if name in NAMED:
        source = str(bundled.ensure_tokenizer(bundled.bundled_gguf, bundled.bundled_folder()))
    elif name.endswith(".gguf"):
        p = Path(name).resolve()
        source = str(bundled.ensure_tokenizer(lambda: p, bundled.gguf_folder(p)))
    else:
        source = name
    return AutoTokenizer.from_pretrained(source)


def load_net(choice: Choice, tokenizer: Any) -> Any:
    from transformers import AutoModelForCausalLM

    name, dtype, device, mode = choice.model, choice.torch_dtype(), choice.device_name(), choice.quantization()
    check_model_name(name)
    if mode == "bf16" and str(dtype) != "torch.float32":
        raise ModelError(f"--quantize bf16 halves a float32 model's weights; this one is {dtype}: use --dtype float32")
    if mode in quant.FBGEMM and not quant.fbgemm_available():
        raise ModelError(f"--quantize {mode} runs fbgemm's kernels, which this build of torch lacks (x86 only)")
    if name == "tiny":
        m = tiny_model(tokenizer)
    elif name == "exact":
        m = ExactModel(tokenizer)
    elif name == "echo":
        m = EchoModel(tokenizer)
    elif name == "bundled":
        folder = bundled.ensure_model(bundled.bundled_gguf, bundled.bundled_folder())
        m = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    elif name.endswith(".gguf"):  # converted once into the cache, as the bundled model is
        p = Path(name).resolve()
        m = AutoModelForCausalLM.from_pretrained(
            str(bundled.ensure_model(lambda: p, bundled.gguf_folder(p))), dtype=dtype
        )
    else:
        m = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    m = m.to(device=device, dtype=dtype).eval()
    if choice.kernel_choice() == "measure":  # the CPU's own kernels: fewer, larger products (fusing.py)
        fusing.fuse(m, mode)
    if mode != "none":
        if device != "cpu":
            raise ModelError(f"--quantize {mode} uses torch's CPU kernels: use --device cpu")
        m = quant.quantize(m, mode, calibration=smooth.calibration_ids(tokenizer))
    if choice.kernel_choice() == "measure":  # the CPU only
        kernels.wrap(m)  # the layers quantize left dense (all of them unquantized, or int4's odd shapes)
        t0 = time.perf_counter()
        tables = kernels.measure(m, bundled.CACHE, step=lambda n: whole_pass(m, n))
        setattr(m, "kernel_tables", tables)  # noqa: B010 - on the network: Model.facts and load_and_say read it
        log.info("kernels chosen in %.1f s: %s", time.perf_counter() - t0, kernels.describe(tables))
    return m


def whole_pass(m: Any, n: int) -> Any:
    """One forward pass of the model over n tokens, no cache (kernels.py and judging.py: n rows through every
    Linear layer, as the batched engine's flat steps run them; the logits of at most ROWS[-1] of
    them, as many as a step keeps)."""
    import torch

    keep = {"logits_to_keep": min(n, kernels.ROWS[-1])} if "logits_to_keep" in _forward_parameters(m.__class__) else {}
    with torch.inference_mode():
        return m(input_ids=torch.full((1, n), 100, device=m.device), use_cache=False, **keep)


def stop_ids(tokenizer: Any) -> frozenset[int]:
    ids = {tokenizer.eos_token_id}
    for special in ("<|endoftext|>", "<|im_end|>"):
        i = tokenizer.convert_tokens_to_ids(special)
        if isinstance(i, int) and i != tokenizer.unk_token_id:
            ids.add(i)
    return frozenset(i for i in ids if i is not None)


def served_name(name: str) -> str:
    """The model's short name, as /v1/models gives it: the bundled model's, a .gguf file's stem,
    a folder's name, or a hub id as it is."""
    if name == "bundled":
        return bundled.BUNDLED_NAME.removesuffix("-q4_k_m")
    if name.endswith(".gguf") or Path(name).is_dir():
        return Path(name).resolve().name.removesuffix(".gguf")
    return name


@functools.cache
def _forward_parameters(cls: Any) -> frozenset[str]:
    return frozenset(inspect.signature(cls.forward).parameters)


def forward_kwargs(m: Any, cache: Any) -> dict[str, Any]:
    """The keywords of a model call with this KV cache, by transformers version: the cache is
    `cache` in transformers 5 and `past_key_values` in 4.x; and `logits_to_keep=1` where the model
    takes it (a prefill then computes only the last position's logits: 25% less work)."""
    names = _forward_parameters(m.__class__)
    kw: dict[str, Any] = {"cache" if "cache" in names else "past_key_values": cache}
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = 1
    return kw


def step_kwargs(m: Any, cache: Any, keep: Any) -> dict[str, Any]:
    """The keywords of the batched engine's step (generation/batch.py): its cache, and the
    positions whose logits it needs (`keep`, a 1-D tensor) where the model takes them (a model
    that does not returns every position's: the caller picks)."""
    names = _forward_parameters(m.__class__)
    kw: dict[str, Any] = {"cache" if "cache" in names else "past_key_values": cache}
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = keep
    return kw
