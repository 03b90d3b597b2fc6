"""HTTP/1.1 on each connection: its requests one after another, each checked, routed to its
handler, and every error said in one place (Exchange.fail).

`HttpProtocol(ctx).handle` is what asyncio's server calls for each connection. A connection
carries requests in order (pipelined ones too) while it may stay open: HTTP/1.1 without
`Connection: close`, a response with a length, at most --keepalive-requests of them, each
within --keepalive-timeout of the last, and not while the server drains. Before a handler runs:
the Host (guard.py), the route and its methods, CORS and preflights, the API key, JSON bodies,
and whether the model has loaded. A bug costs one request (a 500, logged), never the server.
"""

from __future__ import annotations

import asyncio
import sys

from streaming.server import routes
from streaming.server.connection import BodyBudget, Connection
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.guard import allowed_hosts, check_host, check_json, check_key, cors, preflight
from streaming.server.state import Phase
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.http11 import Request

SHUTTING_DOWN = ProtocolError("server shutting down", 503, close_code=1001, kind="shutting_down")
INTERNAL = ProtocolError("internal error", 500, close_code=1011)
UNREAD = Request("", "", "HTTP/1.1", {})  # what an exchange holds until its request has been read


class HttpProtocol:
    def __init__(self, ctx: Context) -> None:
        self.ctx, self.config = ctx, ctx.config
        self.hosts = allowed_hosts(ctx.config.host, ctx.config.allow_host)
        self.bodies = BodyBudget(ctx.config.body_memory)  # request bodies still arriving, all together

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state = self.ctx.state
        task = asyncio.current_task()
        assert task is not None
        state.connections.add(task)
        state.accepted += 1
        conn = Connection(reader, writer, self.bodies)
        try:
            await self.requests(conn, task)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away between requests
        finally:
            state.connections.discard(task)
            try:
                await conn.close(self.config.write_timeout)
            except asyncio.CancelledError:  # (the loop is ending)
                writer.transport.abort()

    async def requests(self, conn: Connection, task: asyncio.Task[None]) -> None:
        """The requests of one connection, one after another, while it may stay open."""
        config, state = self.config, self.ctx.state
        for n in range(config.keepalive_requests):
            state.idle.add(task)
            try:
                wait = config.request_timeout if n == 0 else config.keepalive_timeout
                if state.phase is not Phase.SERVING or not await conn.next_bytes(wait):
                    return
            finally:
                state.idle.discard(task)
            reusable = await self.exchange(conn, keep_alive=n + 1 < config.keepalive_requests)
            # Every answer goes out within --write-timeout, a whole one too: a client that
            # pipelines requests and reads none of the answers is dropped, not served forever.
            if not await conn.drain(config.write_timeout) or not reusable:
                return

    async def exchange(self, conn: Connection, keep_alive: bool) -> bool:
        """Read one request and answer it; whether the connection may carry another."""
        ex = Exchange(conn, UNREAD, write_timeout=self.config.write_timeout)  # (a 400, 408 or 431 while reading)
        try:
            request = await conn.read_request(self.config.request_timeout, self.bodies, self.vet)
            if request is None:
                return False
            self.ctx.state.served += 1
            close = "close" in request.headers.get("connection", "").lower() or request.version != "HTTP/1.1"
            ex = Exchange(conn, request, keep_alive=keep_alive and not close, write_timeout=self.config.write_timeout)
            await self.dispatch(ex)
        except (ProtocolError, InvalidRequest) as e:
            if ex.request is UNREAD and conn.unfinished is not None:  # its head was read: its endpoint's error
                if (route := self.prepare(ex, conn.unfinished)) is not None:
                    ex.format = route.format
            await ex.fail(e)
        except (ConnectionError, asyncio.IncompleteReadError):
            return False
        except asyncio.CancelledError:  # the shutdown's last resort: what still runs ends now
            await ex.fail(SHUTTING_DOWN)
            raise
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, not the server
            print(f"internal error: {e!r}", file=sys.stderr, flush=True)
            await ex.fail(INTERNAL)
        return ex.reusable

    def prepare(self, ex: Exchange, request: Request) -> routes.Route | None:
        """The request's route, and the CORS fields its answers carry whatever they say (an
        error's too: a 404 and a 421 as well)."""
        route = routes.find(request.path)
        if route is None or route.cors:
            ex.cors = cors(request, self.config.allow_origin)
        return route

    def vet(self, request: Request) -> None:
        """What a request must pass on its head alone, before its body is read: its Host, its
        path, and the key where its route needs one (a stranger without the key reserved the
        bodies' budget with heads of 1 MiB bodies never sent, and every POST got 503)."""
        route = routes.find(request.path)
        check_host(request, self.hosts)
        if route is None:
            raise ProtocolError(f"no such path: {request.path}", 404)
        if request.method in route.methods and not route.open:  # (a preflight and a 405 need no key)
            check_key(request, self.config.api_key)

    async def dispatch(self, ex: Exchange) -> None:
        request, ctx = ex.request, self.ctx
        route = self.prepare(ex, request)
        assert route is not None  # (vet: a 404 before the body)
        ex.format = route.format  # the /v1/ family answers every error in its API's shape
        if request.method == "OPTIONS":
            fields = preflight(request, self.config.allow_origin, route.methods)
            ex.cors = []
            ex.respond(204, content_type=None, fields=fields)
            return
        if request.method not in route.methods:
            allow = ", ".join(route.methods)
            raise ProtocolError(f"{request.path} takes {' or '.join(route.methods)}", 405, headers=[("Allow", allow)])
        check_json(request)
        if route.model and not ctx.backend.loaded:
            raise ProtocolError("the model is still loading: GET /ready says when", 503, headers=[("Retry-After", "2")])
        await route.handler(ctx, ex)
