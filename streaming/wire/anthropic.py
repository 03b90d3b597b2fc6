"""Anthropic's Messages API on the wire: the request check, errors, answers and named events.

The message object, and the stream of message_start, content_block_start/delta/stop,
message_delta, message_stop, ping and error events. Errors are {"type": "error", "error":
{"type", "message"}}. Leaves out what apis.py says.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from typing import Any

from streaming.wire import sse
from streaming.wire.apis import ApiRequest, Call, Finish, kind_of, stops
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.params import MAX_SEED, MAX_TOKENS, MIN_SEED, GenerationParams, cache_salt, number, unicode
from streaming.wire.tools import anthropic_tools, call_arguments, call_name

TOOL_BLOCKS = ("tool_use", "tool_result")


def text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return unicode(content, where)
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return unicode("".join(b["text"] for b in content), where)
    raise InvalidRequest(f"{where} must be a string or a list of text blocks", where)


def turn(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One message as chat messages in OpenAI's form: its text, an assistant's tool_use blocks as
    tool_calls, a user's tool_result blocks as tool messages (before its text)."""
    if not isinstance(content, list) or not any(isinstance(b, dict) and b.get("type") in TOOL_BLOCKS for b in content):
        return [{"role": role, "content": text_of(content, where)}]
    texts, calls, results = [], [], []
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.{k}"
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(unicode(b["text"], at + ".text"))
        elif kind == "tool_use" and role == "assistant" and isinstance(b.get("name"), str):
            arguments = call_arguments(b.get("input", {}), at + ".input")
            call_id = b["id"] if isinstance(b.get("id"), str) else f"toolu_{k}"
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": call_name(b["name"], at + ".name"), "arguments": json.dumps(arguments)},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = b.get("content", "")
            results.append(
                {
                    "role": "tool",
                    "content": text_of(result, at + ".content"),
                    "tool_call_id": str(b.get("tool_use_id", "")),
                }
            )
        else:
            raise InvalidRequest(
                f"{at}: only text, tool_use (assistant) and tool_result (user) blocks are supported", at
            )
    if role == "assistant":
        return [{"role": role, "content": "".join(texts), "tool_calls": calls}]
    return results + ([{"role": role, "content": "".join(texts)}] if texts else [])


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
            chat += turn(m["role"], m.get("content"), f"messages.{i}.content")
        if not any(m["content"] or m.get("tool_calls") for m in chat if m["role"] != "system"):
            raise InvalidRequest("messages: all messages must have non-empty content", "messages")
        params = GenerationParams(
            max_tokens=number(body, "max_tokens", None, 1, MAX_TOKENS, True),
            seed=number(body, "seed", 0, MIN_SEED, MAX_SEED, True, none_is_default=True),  # not Anthropic's; for tests
            temperature=number(body, "temperature", 1.0, 0, 1, none_is_default=True),
            top_p=number(body, "top_p", 1.0, 0, 1, none_is_default=True),
            ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension (not Anthropic's), for measurements
            cache_salt=cache_salt(body),  # vLLM's extension: prefixes.py
        )
        stop = stops(body.get("stop_sequences"), "stop_sequences")
        tools = anthropic_tools(body)
        # A last assistant message is the answer's beginning, which the answer continues (Anthropic's
        # "prefill"); it was closed and a new turn begun, so the answer ignored it.
        prefill = chat[-1]["role"] == "assistant" and (chat[-1]["content"] != "" or bool(chat[-1].get("tool_calls")))
        if prefill and (chat[-1].get("tool_calls") or not chat[-1]["content"].strip()):
            at = f"messages.{len(messages) - 1}.content"
            raise InvalidRequest(f"{at}: a last assistant message (a prefill) must be text", at)
        if prefill and chat[-1]["content"] != chat[-1]["content"].rstrip():  # as Anthropic's API says
            at = f"messages.{len(messages) - 1}.content"
            raise InvalidRequest(f"{at}: final assistant content cannot end with trailing whitespace", at)
        if prefill and tools.choice == "required":
            raise InvalidRequest("tool_choice: a prefill cannot go with a tool_choice of any or tool", "tool_choice")
        return ApiRequest(chat, params, body.get("stream") is True, stop, tools=tools, continue_final=prefill)

    def models(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "type": "model", "display_name": model_id}

    def finish(self, reason: str | None, matched: str | None, called: bool = False) -> Finish:
        if matched is not None:
            return Finish("stop_sequence", matched)
        if reason == "length":
            return Finish("max_tokens")
        return Finish("tool_use" if called else "end_turn")

    def whole(
        self,
        model: str,
        text: str,
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        calls: Sequence[Call] = (),
    ) -> Any:
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c)} for c in calls]
        return {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": finish.reason,
            "stop_sequence": finish.sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens},
        }

    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> AnthropicStream:  # noqa: ARG002
        return AnthropicStream(model, prompt_tokens)


def tool_input(call: Call) -> Any:
    """A call's input object (a cut call's arguments are not one: then {})."""
    try:
        return json.loads(call.arguments) if call.complete else {}
    except ValueError:
        return {}


class AnthropicStream:
    """The named events of one streamed message, as bytes. Its content blocks are numbered in
    order, each begun by what it holds: a text block at the first text, a tool_use block at each
    call, text after one a new block. (Block 0 was a text block begun at once, and an answer that
    began with a call, as every forced call does, streamed it empty: the real API never sends one,
    refuses one sent back, and our whole answer has none.)"""

    def __init__(self, model: str, prompt_tokens: int) -> None:
        self.id = "msg_" + secrets.token_hex(12)
        self.model, self.prompt_tokens = model, prompt_tokens  # may be set again before end() (an upstream's count)
        self.block = -1  # the last block begun
        self.open: str | None = None  # its kind while it is open (None: closed, or none yet)

    def start_block(self, block: dict[str, Any]) -> bytes:
        self.block, self.open = self.block + 1, block["type"]
        return named(
            "content_block_start", {"type": "content_block_start", "index": self.block, "content_block": block}
        )

    def stop_block(self) -> bytes:
        if self.open is None:
            return b""
        self.open = None
        return named("content_block_stop", {"type": "content_block_stop", "index": self.block})

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
        return named("message_start", {"type": "message_start", "message": message})

    def text(self, piece: str) -> bytes:
        out = b"" if self.open == "text" else self.stop_block() + self.start_block({"type": "text", "text": ""})
        return out + named(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.block, "delta": {"type": "text_delta", "text": piece}},
        )

    def call_start(self, index: int, call_id: str, name: str) -> bytes:  # noqa: ARG002 - blocks have their own numbers
        return self.stop_block() + self.start_block({"type": "tool_use", "id": call_id, "name": name, "input": {}})

    def call_args(self, index: int, delta: str) -> bytes:  # noqa: ARG002
        value = {
            "type": "content_block_delta",
            "index": self.block,
            "delta": {"type": "input_json_delta", "partial_json": delta},
        }
        return named("content_block_delta", value)

    def call_end(self, index: int) -> bytes:  # noqa: ARG002
        return self.stop_block()

    def keep_alive(self, note: str = "ping") -> bytes:  # noqa: ARG002 - its ping event has no room for a note
        return named("ping", {"type": "ping"})  # Anthropic's own keep-alive event

    def end(self, finish: Finish, completion_tokens: int) -> bytes:
        delta = {"stop_reason": finish.reason, "stop_sequence": finish.sequence}
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": completion_tokens}
        empty = self.start_block({"type": "text", "text": ""}) if self.block < 0 else b""  # (as whole()'s content)
        return (
            empty
            + self.stop_block()
            + named("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
            + named("message_stop", {"type": "message_stop"})
        )

    def error(self, message: str, status: int = 500) -> bytes:
        kind = kind_of(status, "api_error")
        return named("error", {"type": "error", "error": {"type": kind, "message": message}})
