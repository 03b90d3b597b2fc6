"""OpenAI's text completions on the wire (POST /v1/completions): the request check, the
text_completion answer and its stream chunks.

What benchmark tools and eval harnesses call by default (guidellm, `vllm bench serve`,
lm-eval): the prompt goes to the model as it is, with no chat template. The stream is
text_completion chunks, `choices[0].text` each, a last chunk with `finish_reason`, a usage
chunk with `stream_options.include_usage`, then `data: [DONE]`. Errors are OpenAI's.

Leaves out: several prompts in one request (a list of more than one), prompts as token ids,
`echo`, `logprobs`, `suffix`, `best_of` and `n` above 1 (each a clear 400), and what apis.py says.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from streaming.wire import sse
from streaming.wire.apis import ApiRequest, Call, Finish, kind_of, stops
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.openai import OpenAI, usage
from streaming.wire.params import (
    MAX_SEED,
    MAX_TOKENS,
    MIN_SEED,
    GenerationParams,
    cache_salt,
    number,
    stream_interval,
    unicode,
)

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions (not chat's)
UNSUPPORTED = ("suffix", "logprobs", "best_of", "logit_bias")  # refused when given, never ignored


def prompt_of(value: Any) -> str:
    """The one prompt of a request: a string, or a list holding one string."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise InvalidRequest("prompt is empty", "prompt")
        return unicode(value, "prompt")
    if isinstance(value, list) and value and all(isinstance(v, (int, list)) for v in value):
        raise InvalidRequest("prompts as token ids are not supported: send the text", "prompt")
    if isinstance(value, list) and len(value) > 1:
        raise InvalidRequest("one prompt per request: a list of several is not supported", "prompt")
    raise InvalidRequest("prompt must be a string (or a list of one string)", "prompt")


class Completions:
    name = "completions"

    def error_body(self, err: ProtocolError) -> dict[str, Any]:
        return OpenAI().error_body(err)

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        """A completions.create body, checked; raises InvalidRequest naming the param."""
        text = prompt_of(body.get("prompt"))
        for name in UNSUPPORTED:
            if body.get(name) is not None:
                raise InvalidRequest(f"{name} is not supported", name)
        if body.get("echo") is True:
            raise InvalidRequest("echo is not supported", "echo")
        number(body, "n", 1, 1, 1, True, none_is_default=True)  # n must be 1 (or absent): a 400 naming it
        params = GenerationParams(
            max_tokens=number(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS, True, none_is_default=True),
            seed=number(body, "seed", 0, MIN_SEED, MAX_SEED, True, none_is_default=True),
            temperature=number(body, "temperature", 1.0, 0, 2, none_is_default=True),
            top_p=number(body, "top_p", 1.0, 0, 1, none_is_default=True),
            ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension, for measurements
            cache_salt=cache_salt(body),  # vLLM's extension: prefixes.py
        )
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        return ApiRequest(
            [],
            params,
            stream=body.get("stream") is True,
            stop=stops(body.get("stop"), "stop"),
            include_usage=options.get("include_usage") is True,
            stream_interval=stream_interval(options, "stream_options."),  # our extension
            text=text,
        )

    def models(self, model_id: str) -> dict[str, Any]:
        return OpenAI().models(model_id)

    def finish(self, reason: str | None, matched: str | None, called: bool = False) -> Finish:  # noqa: ARG002
        return OpenAI().finish(reason, matched)

    def whole(
        self,
        model: str,
        text: str,
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        calls: Sequence[Call] = (),  # noqa: ARG002 - a text completion offers no tools
    ) -> Any:
        return {
            "id": "cmpl-" + secrets.token_hex(12),
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
            "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish.reason}],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> CompletionsStream:
        return CompletionsStream(model, prompt_tokens, request.include_usage)


class CompletionsStream:
    """The text_completion chunks of one answer, as bytes."""

    def __init__(self, model: str, prompt_tokens: int = 0, include_usage: bool = False) -> None:
        self.id, self.created = "cmpl-" + secrets.token_hex(12), int(time.time())
        self.model, self.prompt_tokens, self.include_usage = model, prompt_tokens, include_usage

    def chunk(self, choices: list[Any], use: dict[str, int] | None = None) -> bytes:
        value: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            value["usage"] = use
        return sse.event(json.dumps(value, separators=(",", ":")))

    def start(self) -> bytes:
        return b""  # no role chunk: a completion's first chunk is its first text

    def text(self, piece: str) -> bytes:
        return self.chunk([{"text": piece, "index": 0, "logprobs": None, "finish_reason": None}])

    # A text completion offers no tools: its answer has no calls to send.
    def call_start(self, index: int, call_id: str, name: str) -> bytes:  # noqa: ARG002
        return b""

    def call_args(self, index: int, delta: str) -> bytes:  # noqa: ARG002
        return b""

    def call_end(self, index: int) -> bytes:  # noqa: ARG002
        return b""

    def keep_alive(self, note: str = "ping") -> bytes:
        return sse.comment(note)

    def end(self, finish: Finish, completion_tokens: int) -> bytes:
        out = self.chunk([{"text": "", "index": 0, "logprobs": None, "finish_reason": finish.reason}])
        if self.include_usage:
            out += self.chunk([], usage(self.prompt_tokens, completion_tokens))
        return out + sse.DONE

    def error(self, message: str, status: int = 500) -> bytes:
        body = {"error": {"message": message, "type": kind_of(status, "server_error"), "param": None, "code": None}}
        return sse.event(json.dumps(body))
