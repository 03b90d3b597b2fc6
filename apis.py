"""The real APIs' wire formats over bytes: OpenAI Chat Completions and Anthropic Messages.

Each API gets: a request check that returns the generation parameters (or raises ProtocolError in
that API's own error shape and status), the non-streaming response object, and the streaming
events. The shapes follow the public references (OpenAI's chat.completion and
chat.completion.chunk objects, with `[DONE]`, `stream_options.include_usage` and the random
`obfuscation` padding; Anthropic's message_start, content_block_*, message_delta, message_stop,
ping and error events), and the official SDKs are the judges in tests/test_apis.py.

`StopMatcher` holds back text that might be the start of a stop string, and stops at one. No
I/O here; server.py streams these through the same generation and stop-on-leave as /stream.
Leaves out: tools, images, logprobs, n > 1, and the Responses API.
"""

import json
import secrets
import string
import time

from generation import MAX_TOKENS
from http11 import ProtocolError

OBFUSCATION_ALPHABET = string.ascii_letters + string.digits
MAX_STOPS = 4  # stop strings per request, as OpenAI allows


def openai_error(message, status=400, param=None, kind=None, code=None):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""
    kind = kind or {401: "authentication_error", 404: "not_found_error", 500: "server_error"}.get(
        status, "invalid_request_error"
    )
    e = ProtocolError(message, status, kind=kind)
    e.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return e


def anthropic_error(message, status=400, kind=None):
    """An Anthropic-shaped error: {"type": "error", "error": {"type", "message"}}."""
    kind = kind or {401: "authentication_error", 404: "not_found_error", 500: "api_error"}.get(
        status, "invalid_request_error"
    )
    e = ProtocolError(message, status, kind=kind)
    e.body = {"type": "error", "error": {"type": kind, "message": message}}
    return e


def number(body, name, default, low, high, fail, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        raise fail(f"{name} must be {'an integer' if integer else 'a number'} from {low} to {high}", name)
    return value


def stops(value, fail, name):
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > MAX_STOPS:
        raise fail(f"{name} must be a non-empty string or a list of up to {MAX_STOPS} of them", name)
    return value


# --- OpenAI Chat Completions ----------------------------------------------------------------------


def openai_request(body):
    """(messages, params, options) from a chat.completions request body."""

    def fail(message, param=None):
        return openai_error(message, 400, param)

    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise fail("messages must be a non-empty list", "messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
            raise fail(f"messages[{i}].role must be system, developer, user or assistant", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise fail(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise fail(f"messages[{i}].content must be a string or text parts", f"messages[{i}].content")
        chat.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if not any(m["content"] for m in chat):
        raise fail("the messages are empty", "messages")
    n = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {
        "max_tokens": number({"max_tokens": n}, "max_tokens", 256, 1, MAX_TOKENS, fail, integer=True),
        "seed": number(body, "seed", 0, 0, 2**63 - 1, fail, integer=True),
        "temperature": number(body, "temperature", 1.0, 0, 2, fail),
        "top_p": number(body, "top_p", 1.0, 1e-6, 1, fail),
        "ignore_eos": body.get("ignore_eos") is True,  # vLLM's extension, for measurements
    }
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise fail("stream_options must be an object", "stream_options")
    return (
        chat,
        params,
        {
            "stream": body.get("stream") is True,
            "stop": stops(body.get("stop"), fail, "stop"),
            "include_usage": options.get("include_usage") is True,
            "obfuscation": options.get("include_obfuscation", True) is not False,
            "model": body.get("model") if isinstance(body.get("model"), str) else None,
        },
    )


class OpenAIStream:
    """The chat.completion.chunk events of one answer, as bytes."""

    def __init__(self, model, include_usage=False, obfuscation=True):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model, self.include_usage, self.obfuscation = model, include_usage, obfuscation

    def chunk(self, choices, usage=None, final_usage=False):
        value = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model}
        value["system_fingerprint"] = None
        value["choices"] = choices
        if self.include_usage:
            value["usage"] = usage if final_usage else None
        if self.obfuscation:
            # Random-length padding, so an eavesdropper can't read token lengths off encrypted sizes.
            value["obfuscation"] = "".join(
                secrets.choice(OBFUSCATION_ALPHABET) for _ in range(secrets.randbelow(16) + 1)
            )
        return b"data: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"

    def role(self):
        return self.chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def text(self, piece):
        return self.chunk([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])

    def end(self, finish_reason, prompt_tokens, completion_tokens):
        out = self.chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}])
        if self.include_usage:
            out += self.chunk([], usage_openai(prompt_tokens, completion_tokens), final_usage=True)
        return out + b"data: [DONE]\n\n"

    def error(self, message):
        """A failure after the 200: a data event with an `error` member, which the SDK raises."""
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": None}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"


def usage_openai(prompt_tokens, completion_tokens):
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def openai_completion(model, text, finish_reason, prompt_tokens, completion_tokens):
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage_openai(prompt_tokens, completion_tokens),
    }


# --- Anthropic Messages ---------------------------------------------------------------------------


def text_of(content, where, fail):
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise fail(f"{where} must be a string or a list of text blocks")


def anthropic_request(body):
    """(messages, params, options) from a messages request body."""

    def fail(message, param=None):
        return anthropic_error(message, 400)

    if "max_tokens" not in body:
        raise fail("max_tokens: Field required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise fail("messages: a non-empty list is required")
    chat = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": text_of(system, "system", fail)})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise fail(f"messages.{i}.role: must be user or assistant")
        chat.append({"role": m["role"], "content": text_of(m.get("content"), f"messages.{i}.content", fail)})
    if not any(m["content"] for m in chat if m["role"] != "system"):
        raise fail("messages: all messages must have non-empty content")
    params = {
        "max_tokens": number(body, "max_tokens", None, 1, MAX_TOKENS, fail, integer=True),
        "seed": number(body, "seed", 0, 0, 2**63 - 1, fail, integer=True),  # not Anthropic's; for tests
        "temperature": number(body, "temperature", 1.0, 0, 1, fail),
        "top_p": number(body, "top_p", 1.0, 1e-6, 1, fail),
    }
    return (
        chat,
        params,
        {
            "stream": body.get("stream") is True,
            "stop": stops(body.get("stop_sequences"), fail, "stop_sequences"),
            "model": body.get("model") if isinstance(body.get("model"), str) else None,
        },
    )


def named(event, value):
    return b"event: " + event.encode() + b"\ndata: " + json.dumps(value, separators=(",", ":")).encode() + b"\n\n"


class AnthropicStream:
    """The named events of one streamed message, as bytes."""

    def __init__(self, model, input_tokens):
        self.id = "msg_" + secrets.token_hex(12)
        self.model, self.input_tokens = model, input_tokens

    def start(self):
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return named("message_start", {"type": "message_start", "message": message}) + named(
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )

    def text(self, piece):
        return named(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}},
        )

    def ping(self):
        return named("ping", {"type": "ping"})

    def end(self, stop_reason, stop_sequence, output_tokens):
        return (
            named("content_block_stop", {"type": "content_block_stop", "index": 0})
            + named(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
                },
            )
            + named("message_stop", {"type": "message_stop"})
        )

    def error(self, message):
        return named("error", {"type": "error", "error": {"type": "api_error", "message": message}})


def anthropic_message(model, text, stop_reason, stop_sequence, input_tokens, output_tokens):
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


# --- stop strings ---------------------------------------------------------------------------------


class StopMatcher:
    """Feed text pieces; get back what is safe to send. Text that could be the start of a stop
    string is held until it cannot be one; at a stop string, `matched` is set and the text before
    it is the last to go out."""

    def __init__(self, stops):
        self.stops, self.held, self.matched = list(stops), "", None

    def push(self, piece):
        if self.matched is not None:
            return ""
        text = self.held + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.matched = min(hits)
            self.held = ""
            return text[:at]
        keep = 0  # the longest end of the text that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self):
        """At the end without a match: what was held is plain text after all."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""
