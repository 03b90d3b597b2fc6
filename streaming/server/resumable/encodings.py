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
encoding from the events so far (`of_events`): the Responses stream's numbering and its text
go on where they were.
"""

from __future__ import annotations

import json
import time
from typing import Protocol

from streaming.generation.job import Piece
from streaming.server.resumable.recordings import Recording
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.responses import Responses, ResponsesStream, dumps
from streaming.wire.sse import EventParser


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
    def __init__(self, stream: ResponsesStream) -> None:
        self.stream = stream

    @classmethod
    def new(cls, stream_id: str, model: str) -> ResponsesEvents:
        return cls(ResponsesStream("resp_" + stream_id, model, int(time.time())))

    def add(
        self, rec: Recording, events: list[dict[str, object]], ids: tuple[int, ...] = (), last: bool = False
    ) -> None:
        for i, value in enumerate(events):
            rec.add(dumps(value), event=str(value["type"]), ids=ids, last=last and i == len(events) - 1)

    def open(self, rec: Recording) -> None:
        self.stream.seq = len(rec.events)
        self.add(rec, self.stream.opening())

    def piece(self, rec: Recording, piece: str) -> None:
        self.add(rec, [self.stream.delta(piece)], ids_of(piece))

    def done(self, rec: Recording, reason: str | None, prompt_tokens: int, completion_tokens: int) -> None:
        finish = Responses().finish(reason, None)
        self.add(rec, self.stream.closing(finish, prompt_tokens, completion_tokens), last=True)

    def failed(self, rec: Recording, err: ProtocolError) -> None:
        self.add(rec, self.stream.failure(err.message), last=True)


def parsed(rec: Recording) -> list[tuple[str, str]]:
    """(event name, data) of each recorded event."""
    return [(ev.event, ev.data) for raw in rec.events for ev in EventParser().feed(raw)]


def of_events(rec: Recording) -> Article | ResponsesEvents:
    """The encoding a recording was written in, from its event 0, going on from its events so
    far. Raises ValueError (or KeyError) if they cannot be read."""
    events = parsed(rec)
    if events and events[0][0] == "response.created":
        return ResponsesEvents(ResponsesStream.resume([json.loads(data) for _, data in events]))
    return Article()


def texts(rec: Recording) -> list[str]:
    """The pieces of text a recording's events carry, in either format."""
    out = []
    for name, data in parsed(rec)[1:]:
        if name == "message" and data != "[DONE]":
            out.append(json.loads(data)["text"])
        elif name == "response.output_text.delta":
            out.append(json.loads(data)["delta"])
    return out
