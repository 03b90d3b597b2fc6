"""A request's prompt as token ids: plain text, or a conversation through the chat template;
either way checked to fit the model's context with the answer it asks for."""

from __future__ import annotations

import lm
from streaming.wire.errors import InvalidRequest
from streaming.wire.params import GenerationParams


def encode_prompt(prompt: str, params: GenerationParams) -> list[int]:
    """Token ids of the prompt; InvalidRequest if prompt and answer cannot fit the context."""
    return check_context(lm.tok(prompt).input_ids, params)


def encode_chat(messages: list[dict[str, str]], params: GenerationParams) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the answer."""
    text = lm.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return check_context(lm.tok(text, add_special_tokens=False).input_ids, params)


def check_context(ids: list[int], params: GenerationParams) -> list[int]:
    context = getattr(lm.model().config, "max_position_embeddings", None)
    if context and len(ids) + params.max_tokens > context:
        raise InvalidRequest(
            f"prompt of {len(ids)} tokens plus max_tokens {params.max_tokens} exceeds the context of {context}",
            "max_tokens",
        )
    return ids
