"""What this server asks an upstream engine, and what it takes of the counts it is told: the body
of a streaming Chat Completions request (or a text completion's), and an answer's usage.

Pure: a request's parameters and prompt in, bytes out; a usage object in, counts out.
Leaves out: the connection, the retries and the relaying (relay.py), the choice of upstream (pool.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from streaming.generation.prompts import Prompt
from streaming.wire.params import GenerationParams

# The largest token count an upstream's usage may say: no context comes near it, and a count of
# hundreds of digits (JSON allows 4,300) overflowed the metrics' float sums, failing the answer.
MAX_COUNT = 1 << 31


def body(
    model: str,
    p: GenerationParams,
    prompt: Prompt | None,
    messages: list[dict[str, Any]],
    so_far: str = "",
    produced: int = 0,
) -> bytes:
    """A streaming request with usage for the answer's rest (`so_far`: its text already sent, in
    `produced` pieces, which the upstream continues): to /v1/chat/completions, or for a raw
    prompt to /v1/completions (the prompt and the text so far as they are)."""
    out: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": p.max_tokens - produced,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "seed": p.seed,
    }
    if p.ignore_eos:
        out["ignore_eos"] = True  # vLLM's extension, and this server's
    if p.cache_salt is not None:
        out["cache_salt"] = p.cache_salt  # vLLM's too: the upstream's prefix cache keeps the tenants apart
    if prompt is not None and prompt.tools:
        out["tools"] = list(prompt.tools)  # (the calls come back as tool_calls deltas)
        if prompt.prefill:  # a required call: the upstream is asked for one (and which)
            named = re.search(r'"name": ("(?:[^"\\]|\\.)*")', prompt.prefill)
            function = {"name": json.loads(named[1])} if named else None
            out["tool_choice"] = {"type": "function", "function": function} if function else "required"
    if prompt is not None and prompt.raw:
        del out["messages"]
        out["prompt"] = (prompt.text or "") + so_far
    elif prompt is not None and prompt.continue_final:  # the last (assistant) message goes on (a prefill)
        last = messages[-1]
        out["messages"] = [*messages[:-1], {**last, "content": (last.get("content") or "") + so_far}]
        out.update(continue_final_message=True, add_generation_prompt=False)
    elif so_far:
        out["messages"] = [*messages, {"role": "assistant", "content": so_far}]
        out.update(continue_final_message=True, add_generation_prompt=False)
    return json.dumps(out).encode()


def counts(usage: dict[str, Any], url: str) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of an upstream's usage, each None where it is absent or
    not a count (a token count is a whole number from 0 to MAX_COUNT: anything else is ignored,
    with a warning)."""

    def count(name: str) -> int | None:
        value = usage.get(name)
        if value is not None and (type(value) is not int or not 0 <= value <= MAX_COUNT):
            print(f"upstream {url} sent usage {name}={value!r:.40}: not a count, ignored", flush=True)
            return None
        return value

    return count("prompt_tokens"), count("completion_tokens")
