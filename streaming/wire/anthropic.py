"""Anthropic's Messages API on the wire: the request check, errors, answers and named events.

The message object, and the stream of message_start, content_block_start/delta/stop,
message_delta, message_stop, ping and error events. Errors are {"type": "error", "error":
{"type", "message"}}. Leaves out what apis.py says.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from streaming.wire import sse
from streaming.wire.apis import ApiRequest, Finish, kind_of, stops
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.params import MAX_SEED, MAX_TOKENS, GenerationParams, number, unicode


def text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return unicode(content, where)
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return unicode("".join(b["text"] for b in content), where)
    raise InvalidRequest(f"{where} must be a string or a list of text blocks", where)


def named(event: str, value: Any) -> bytes:
    return sse.event(json.dumps(value, separators=(",", ":")), event=event)


class Anthropic:
    name = "anthropic"

    def error_body(self, err: ProtocolError) -> dict[str, Any]:
        kind = "overloaded_error" if err.kind == "overloaded" else kind_of(err.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": err.message}}

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        """A messages request body, checked; raises InvalidRequest."""
        if "max_tokens" not in body:
            raise InvalidRequest("max_tokens: Field required", "max_tokens")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages: a non-empty list is required", "messages")
        chat = []
        if body.get("system") is not None:
            chat.append({"role": "system", "content": text_of(body["system"], "system")})
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
                raise InvalidRequest(f"messages.{i}.role: must be user or assistant", f"messages.{i}.role")
            chat.append({"role": m["role"], "content": text_of(m.get("content"), f"messages.{i}.content")})
        if not any(m["content"] for m in chat if m["role"] != "system"):
            raise InvalidRequest("messages: all messages must have non-empty content", "messages")
        params = GenerationParams(
            max_tokens=number(body, "max_tokens", None, 1, MAX_TOKENS, True),
            seed=number(body, "seed", 0, 0, MAX_SEED, True, none_is_default=True),  # not Anthropic's; for tests
            temperature=number(body, "temperature", 1.0, 0, 1, none_is_default=True),
            top_p=number(body, "top_p", 1.0, 1e-6, 1, none_is_default=True),
            ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension (not Anthropic's), for measurements
        )
        return ApiRequest(chat, params, body.get("stream") is True, stops(body.get("stop_sequences"), "stop_sequences"))

    def models(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "type": "model", "display_name": model_id}

    def finish(self, reason: str | None, matched: str | None) -> Finish:
        if matched is not None:
            return Finish("stop_sequence", matched)
        return Finish("max_tokens" if reason == "length" else "end_turn")

    def whole(self, model: str, text: str, finish: Finish, prompt_tokens: int, completion_tokens: int) -> Any:
        return {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [{"type": "text", "text": text}],
            "stop_reason": finish.reason,
            "stop_sequence": finish.sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens},
        }

    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> AnthropicStream:  # noqa: ARG002
        return AnthropicStream(model, prompt_tokens)


class AnthropicStream:
    """The named events of one streamed message, as bytes."""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model, self.prompt_tokens = model, prompt_tokens  # may be set again before end() (an upstream's count)

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0},
        }
        return named("message_start", {"type": "message_start", "message": message}) + named(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )

    def text(self, piece: str) -> bytes:
        return named(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
        )

    def keep_alive(self, note: str = "ping") -> bytes:  # noqa: ARG002 - its ping event has no room for a note
        return named("ping", {"type": "ping"})  # Anthropic's own keep-alive event

    def end(self, finish: Finish, completion_tokens: int) -> bytes:
        delta = {"stop_reason": finish.reason, "stop_sequence": finish.sequence}
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": completion_tokens}
        return (
            named("content_block_stop", {"type": "content_block_stop", "index": 0})
            + named("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            + named("message_stop", {"type": "message_stop"})
        )

    def error(self, message: str) -> bytes:
        return named("error", {"type": "error", "error": {"type": "api_error", "message": message}})
