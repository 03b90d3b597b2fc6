"""OpenAI's Chat Completions on the wire: the request check, errors, answers and stream chunks.

The shapes of the chat.completion and chat.completion.chunk objects, with `data: [DONE]` at the
end, `stream_options.include_usage`, and the random `obfuscation` padding current chunks carry.
Errors are {"error": {"message", "type", "param", "code"}}. `read_chunk` is the reading side:
what a client of such a stream (the upstream relay, client.py) takes from each chunk. Leaves out
what apis.py says.
"""

from __future__ import annotations

import json
import secrets
import string
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

from streaming.wire import sse
from streaming.wire.apis import ApiRequest, Call, Finish, kind_of, stops
from streaming.wire.errors import InvalidRequest, ProtocolError
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
from streaming.wire.toolcalls import CALL_CLOSE, CALL_OPEN
from streaming.wire.tools import call_arguments, call_name, openai_tools

OBFUSCATION_ALPHABET = string.ascii_letters + string.digits
ROLES = ("system", "developer", "user", "assistant", "tool")
ERROR_CHARS = 200  # of an upstream's error message, passed on to its readers (read_chunk)


def content_of(content: Any, where: str) -> str:
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise InvalidRequest(f"{where}: only text parts are supported", where)
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidRequest(f"{where} must be a string or text parts", where)
    return unicode(content, where)


def tool_calls_of(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, in their canonical form (arguments as JSON text)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{where} must be a non-empty list", where)
    calls = []
    for k, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(
                f'{where}[{k}] must be {{"type": "function", "function": {{"name", "arguments"}}}}', f"{where}[{k}]"
            )
        arguments = call_arguments(function.get("arguments", "{}"), f"{where}[{k}].function.arguments")
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{k}"
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": call_name(function["name"], f"{where}[{k}].function.name"),
                    "arguments": json.dumps(arguments),
                },
            }
        )
    return calls


def chat_of(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list", "messages")
    chat: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be system, developer, user, assistant or tool", f"messages[{i}].role"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "assistant" and m.get("tool_calls") is not None:  # a turn that called tools
            content = m.get("content")
            text = content_of(content, f"messages[{i}].content") if content is not None else ""
            chat.append(
                {
                    "role": role,
                    "content": text,
                    "tool_calls": tool_calls_of(m["tool_calls"], f"messages[{i}].tool_calls"),
                }
            )
            continue
        message: dict[str, Any] = {"role": role, "content": content_of(m.get("content"), f"messages[{i}].content")}
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            message["tool_call_id"] = m["tool_call_id"]
        chat.append(message)
    if not any(m["content"] or m.get("tool_calls") for m in chat):
        raise InvalidRequest("the messages are empty", "messages")
    return chat


class OpenAI:
    name = "openai"

    def error_body(self, err: ProtocolError) -> dict[str, Any]:
        kind = kind_of(err.status, "server_error")
        return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        """A chat.completions request body, checked; raises InvalidRequest naming the param."""
        chat = chat_of(body.get("messages"))
        refuse_unsupported(body)
        n = body.get("max_completion_tokens")
        n = body.get("max_tokens") if n is None else n  # (a null max_completion_tokens beside max_tokens)
        params = GenerationParams(
            max_tokens=number({"max_tokens": n}, "max_tokens", 256, 1, MAX_TOKENS, True, none_is_default=True),
            seed=number(body, "seed", 0, MIN_SEED, MAX_SEED, True, none_is_default=True),
            temperature=number(body, "temperature", 1.0, 0, 2, none_is_default=True),
            top_p=number(body, "top_p", 1.0, 0, 1, none_is_default=True),
            ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension, for measurements
            cache_salt=cache_salt(body),  # vLLM's extension: prefixes.py
        )
        continue_final = body.get("continue_final_message") is True  # vLLM's extension
        if continue_final and chat[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message needs an assistant message last", "continue_final_message")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise InvalidRequest("stream_options must be an object", "stream_options")
        return ApiRequest(
            chat,
            params,
            stream=body.get("stream") is True,
            stop=stops(body.get("stop"), "stop"),
            include_usage=options.get("include_usage") is True,
            obfuscation=options.get("include_obfuscation", True) is not False,
            stream_interval=stream_interval(options, "stream_options."),  # our extension
            continue_final=continue_final,
            tools=openai_tools(body),
        )

    def models(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "streaming-tokens"}

    def finish(self, reason: str | None, matched: str | None, called: bool = False) -> Finish:
        if reason == "length" and matched is None:
            return Finish("length")
        return Finish("tool_calls" if called and matched is None else "stop")

    def whole(
        self,
        model: str,
        text: str,
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        calls: Sequence[Call] = (),
    ) -> Any:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return {
            "id": "chatcmpl-" + secrets.token_hex(12),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": finish.reason,
                }
            ],
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> OpenAIStream:
        return OpenAIStream(model, prompt_tokens, request.include_usage, request.obfuscation)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OpenAIStream:
    """The chat.completion.chunk events of one answer, as bytes."""

    def __init__(self, model: str, prompt_tokens: int = 0, include_usage: bool = False, obfuscation: bool = True):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.model, self.prompt_tokens = model, prompt_tokens
        self.include_usage, self.obfuscation = include_usage, obfuscation

    def chunk(self, choices: list[Any], usage: dict[str, int] | None = None, final_usage: bool = False) -> bytes:
        value: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
        }
        value["system_fingerprint"] = None
        value["choices"] = choices
        if self.include_usage:
            value["usage"] = usage if final_usage else None
        if self.obfuscation:
            # Random-length padding, so an eavesdropper can't read token lengths off encrypted sizes.
            value["obfuscation"] = "".join(
                secrets.choice(OBFUSCATION_ALPHABET) for _ in range(secrets.randbelow(16) + 1)
            )
        return sse.event(json.dumps(value, separators=(",", ":")))

    def start(self) -> bytes:
        return self.chunk(
            [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        )

    def text(self, piece: str) -> bytes:
        return self.chunk([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": None}])

    def tool_delta(self, call: dict[str, Any]) -> bytes:
        return self.chunk([{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}])

    def call_start(self, index: int, call_id: str, name: str) -> bytes:
        function = {"name": name, "arguments": ""}
        return self.tool_delta({"index": index, "id": call_id, "type": "function", "function": function})

    def call_args(self, index: int, delta: str) -> bytes:
        return self.tool_delta({"index": index, "function": {"arguments": delta}})

    def call_end(self, index: int) -> bytes:  # noqa: ARG002 - a call's end is the next call or the finish
        return b""

    def keep_alive(self, note: str = "ping") -> bytes:
        return sse.comment(note)  # OpenAI's clients ignore comments

    def end(self, finish: Finish, completion_tokens: int) -> bytes:
        out = self.chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish.reason}])
        if self.include_usage:
            out += self.chunk([], usage(self.prompt_tokens, completion_tokens), final_usage=True)
        return out + sse.DONE

    def error(self, message: str, status: int = 500) -> bytes:
        """A failure after the 200: a data event with an `error` member, which the SDK raises,
        typed as the status would have been before the head (a request refused at admission is
        an invalid_request_error)."""
        body = {"error": {"message": message, "type": kind_of(status, "server_error"), "param": None, "code": None}}
        return sse.event(json.dumps(body))


# --- reading a stream: what the relay (--engine upstream) and client.py take from each chunk ---


class Chunk(NamedTuple):
    """What one chat.completion.chunk says to whoever reads the stream."""

    text: str  # its delta.content, all choices together ('' for none)
    finish: str | None = None  # a choice's finish_reason ("stop", "length", ...), if one ended
    usage: dict[str, Any] | None = None  # the usage chunk's counts (stream_options.include_usage)
    error: str | None = None  # an error event's message: the answer failed mid-stream
    alive: bool = False  # a choice's delta carries something (text, reasoning, a tool call): not a ping
    calls: tuple[CallDelta, ...] = ()  # its tool_calls deltas


def refuse_unsupported(body: dict[str, Any]) -> None:
    """What a Chat Completions request asks that this server cannot do is a 400 naming it, never
    ignored (an answer in free text where a JSON schema was asked looks like the model's failure):
    several choices, log probabilities, a response format, token biases. Their defaults pass."""
    number(body, "n", 1, 1, 1, True, none_is_default=True)  # n must be 1 (or absent)
    for name, defaults in (("logprobs", (None, False)), ("top_logprobs", (None, 0)), ("logit_bias", (None, {}))):
        if body.get(name) not in defaults:
            raise InvalidRequest(f"{name} is not supported", name)
    if body.get("response_format") not in (None, {"type": "text"}):
        raise InvalidRequest('response_format: only {"type": "text"} is supported', "response_format")


class CallDelta(NamedTuple):
    at: int  # the call's index
    name: str | None  # set on a call's first delta
    arguments: str  # the next characters of its arguments' JSON text


def error_text(message: Any) -> str:
    """An upstream's error message as its readers are told it: its text, or JSON's for what is not
    a string (never Python's repr), ERROR_CHARS at most."""
    return (message if isinstance(message, str) else json.dumps(message))[:ERROR_CHARS]


def read_chunk(data: str) -> Chunk:
    """One stream event's data as a Chunk; ProtocolError(502) for one that is not a JSON object
    (`[DONE]` is the caller's: it ends the stream)."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):  # (nested past Python's recursion limit)
        raise ProtocolError(f"an event that is not JSON: {data[:80]!r}", 502) from None
    if not isinstance(value, dict):
        raise ProtocolError("an event that is not a JSON object", 502)
    if "error" in value:
        err = value["error"]
        return Chunk("", error=error_text(err.get("message", err) if isinstance(err, dict) else err))
    texts, finish, alive, calls = [], None, False, []
    for choice in value.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")  # (a text completion's chunk)
        if isinstance(text, str):
            texts.append(text)
        if (isinstance(delta, dict) and any(v for k, v in delta.items() if k != "role")) or text:
            alive = True  # (a text completion's chunk has no delta: its text is what says so)
        if isinstance(delta, dict) and isinstance(delta.get("tool_calls"), list):
            calls += [c for c in map(call_delta, delta["tool_calls"]) if c is not None]
        finish = choice.get("finish_reason") or finish
    usage = value.get("usage")
    return Chunk("".join(texts), finish, usage if isinstance(usage, dict) else None, alive=alive, calls=tuple(calls))


def call_delta(value: Any) -> CallDelta | None:
    """One entry of a delta's tool_calls; None for one that is not a function call's."""
    function = value.get("function") if isinstance(value, dict) else None
    if not isinstance(function, dict) or not isinstance(value.get("index", 0), int):
        return None
    name, arguments = function.get("name"), function.get("arguments")
    return CallDelta(
        value.get("index", 0), name if isinstance(name, str) else None, arguments if isinstance(arguments, str) else ""
    )


class CallsAsText:
    """A stream's text and tool_calls deltas as the text a Qwen model writes, calls in its
    `<tool_call>{"name": ..., "arguments": ...}</tool_call>` syntax, which a reader of answers
    reads back as calls (answers.py): one reader of calls, whatever the engine. The relay
    (--engine upstream) turns an upstream's chunks into pieces with it."""

    def __init__(self) -> None:
        self.open: int | None = None  # the index of the call being written
        self.args = False  # its arguments have begun

    def text(self, chunk: Chunk) -> str:
        """A chunk's text (which ends a call that was open), then its calls' text."""
        out = [self.close(), chunk.text] if chunk.text else []
        for c in chunk.calls:
            if c.name is not None and c.at != self.open:  # a new call (the one before ends)
                out.append(self.close() + f'{CALL_OPEN}\n{{"name": {json.dumps(c.name)}, "arguments": ')
                self.open, self.args = c.at, False
            if c.arguments and self.open is not None:
                out.append(c.arguments)
                self.args = True
        return "".join(out)

    def close(self) -> str:
        """The end of the call being written ("" if none is)."""
        if self.open is None:
            return ""
        self.open = None
        return ("" if self.args else "{}") + f"}}\n{CALL_CLOSE}"
