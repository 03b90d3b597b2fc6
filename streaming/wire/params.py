"""A request's generation parameters, checked once, as one frozen value every layer passes on.

`GenerationParams` is what the engines and `lm.tokens` take; `number()` and `flag()` are the one
validator of a JSON member, shared by our own request format (`plain_request`, here) and the
APIs' (openai.py, anthropic.py); `stream_interval` checks a request's pieces per event, which is
no generation parameter (the server's relay reads it). A failed check raises `InvalidRequest`
naming the field.

Leaves out: the prompt's encoding into token ids and the context check, which need the model's
tokenizer (streaming.generation.prompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from streaming.wire.errors import InvalidRequest

MAX_TOKENS = 4096  # per request: past it a check fails. Bounds one request's KV cache and time.
DEFAULT_MAX_TOKENS = 100  # the article's
MAX_SEED = 2**63 - 1  # a 64-bit integer (decoding.uniform mixes it in 64-bit arithmetic)
MIN_SEED = -(2**63)  # the OpenAI and Anthropic formats take any 64-bit integer, negative too (as OpenAI's and vLLM's)
# Pieces per event a request or --stream-interval may ask for: past 64 (~250 characters) the text
# a reader waits for is a whole sentence behind, and the per-event cost saved is already under 2%.
MAX_STREAM_INTERVAL = 64
# A request's cache_salt (vLLM's extension): a secret of the caller's, so at most a few hundred
# characters (vLLM's docs suggest 43, 256 bits in base64); bounded, as every string it keeps is.
MAX_CACHE_SALT = 1024


# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits divided by one under ~3e-38
# overflow float32 (every probability NaN: the step failed, and every request in its batch), and
# long before that the draw is the largest logit's anyway.
GREEDY_BELOW = 1e-5
# A top_p below this keeps the likeliest token alone, as this one does: the OpenAI and Anthropic
# formats take top_p from 0 (their range), the sampler a nucleus of (0, 1].
TOP_P_LEAST = 1e-6


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    seed: int = 0
    temperature: float = 1.0  # 0 is greedy (and below GREEDY_BELOW)
    top_p: float = 0.9
    ignore_eos: bool = False  # vLLM's extension: exactly max_tokens, for measurements
    # vLLM's extension: the prompt's keys are shared only with requests of the same salt (prefixes.py)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if self.top_p < TOP_P_LEAST:
            object.__setattr__(self, "top_p", TOP_P_LEAST)


class PlainRequest(NamedTuple):
    """A request in our own format (/complete, /stream, /ws): the prompt and its parameters."""

    prompt: str
    params: GenerationParams


def number(
    body: dict[str, Any],
    name: str,
    default: Any,
    low: float,
    high: float,
    integer: bool = False,
    none_is_default: bool = False,
) -> Any:
    """The member `name` of a JSON object, checked to lie in [low, high] (an integer if asked);
    `default` when absent (or null, where an API allows that)."""
    value = body.get(name, default)
    if value is None and none_is_default:
        return default
    number = isinstance(value, int) or (isinstance(value, float) and not integer)
    if isinstance(value, bool) or not number or not low <= value <= high:
        raise InvalidRequest(f"{name} must be {'an integer' if integer else 'a number'} from {low} to {high}", name)
    return value


def flag(body: dict[str, Any], name: str) -> bool:
    """A boolean member, false when absent."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false", name)
    return value


def unicode(text: str, name: str) -> str:
    """A string that can be encoded: JSON's "\\ud800" escapes give Python lone surrogates, which
    no tokenizer (and no UTF-8 encoder) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name} is not valid Unicode: it holds a lone surrogate", name) from None
    return text


def plain_request(body: dict[str, Any]) -> PlainRequest:
    """Check a request in our format ({"prompt", "max_tokens", "seed", "temperature", "top_p",
    "ignore_eos"}); raise InvalidRequest (400 for a missing prompt, else 422)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be a string", "prompt", 422 if "prompt" in body else 400)
    if not prompt:
        raise InvalidRequest("prompt must not be empty", "prompt")
    unicode(prompt, "prompt")
    params = GenerationParams(
        max_tokens=number(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS, integer=True),
        seed=number(body, "seed", 0, 0, MAX_SEED, integer=True),
        temperature=number(body, "temperature", 1.0, 0, 100),
        top_p=number(body, "top_p", 0.9, 1e-6, 1.0),
        ignore_eos=flag(body, "ignore_eos"),
        cache_salt=cache_salt(body),
    )
    return PlainRequest(prompt, params)


def cache_salt(body: dict[str, Any]) -> str | None:
    """A request's `cache_salt` (vLLM's extension to the OpenAI formats): None when absent or
    null, else a non-empty string of at most MAX_CACHE_SALT characters. Requests with a salt share
    computed keys (a system prompt, a conversation's earlier turns) only with requests of the
    same salt, so a sooner first text tells a client nothing of other tenants' prompts."""
    value = body.get("cache_salt")
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT:
        raise InvalidRequest(
            f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT} characters", "cache_salt"
        )
    return unicode(value, "cache_salt")


def stream_interval(body: dict[str, Any], where: str = "") -> int | None:
    """A request's pieces per event after the first (`stream_interval`: vLLM's and SGLang's
    --stream-interval, per request here), or None for the server's; `where` prefixes the name
    in errors (OpenAI's `stream_options.`)."""
    try:
        value: int | None = number(body, "stream_interval", None, 1, MAX_STREAM_INTERVAL, True, none_is_default=True)
    except InvalidRequest as e:
        raise InvalidRequest(where + e.message, where + "stream_interval") from None
    return value


def query_body(query: dict[str, str]) -> dict[str, Any]:
    """A GET request's parameters (`?prompt=...&max_tokens=20`) as the JSON body a POST sends:
    every value but the texts (the prompt, a cache_salt: `12345678` is a salt, not a number) read
    as JSON (numbers, true/false), else kept as text for plain_request to reject."""
    body: dict[str, Any] = {}
    for name, value in query.items():
        try:
            body[name] = value if name in ("prompt", "cache_salt") else json.loads(value)
        except (ValueError, RecursionError):  # not JSON, too many digits, nested too deeply
            body[name] = value
    return body
