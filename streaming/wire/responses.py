"""OpenAI's Responses API on the wire (POST /v1/responses), stateless: the request check, the
response object, and its stream of typed events.

A request is `input` (a string, or a list of messages whose content is a string or input_text /
output_text parts), with `instructions` as the system message, `max_output_tokens`,
`temperature`, `top_p` and `stream`. The stream is the sequence the official SDKs parse, each
event with its `sequence_number`:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta ..., response.output_text.done,
    response.content_part.done, response.output_item.done, then response.completed (usage
    inside) or response.incomplete (max_output_tokens reached, or cancelled)

and a failure after the head as `error` then `response.failed`. `ResponsesStream` makes those
events as dicts; the server records them, one numbered SSE event each (event k has
sequence_number k), which is what makes the stream resumable with Last-Event-ID or OpenAI's
`starting_after`. Everything the stream needs to go on lives in its own events (event 0 carries
the id, model and creation time), so a replica that takes a stream over rebuilds it from them
(`ResponsesStream.resume`).

Function tools: `tools` and `tool_choice` (tools.py), function_call and function_call_output
input items, and calls in the answer as function_call output items (1, 2, ... after the message,
item 0) with response.function_call_arguments.delta events.

Leaves out: stored responses (`previous_response_id`, `store` is accepted and ignored:
nothing is kept past the stream's resume window), built-in tools, structured output (`text.format`
other than text), reasoning items, images and files, logprobs.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from typing import Any

from streaming.wire import sse
from streaming.wire.apis import ApiRequest, Call, Finish, kind_of
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.params import MAX_SEED, MAX_TOKENS, MIN_SEED, GenerationParams, cache_salt, number, unicode
from streaming.wire.tools import Tools, call_arguments, call_name, openai_tools

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")  # a message's content parts that are text
DEFAULT_MAX_OUTPUT = 256  # as /v1/chat/completions: a request without a bound gets a short answer


def content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return unicode(content, where)
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in TEXT_PARTS and isinstance(p.get("text"), str) for p in content
    ):
        return unicode("".join(p["text"] for p in content), where)
    raise InvalidRequest(f"{where} must be a string or a list of input_text parts (only text is supported)", where)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages in OpenAI's form: a string is the user's message; function_call
    items are the tool_calls of an assistant message, function_call_output items tool messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": unicode(value, "input")}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("input must be a string or a non-empty list of messages", "input")
    chat: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
        if kind == "function_call" and isinstance(item.get("name"), str):
            arguments = call_arguments(item.get("arguments", "{}"), f"input[{i}].arguments")
            call_id = item["call_id"] if isinstance(item.get("call_id"), str) else ""
            name = call_name(item["name"], f"input[{i}].name")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            if not chat or chat[-1]["role"] != "assistant":
                chat.append({"role": "assistant", "content": ""})
            chat[-1].setdefault("tool_calls", []).append(call)
            continue
        if kind == "function_call_output":
            output = content_text(item.get("output", ""), f"input[{i}].output")
            call_id = item["call_id"] if isinstance(item.get("call_id"), str) else ""
            chat.append({"role": "tool", "content": output, "tool_call_id": call_id})
            continue
        if kind != "message":
            raise InvalidRequest(
                f"input[{i}]: only messages, function_call and function_call_output items are supported,"
                f" not {str(kind)[:40]!r}",
                f"input[{i}]",
            )
        role = ROLES.get(item["role"]) if isinstance(item.get("role"), str) else None
        if role is None:
            raise InvalidRequest(f"input[{i}].role must be user, assistant, system or developer", f"input[{i}].role")
        chat.append({"role": role, "content": content_text(item.get("content"), f"input[{i}].content")})
    return chat


def tools_of(body: dict[str, Any]) -> Tools:
    """The Responses API's function tools (flat: {"type": "function", "name", "parameters"}) and
    tool_choice, read as Chat Completions' (tools.py)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if isinstance(tools, list):
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise InvalidRequest(f"tools[{i}]: only function tools are supported", f"tools[{i}]")
        keep = ("name", "description", "parameters")
        tools = [{"type": "function", "function": {k: t[k] for k in keep if k in t}} for t in tools]
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return openai_tools(
        {"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls", True)}
    )


def echo(tools: Tools | None) -> tuple[list[dict[str, Any]], Any]:
    """The tools and tool_choice as a response object states them: each function tool by its
    name only (its schema would be copied into three events of every recorded stream: a 1 MiB
    request's tools in 256 kept streams is most of a gigabyte)."""
    if tools is None or not tools.specs:
        return [], "none"
    flat = [{"type": "function", "name": spec["function"]["name"]} for spec in tools.specs]
    choice: Any = {"type": "function", "name": tools.name} if tools.name else tools.choice
    return flat, choice


class Responses:
    name = "responses"

    def error_body(self, err: ProtocolError) -> dict[str, Any]:
        kind = kind_of(err.status, "server_error")
        return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}

    def parse(self, body: dict[str, Any]) -> ApiRequest:
        """A responses.create body, checked; raises InvalidRequest naming the param."""
        if body.get("previous_response_id") is not None or body.get("conversation") is not None:
            raise InvalidRequest(
                "this server keeps no responses (stateless): send the whole conversation in input",
                "previous_response_id" if body.get("previous_response_id") is not None else "conversation",
            )
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
            raise InvalidRequest("only text output is supported (text.format.type: text)", "text.format")
        chat = input_messages(body.get("input"))
        if body.get("instructions") is not None:
            chat.insert(0, {"role": "system", "content": content_text(body["instructions"], "instructions")})
        if not any(m["content"] for m in chat):
            raise InvalidRequest("the input is empty", "input")
        params = GenerationParams(
            max_tokens=number(body, "max_output_tokens", DEFAULT_MAX_OUTPUT, 1, MAX_TOKENS, True, none_is_default=True),
            seed=number(body, "seed", 0, MIN_SEED, MAX_SEED, True, none_is_default=True),  # not OpenAI's; for tests
            temperature=number(body, "temperature", 1.0, 0, 2, none_is_default=True),
            top_p=number(body, "top_p", 1.0, 0, 1, none_is_default=True),
            ignore_eos=body.get("ignore_eos") is True,  # vLLM's extension, for measurements
            cache_salt=cache_salt(body),  # vLLM's extension: prefixes.py
        )
        stream, background = body.get("stream") is True, body.get("background") is True
        if background and not stream:
            raise InvalidRequest(
                "background needs stream: true here (no response is stored to poll; "
                "a streamed one is resumed with GET /v1/responses/{id}?stream=true&starting_after=N)",
                "background",
            )
        return ApiRequest(chat, params, stream, stop=[], background=background, tools=tools_of(body))

    def models(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": 0, "owned_by": "streaming-tokens"}

    def finish(self, reason: str | None, matched: str | None, called: bool = False) -> Finish:  # noqa: ARG002
        """The response's status: max_output_tokens reached is incomplete; stopped (the cancel
        endpoint, or nobody came back within the grace) is cancelled."""
        return Finish({"length": "incomplete", "stopped": "cancelled"}.get(reason or "", "completed"))

    def whole(
        self,
        model: str,
        text: str,
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        calls: Sequence[Call] = (),
    ) -> Any:
        s = ResponsesStream("resp_" + secrets.token_hex(12), model, int(time.time()))
        if text or not calls:
            s.delta(text)
        for i, c in enumerate(calls):
            s.call_start(i, c.id, c.name)
            s.call_args(i, c.arguments)
            s.call_end(i)
        item_status = "completed" if finish.reason == "completed" else "incomplete"
        for item in s.items:
            item["open"] = False
        return s.response(finish.reason, usage(prompt_tokens, completion_tokens), item_status)

    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> ResponsesBytes:  # noqa: ARG002
        """The events as bytes, unrecorded (the server records its streams instead: they resume)."""
        return ResponsesBytes(ResponsesStream("resp_" + secrets.token_hex(12), model, int(time.time())), prompt_tokens)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponsesStream:
    """The events of one streamed response, as dicts, numbered from `seq`. Its output items go
    one after another, each done before the next is added (as OpenAI's do): a message for text,
    a function_call for each call, a new message for text after a call."""

    def __init__(self, response_id: str, model: str, created_at: int, seq: int = 0) -> None:
        self.id, self.model, self.created_at = response_id, model, created_at
        self.seq = seq
        self.items: list[dict[str, Any]] = []  # the output items so far, each with "open" while it is written
        self.calls: list[int] = []  # call index -> its item's output index
        self.tools: list[dict[str, Any]] = []  # the function tools offered, echoed in the response
        self.tool_choice: Any = "none"

    @property
    def text(self) -> str:
        """The answer's text so far, all its messages'."""
        return "".join(item["text"] for item in self.items if item["type"] == "message")

    @classmethod
    def resume(cls, events: list[dict[str, Any]]) -> ResponsesStream:
        """The stream again from its events so far (another replica wrote them): the next event
        gets the next number, and its items are what the events said."""
        first = events[0]["response"] if events and events[0].get("type") == "response.created" else None
        if not isinstance(first, dict):
            raise ValueError("a Responses stream begins with response.created")
        s = cls(str(first["id"]), str(first["model"]), int(first["created_at"]), seq=len(events))
        s.tools, s.tool_choice = list(first.get("tools") or []), first.get("tool_choice", "none")
        for e in events:
            kind = e.get("type")
            if kind == "response.output_item.added":
                item = e["item"]
                if item["type"] == "message":
                    s.items.append({"type": "message", "id": item["id"], "text": "", "open": True})
                else:
                    s.calls.append(len(s.items))
                    s.items.append({**item, "arguments": "", "open": True})
            elif kind == "response.output_text.delta":
                s.items[e["output_index"]]["text"] += e["delta"]
            elif kind == "response.function_call_arguments.delta":
                s.items[e["output_index"]]["arguments"] += e["delta"]
            elif kind == "response.output_item.done":
                s.items[e["output_index"]]["open"] = False
        return s

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        value = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return value

    def response(self, status: str, use: dict[str, Any] | None = None, item_status: str = "") -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": None,
            "model": self.model,
            "output": [self.shown(item, item_status) for item in self.items] if item_status else [],
            "parallel_tool_calls": False,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "usage": use,
        }

    def shown(self, item: dict[str, Any], status: str) -> dict[str, Any]:
        """An output item as the API shows it (`status` for one no longer being written)."""
        status = "in_progress" if item["open"] and status != "incomplete" else status
        if item["type"] == "message":
            content = [part(item["text"])] if status != "in_progress" else []
            return {"id": item["id"], "type": "message", "status": status, "role": "assistant", "content": content}
        return {k: item[k] for k in ("id", "type", "call_id", "name", "arguments")} | {"status": status}

    def where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index, "content_index": 0}

    def opening(self) -> list[dict[str, Any]]:
        return [
            self.event("response.created", response=self.response("in_progress")),
            self.event("response.in_progress", response=self.response("in_progress")),
        ]

    def open_message(self) -> list[dict[str, Any]]:
        k = len(self.items)
        item_id = "msg_" + self.id.removeprefix("resp_") + (f"_{k}" if k else "")
        self.items.append({"type": "message", "id": item_id, "text": "", "open": True})
        return [
            self.event("response.output_item.added", output_index=k, item=self.shown(self.items[k], "in_progress")),
            self.event("response.content_part.added", **self.where(k), part=part("")),
        ]

    def close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        """The done events of the message being written, if one is."""
        if not self.items or self.items[-1]["type"] != "message" or not self.items[-1]["open"]:
            return []
        k, item = len(self.items) - 1, self.items[-1]
        item["open"] = False
        return [
            self.event("response.output_text.done", **self.where(k), text=item["text"], logprobs=[]),
            self.event("response.content_part.done", **self.where(k), part=part(item["text"])),
            self.event("response.output_item.done", output_index=k, item=self.shown(item, status)),
        ]

    def delta(self, piece: str) -> list[dict[str, Any]]:
        """A piece of text (in a message begun for it, if the last item is not one being written)."""
        out = (
            [] if self.items and self.items[-1]["type"] == "message" and self.items[-1]["open"] else self.open_message()
        )
        self.items[-1]["text"] += piece
        k = len(self.items) - 1
        return [*out, self.event("response.output_text.delta", **self.where(k), delta=piece, logprobs=[])]

    def call_start(self, index: int, call_id: str, name: str) -> list[dict[str, Any]]:
        out = self.close_message()
        k = len(self.items)
        assert index == len(self.calls), "calls come in order"
        self.calls.append(k)
        item_id = "fc_" + call_id.removeprefix("call_")
        self.items.append(
            {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": "", "open": True}
        )
        return [*out, self.event("response.output_item.added", output_index=k, item=self.shown(self.items[k], ""))]

    def call_args(self, index: int, delta: str) -> list[dict[str, Any]]:
        k = self.calls[index]
        self.items[k]["arguments"] += delta
        item_id = self.items[k]["id"]
        return [self.event("response.function_call_arguments.delta", item_id=item_id, output_index=k, delta=delta)]

    def call_end(self, index: int) -> list[dict[str, Any]]:
        k = self.calls[index]
        item = self.items[k]
        item["arguments"], item["open"] = item["arguments"] or "{}", False
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=k,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self.event("response.output_item.done", output_index=k, item=self.shown(item, "completed")),
        ]

    def closing(self, finish: Finish, prompt_tokens: int, completion_tokens: int) -> list[dict[str, Any]]:
        """After the last piece: the open message's done events (an empty message if the answer
        had no item), then response.completed, or response.incomplete (its status incomplete,
        or cancelled: the API has no response.cancelled event)."""
        status = finish.reason  # completed, incomplete or cancelled (Responses.finish)
        item_status = "completed" if status == "completed" else "incomplete"
        out = self.open_message() if not self.items else []
        out += self.close_message(item_status)
        final = self.response(status, usage(prompt_tokens, completion_tokens), item_status)
        return [
            *out,
            self.event("response.completed" if status == "completed" else "response.incomplete", response=final),
        ]

    def failure(self, message: str, code: str = "server_error") -> list[dict[str, Any]]:
        """A failure after the head: an error event, then response.failed."""
        failed = self.response("failed", item_status="incomplete")
        failed["error"] = {"code": code, "message": message}
        return [
            # ResponseErrorEvent's fields, and an `error` member: the SDKs raise on an error
            # event that has one (as they do for Chat Completions), else they yield it quietly.
            self.event("error", code=code, message=message, param=None, error={"type": code, "message": message}),
            self.event("response.failed", response=failed),
        ]


def failure_code(status: int) -> str:
    """A failed response's `error.code` for what would have been this status before the head:
    the Responses API names codes, not types (a request refused at admission: its prompt)."""
    if status >= 500:
        return "server_error"
    return "rate_limit_exceeded" if status == 429 else "invalid_prompt"


def part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def dumps(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


def encoded(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse.event(dumps(value), event=value["type"]) for value in events)


class ResponsesBytes:
    """A ResponsesStream as apis.StreamEncoder: each event's SSE bytes, named by its type."""

    def __init__(self, stream: ResponsesStream, prompt_tokens: int) -> None:
        self.events, self.prompt_tokens = stream, prompt_tokens

    def start(self) -> bytes:
        return encoded(self.events.opening())

    def text(self, piece: str) -> bytes:
        return encoded(self.events.delta(piece))

    def call_start(self, index: int, call_id: str, name: str) -> bytes:
        return encoded(self.events.call_start(index, call_id, name))

    def call_args(self, index: int, delta: str) -> bytes:
        return encoded(self.events.call_args(index, delta))

    def call_end(self, index: int) -> bytes:
        return encoded(self.events.call_end(index))

    def keep_alive(self, note: str = "ping") -> bytes:
        return sse.comment(note)

    def end(self, finish: Finish, completion_tokens: int) -> bytes:
        return encoded(self.events.closing(finish, self.prompt_tokens, completion_tokens))

    def error(self, message: str, status: int = 500) -> bytes:
        return encoded(self.events.failure(message, failure_code(status)))
