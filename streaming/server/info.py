"""The page and the status endpoints: GET / (page.html), GET /health, GET /ready, GET /log,
GET /metrics (Prometheus' text) and GET /metrics.json.

/log is the record of finished requests, a list of [path, generated_tokens, client_left_early];
/metrics.json is JSON: the model, the counts of requests, generations and connections, and the
engine's own; /metrics is metrics.py's. Leaves out everything a dashboard does.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lm
from streaming.server.connection import Connection
from streaming.server.metrics import CONTENT_TYPE
from streaming.wire.http11 import Request, json_response, response

if TYPE_CHECKING:
    from streaming.server.app import Server

PAGE = Path(__file__).with_name("page.html")


def model_facts() -> dict[str, Any]:
    return {
        "model": lm.model_name(),
        "device": lm.DEVICE,
        "dtype": str(lm.dtype()).removeprefix("torch."),
        "quantize": lm.quantization(),
    }


async def page(_srv: Server, conn: Connection, _request: Request) -> None:
    body = await asyncio.to_thread(PAGE.read_bytes)
    conn.write(response(200, body, "text/html; charset=utf-8", [("Cache-Control", "no-cache")]))


async def no_icon(_srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(response(204, content_type=None))


async def health(_srv: Server, conn: Connection, _request: Request) -> None:
    """Liveness: the process answers."""
    conn.write(json_response(200, {"status": "ok"}))


async def ready(srv: Server, conn: Connection, _request: Request) -> None:
    """Readiness: 200 when requests can be served; 503 while the model loads or the server drains."""
    state = "draining" if srv.draining else "loading" if srv.loading else "ready"
    conn.write(json_response(200 if state == "ready" else 503, {"status": state}))


async def log(srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(json_response(200, srv.log))


async def metrics(srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(response(200, srv.metrics.text(), CONTENT_TYPE))


async def metrics_json(srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(json_response(200, status(srv)))


def status(srv: Server) -> dict[str, Any]:
    """/metrics.json: the counts as JSON."""
    stats = srv.runner.stats
    return {
        **model_facts(),
        "naive": srv.config.naive,
        "active_generations": len(stats.active),
        "generation_threads": sum(t.name == "generate" for t in threading.enumerate()),
        "open_connections": len(srv.connections),
        "connections_accepted": srv.accepted,
        "requests_served": srv.served,
        "requests_logged": len(srv.log),
        "requests_stopped": stats.stopped,  # early: the reader left or said stop
        "tokens_after_stop": stats.tokens_after_stop,  # generated for nobody after those stops
        "resumable_streams": len(srv.streams.streams),
        "store": srv.shared.status() if srv.shared is not None else {"kind": "memory"},
        **srv.runner.metrics(),
    }
