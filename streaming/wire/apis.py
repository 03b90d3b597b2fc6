"""What the real APIs' wire formats share, and the shape each of them fills in.

A format (openai.py, anthropic.py, responses.py, completions.py) is one object that knows everything its API does differently:
its request check, its error body, its non-streaming answer, its streamed events and its words
for why an answer ended. The /v1/ handler drives any `Format` the same way, so adding an API is
adding a module here. The shapes follow the public references, and the official SDKs are the
judges in tests/test_apis.py.

Tool calls: a request's `tools` (tools.py), the calls read from the answer as it streams
(toolcalls.py, answers.py), each format's own events for them. Leaves out: images, logprobs, n > 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.params import GenerationParams
from streaming.wire.tools import Tools

MAX_STOPS = 4  # stop strings per request, as OpenAI allows
# A stop string's length: the matcher holds back any end of the text that begins one (stops.py),
# and looks for each in what it holds with every piece; a few sentences are plenty.
MAX_STOP_CHARS = 1000


class ApiRequest(NamedTuple):
    # {"role", "content"}, for the model's chat template, in OpenAI's form: an assistant's may have
    # "tool_calls" ([{"id", "type": "function", "function": {"name", "arguments": JSON text}}]),
    # and a "tool" message answers one ("tool_call_id")
    messages: list[dict[str, Any]]
    params: GenerationParams
    stream: bool
    stop: list[str]  # stop strings
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    obfuscation: bool = True  # OpenAI's random padding of stream chunks
    continue_final: bool = False  # vLLM's continue_final_message: go on with the last (assistant) message
    background: bool = False  # the Responses API's: the stream is resumable and outlives its reader
    text: str | None = None  # a text completion's prompt, as it is (then `messages` is empty)
    tools: Tools | None = None  # the tools offered and the tool choice
    stream_interval: int | None = None  # pieces per event, our extension (stream_options); None: the server's


class Call(NamedTuple):
    """A tool call the model made, as the answer's end sees it."""

    id: str
    name: str
    arguments: str  # the JSON text of its arguments object ("{}" if the model wrote none)
    complete: bool  # its arguments closed: a whole JSON object


class Finish(NamedTuple):
    """Why an answer ended, in an API's words, and the stop string that ended it, if any."""

    reason: str
    sequence: str | None = None


class StreamEncoder(Protocol):
    prompt_tokens: int  # the prompt's tokens, for the usage at the end (an upstream's count arrives late)

    def start(self) -> bytes: ...
    def text(self, piece: str) -> bytes: ...
    def call_start(self, index: int, call_id: str, name: str) -> bytes: ...
    def call_args(self, index: int, delta: str) -> bytes: ...
    def call_end(self, index: int) -> bytes: ...
    def keep_alive(self, note: str = "ping") -> bytes: ...
    def end(self, finish: Finish, completion_tokens: int) -> bytes: ...
    def error(self, message: str, status: int = 500) -> bytes: ...  # a failure after the head, typed by status


class Format(Protocol):
    name: str

    def error_body(self, err: ProtocolError) -> dict[str, Any]: ...
    def parse(self, body: dict[str, Any]) -> ApiRequest: ...
    def models(self, model_id: str) -> dict[str, Any]: ...
    def finish(self, reason: str | None, matched: str | None, called: bool = False) -> Finish: ...
    def whole(
        self,
        model: str,
        text: str,
        finish: Finish,
        prompt_tokens: int,
        completion_tokens: int,
        calls: Sequence[Call] = (),
    ) -> Any: ...
    def stream(self, model: str, request: ApiRequest, prompt_tokens: int) -> StreamEncoder: ...


def stops(value: Any, name: str) -> list[str]:
    """Stop strings: absent, one string, or a list of up to MAX_STOPS non-empty strings, each of
    MAX_STOP_CHARS at most."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    fine = isinstance(value, list) and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in value)
    if not fine or len(value) > MAX_STOPS:
        raise InvalidRequest(
            f"{name} must be a non-empty string or a list of up to {MAX_STOPS} of them, "
            f"each of {MAX_STOP_CHARS} characters at most",
            name,
        )
    return list(value)


def kind_of(status: int, server_error: str) -> str:
    """The error type both APIs name by status (server_error is each API's word for a 5xx: ours,
    or an upstream's relayed as 502/503/504)."""
    if status >= 500:
        return server_error
    return {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )
