"""`Context`: what a handler is given besides its exchange: the server's settings, its backend
(the engine that generates), its answers (their log and metrics), its resumable streams and its
state. Never the server itself, which no handler can reach (as uvicorn hands its protocols a
ServerState). Made once per server by serve.build()."""

from __future__ import annotations

from dataclasses import dataclass

from streaming.generation.backend import Backend
from streaming.server.answer import Answers
from streaming.server.config import Config
from streaming.server.resumable.streams import Streams
from streaming.server.state import ServerState


@dataclass(frozen=True)
class Context:
    config: Config
    backend: Backend
    answers: Answers
    streams: Streams
    state: ServerState
