"""The page and the status endpoints: GET / (page.html), GET /health, GET /ready, GET /log,
GET /metrics (Prometheus' text) and GET /metrics.json.

/log is the record of finished answers, a list of [path, generated_tokens, ended_early];
/metrics.json is JSON: the model, the counts of requests, generations and connections, and the
engine's own; /metrics is metrics.py's. Leaves out everything a dashboard does.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.metrics import CONTENT_TYPE
from streaming.server.state import Phase

PAGE = Path(__file__).with_name("page.html")


async def page(_ctx: Context, ex: Exchange) -> None:
    body = await asyncio.to_thread(PAGE.read_bytes)
    ex.respond(200, body, "text/html; charset=utf-8", [("Cache-Control", "no-cache")])


async def no_icon(_ctx: Context, ex: Exchange) -> None:
    ex.respond(204, content_type=None)


async def health(_ctx: Context, ex: Exchange) -> None:
    """Liveness: the process answers."""
    ex.respond_json(200, {"status": "ok"})


def readiness(ctx: Context) -> str:
    """ready, or why not: loading (the model), draining (shutting down)."""
    if ctx.state.phase is not Phase.SERVING:
        return "draining"
    return "ready" if ctx.backend.loaded else "loading"


async def ready(ctx: Context, ex: Exchange) -> None:
    """Readiness: 200 when requests can be served; 503 while the model loads or the server drains."""
    state = readiness(ctx)
    ex.respond_json(200 if state == "ready" else 503, {"status": state})


async def log(ctx: Context, ex: Exchange) -> None:
    ex.respond_json(200, list(ctx.answers.log))


async def metrics(ctx: Context, ex: Exchange) -> None:
    ex.respond(200, ctx.answers.metrics.text(), CONTENT_TYPE)


async def metrics_json(ctx: Context, ex: Exchange) -> None:
    ex.respond_json(200, status(ctx))


def status(ctx: Context) -> dict[str, Any]:
    """/metrics.json: the counts as JSON."""
    stats, state = ctx.backend.stats, ctx.state
    return {
        **ctx.backend.facts(),
        "naive": ctx.config.naive,
        "active_generations": len(stats.active),
        "generation_threads": sum(t.name == "generate" for t in threading.enumerate()),
        "open_connections": len(state.connections),
        "connections_accepted": state.accepted,
        "requests_served": state.served,
        "requests_logged": ctx.answers.logged,
        "requests_stopped": stats.stopped,  # early: the reader left or said stop
        "tokens_after_stop": stats.tokens_after_stop,  # generated for nobody after those stops
        "resumable_streams": len(ctx.streams.recordings),
        "store": ctx.streams.status(),
        **ctx.backend.metrics(),
    }
