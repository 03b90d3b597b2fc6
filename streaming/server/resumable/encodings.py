"""What a resumable stream's events say: the wire format its recording is written in.

Every recorded event is one numbered SSE event (`id: S.k`), whatever the format; this module
says which events a stream's opening, each piece of text, its end and its failure become:

- `Article`: GET /stream's own. Event 0 (`event: stream`) names the stream, then one
  {"text": ...} event a piece, then `[DONE]` (or an `error` event).
- `ResponsesEvents`: OpenAI's Responses API (streaming.wire.responses). Event k is the event
  with sequence_number k: response.created (which names the response, resp_S) and three more
  opening events, an output_text.delta a piece, then the four closing events (or error and
  response.failed).

A replica that takes a stream over (takeover.py) knows its format from event 0 and rebuilds its
encoding from the events so far (`of_events`): the Responses stream's numbering, its text, its
calls and its tool-call reader go on where they were.
"""

from __future__ import annotations

import json
import time
from typing import Any, Protocol

from streaming.generation.job import Piece
from streaming.server.resumable.recordings import Recording
from streaming.wire.answers import AnswerStream
from streaming.wire.apis import Finish
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.responses import Responses, ResponsesStream, dumps, echo, failure_code
from streaming.wire.sse import EventParser
from streaming.wire.tools import Tools


class Encoding(Protocol):
    def open(self, rec: Recording) -> None: ...
    def piece(self, rec: Recording, piece: str) -> None: ...
    def done(self, rec: Recording, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None: ...
    def failed(self, rec: Recording, err: ProtocolError) -> None: ...


def ids_of(piece: str) -> tuple[int, ...]:
    return piece.ids if isinstance(piece, Piece) else ()


class Article:
    def open(self, rec: Recording) -> None:
        rec.add(json.dumps({"id": rec.id}), event="stream")  # event 0 names the stream, for /stop

    def piece(self, rec: Recording, piece: str) -> None:
        rec.add(json.dumps({"text": piece}), ids=ids_of(piece))

    def done(self, rec: Recording, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:  # noqa: ARG002
        rec.add("[DONE]", last=True)

    def failed(self, rec: Recording, err: ProtocolError) -> None:
        rec.add(json.dumps(error_body(err)), event="error", last=True)


class ResponsesEvents:
    """A Responses stream into a recording, its tool calls read as they stream (answers.py):
    each piece's token ids go with the next event it leads to (a piece the reader holds gives
    none yet), so a taker finds exactly the tokens whose text the events say."""

    def __init__(self, stream: ResponsesStream, calling: bool = False, prefill: str = "") -> None:
        self.stream, self.rec = stream, Recording("", None)
        self.out = AnswerStream([], enc=Sink(self), calling=calling, prefill=prefill)
        self.ids: list[int] = []  # of the pieces not yet in an event

    @classmethod
    def new(cls, stream_id: str, model: str, tools: Tools | None = None, prefill: str = "") -> ResponsesEvents:
        s = ResponsesStream("resp_" + stream_id, model, int(time.time()))
        s.tools, s.tool_choice = echo(tools)
        return cls(s, calling=bool(s.tools) and tools is not None and tools.choice != "none", prefill=prefill)

    def add(self, events: list[dict[str, Any]], last: bool = False) -> None:
        for i, value in enumerate(events):
            ids, self.ids = tuple(self.ids), []
            self.rec.add(dumps(value), event=str(value["type"]), ids=ids, last=last and i == len(events) - 1)

    def open(self, rec: Recording) -> None:
        self.rec, self.stream.seq = rec, len(rec.events)
        self.add(self.stream.opening())

    def piece(self, rec: Recording, piece: str) -> None:
        self.rec = rec
        self.ids += ids_of(piece)
        self.out.push(piece)

    def done(self, rec: Recording, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        self.rec = rec
        self.out.flush()
        finish = Responses().finish(reason, None)
        self.add(self.stream.closing(finish, prompt_tokens, completion_tokens), last=True)

    def failed(self, rec: Recording, err: ProtocolError) -> None:
        self.rec = rec
        self.add(self.stream.failure(err.message, failure_code(err.status)), last=True)


class Sink:
    """AnswerStream's encoder for ResponsesEvents: each event into the recording (no bytes are
    sent from here: the readers follow the recording)."""

    def __init__(self, owner: ResponsesEvents) -> None:
        self.owner, self.prompt_tokens = owner, 0

    def text(self, piece: str) -> bytes:
        self.owner.add(self.owner.stream.delta(piece))
        return b""

    def call_start(self, index: int, call_id: str, name: str) -> bytes:
        self.owner.add(self.owner.stream.call_start(index, call_id, name))
        return b""

    def call_args(self, index: int, delta: str) -> bytes:
        self.owner.add(self.owner.stream.call_args(index, delta))
        return b""

    def call_end(self, index: int) -> bytes:
        self.owner.add(self.owner.stream.call_end(index))
        return b""

    # (the rest of StreamEncoder: the recording's opening and end are ResponsesEvents')
    def start(self) -> bytes:
        return b""

    def keep_alive(self, note: str = "ping") -> bytes:  # noqa: ARG002
        return b""

    def end(self, finish: Finish, completion_tokens: int) -> bytes:  # noqa: ARG002
        return b""

    def error(self, message: str, status: int = 500) -> bytes:  # noqa: ARG002
        return b""


def parsed(rec: Recording) -> list[tuple[str, str]]:
    """(event name, data) of each recorded event."""
    return [(ev.event, ev.data) for raw in rec.events for ev in EventParser().feed(raw)]


def of_events(rec: Recording, answer_text: str = "") -> Article | ResponsesEvents:
    """The encoding a recording was written in, from its event 0, going on from its events so
    far; `answer_text`, the answer so far (its prefill and its tokens decoded), puts a Responses
    stream's tool-call reader where the dead generator's was. Raises ValueError (or KeyError)
    if they cannot be read."""
    events = parsed(rec)
    if not events or events[0][0] != "response.created":
        return Article()
    stream = ResponsesStream.resume([json.loads(data) for _, data in events])
    enc = ResponsesEvents(stream, calling=bool(stream.tools) and stream.tool_choice != "none")
    if enc.out.parser is not None and answer_text:
        replay = AnswerStream([], calling=True)  # the same reader fed the same text: the same state
        replay.push(answer_text)
        enc.out.parser, enc.out.calls, enc.out.args = replay.parser, replay.calls, replay.args
    return enc


def texts(rec: Recording) -> list[str]:
    """The pieces of text a recording's events carry, in either format."""
    out = []
    for name, data in parsed(rec)[1:]:
        if name == "message" and data != "[DONE]":
            out.append(json.loads(data)["text"])
        elif name == "response.output_text.delta":
            out.append(json.loads(data)["delta"])
    return out
