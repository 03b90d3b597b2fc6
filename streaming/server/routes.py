"""The route table: each path's methods, its handler, and what the server checks before it runs.

A handler is `async def handler(ctx: Context, ex: Exchange) -> None`: it reads `ex.request`,
uses what it needs of `ctx` (the backend, the answers, the streams, the settings), writes through
`ex` and raises ProtocolError or InvalidRequest for anything that goes wrong, which the exchange
says in the endpoint's shape (`format`: the /v1/ family's wire format object). A new endpoint is
a handler in its family's module (or a new module) and a line here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import NamedTuple

from streaming.server import article, responses, status, v1, ws
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.resumable import endpoints as resumable
from streaming.wire.anthropic import Anthropic
from streaming.wire.apis import Format
from streaming.wire.completions import Completions
from streaming.wire.openai import OpenAI
from streaming.wire.responses import Responses

Handler = Callable[[Context, Exchange], Awaitable[None]]


class Route(NamedTuple):
    methods: tuple[str, ...]
    handler: Handler
    format: Format | None = None  # a wire format object: the /v1/ family's error shape and encoders
    open: bool = False  # answered without the API key (the page, health and readiness)
    model: bool = False  # generates: 503 while the model loads
    cors: bool = True  # CORS fields on its answers (a WebSocket's Origin is checked in its handshake)


ROUTES = {
    "/": Route(("GET",), status.page, open=True),  # the browser page (page.html)
    "/favicon.ico": Route(("GET",), status.no_icon, open=True),  # 204: browsers ask; no 404 in their console
    "/health": Route(("GET",), status.health, open=True),  # liveness: 200 while the process serves
    "/ready": Route(("GET",), status.ready, open=True),  # readiness: 503 while loading or draining
    "/complete": Route(("POST",), article.complete, model=True),
    "/stream": Route(("POST", "GET"), article.stream, model=True),  # GET ?prompt=...: EventSource's way, resumable
    "/stop": Route(("POST",), resumable.stop),  # {"id": stream}: stop a resumable stream now
    "/ws": Route(("GET",), ws.websocket, model=True, cors=False),
    "/log": Route(("GET",), status.log),
    "/metrics": Route(("GET",), status.metrics),  # Prometheus' text format
    "/metrics.json": Route(("GET",), status.metrics_json),  # the same counts and more, as JSON
    "/v1/chat/completions": Route(("POST",), v1.answer, OpenAI(), model=True),  # OpenAI's wire format
    "/v1/messages": Route(("POST",), v1.answer, Anthropic(), model=True),  # Anthropic's
    "/v1/completions": Route(("POST",), v1.answer, Completions(), model=True),  # OpenAI's text completions
    "/v1/responses": Route(("POST",), responses.create, Responses(), model=True),  # OpenAI's Responses API
    "/v1/models": Route(("GET",), v1.models, OpenAI()),
}
# Paths with an id in them: the longest prefix that matches names the route.
PREFIXES = {
    responses.PREFIX: Route(("GET", "POST"), responses.item, Responses(), model=True),  # {id}, {id}/cancel
}


def find(path: str) -> Route | None:
    """The route of a request's path: its own, or its prefix's."""
    if (route := ROUTES.get(path)) is not None:
        return route
    return next((r for prefix, r in PREFIXES.items() if path.startswith(prefix) and len(path) > len(prefix)), None)
