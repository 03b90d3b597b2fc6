"""What one server's connections and answers share, and the phase it is in (as uvicorn hands its
protocols a small ServerState, never the server; as h11 and websockets keep a State enum).

Phases go one way: SERVING, then at SIGTERM DRAINING (no new requests: answers in flight go on
for the grace period), then CLOSING (the grace is over: the answers still running are stopped
and end with an error). Whether the model has loaded is the backend's to say
(streaming/generation/backend.py), not a phase: a server may be told to drain while it loads.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any


class Phase(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # shutdown has begun: /ready says 503, kept-alive connections close
    CLOSING = "closing"  # the grace is over: answers still running end with an error


@dataclass
class ServerState:
    phase: Phase = Phase.SERVING
    accepted: int = 0  # connections accepted
    served: int = 0  # requests read
    connections: set[asyncio.Task[None]] = field(default_factory=set)  # one handler task each
    idle: set[asyncio.Task[None]] = field(
        default_factory=set
    )  # those waiting for a request: closed at once on shutdown
    background: set[asyncio.Task[None]] = field(default_factory=set)  # tasks that outlive their request (pumps)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> asyncio.Task[None]:
        """A task that outlives its request (a resumable stream's pump), waited for at shutdown."""
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task
