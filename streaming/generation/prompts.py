"""A request's prompt: plain text or a conversation (`Prompt`), and as token ids, plain text or
through the chat template, checked to fit the model's context with the answer it asks for. A
local engine reads the ids; an upstream engine (upstream/) sends the conversation."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from streaming.model.loading import Model
from streaming.wire.errors import InvalidRequest
from streaming.wire.params import GenerationParams


def encode_prompt(model: Model, prompt: str, params: GenerationParams) -> list[int]:
    """Token ids of the prompt; InvalidRequest if prompt and answer cannot fit the context."""
    return check_context(model, model.tokenizer(prompt).input_ids, params)


def encode_chat(
    model: Model,
    messages: list[dict[str, Any]],
    params: GenerationParams,
    continue_final: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the answer (or,
    `continue_final`, going on with its last message, an assistant's), with the tools offered."""
    how: dict[str, Any] = {"continue_final_message": True} if continue_final else {"add_generation_prompt": True}
    if tools:
        how["tools"] = tools
    text = model.tokenizer.apply_chat_template(template_messages(messages), tokenize=False, **how)
    return check_context(model, model.tokenizer(text, add_special_tokens=False).input_ids, params)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: a call's arguments as the object (the APIs carry
    JSON text, which the template would print as a quoted string)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


@dataclass(frozen=True)
class Prompt:
    """What a request asks: `text` (our own endpoints, /v1/completions) or `messages` (the
    other /v1/ APIs). `raw`: a text completion, which an upstream gets as one too (its
    /v1/completions), not as a user's message."""

    text: str | None = None
    messages: tuple[dict[str, Any], ...] = ()
    continue_final: bool = False
    raw: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # the tools offered, as the chat template takes them
    prefill: str = ""  # the answer's beginning, which the model continues (a required tool call's opening)

    def encode(self, model: Model, params: GenerationParams) -> list[int]:
        if self.messages:
            ids = encode_chat(model, list(self.messages), params, self.continue_final, list(self.tools))
            if self.prefill:
                ids = check_context(
                    model, ids + model.tokenizer(self.prefill, add_special_tokens=False).input_ids, params
                )
            return ids
        assert self.text is not None
        return encode_prompt(model, self.text, params)

    def chat(self) -> list[dict[str, Any]]:
        """As a conversation, for an upstream's Chat Completions: plain text is a user's message."""
        return list(self.messages) if self.messages else [{"role": "user", "content": self.text or ""}]

    def dumps(self) -> str:
        value = {"text": self.text, "messages": list(self.messages), "continue_final": self.continue_final}
        extra: dict[str, Any] = {"raw": True} if self.raw else {}
        extra |= {"tools": list(self.tools)} if self.tools else {}
        extra |= {"prefill": self.prefill} if self.prefill else {}
        return json.dumps(value | extra)

    @classmethod
    def loads(cls, data: str | bytes) -> Prompt:
        value = json.loads(data)
        tools = tuple(value.get("tools") or ())
        prefill = value.get("prefill") if isinstance(value.get("prefill"), str) else ""
        return cls(
            value["text"], tuple(value["messages"]), value["continue_final"], value.get("raw") is True, tools, prefill
        )


def check_context(model: Model, ids: list[int], params: GenerationParams) -> list[int]:
    context = model.context()
    if context and len(ids) + params.max_tokens > context:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds the context of {context}",
            "max_tokens",
        )
    return ids
