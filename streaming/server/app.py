"""`Server`: the route table, the state one server owns, and relaying a job's pieces; `serve()`.

A request is read (connection.py), looked up in ROUTES (a path's methods, its handler, and the
error shape of its family), and handed to the handler, which streams a job's pieces through
`pieces()` or `relay()`. Every error a handler raises reaches `Connection.fail`. Without --naive
a job stops the moment its reader leaves; with it, it generates every token for nobody.
Leaves out: TLS, HTTP/2, and chunked request bodies.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from streaming.generation.job import Job
from streaming.generation.policy import schedule
from streaming.generation.runner import Runner
from streaming.generation.upstream import Pool
from streaming.server import apis, info, plain, resumable, websocket
from streaming.server.config import Config
from streaming.server.connection import Budget, Connection
from streaming.server.guard import allowed_hosts, check_host, check_json, check_key, cors, preflight
from streaming.server.metrics import Metrics
from streaming.server.shared import Shared
from streaming.server.streams import Store
from streaming.wire.anthropic import Anthropic
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.http11 import response
from streaming.wire.openai import OpenAI

SHUTDOWN_JOIN = 5.0  # seconds to wait for generation to end at shutdown
SHUTDOWN_END = 5.0  # seconds the answers still running after the grace have to write their end
SHUTTING_DOWN = "the server is shutting down"
Handler = Callable[["Server", Connection, Any], Awaitable[None]]


class Route(NamedTuple):
    methods: tuple[str, ...]
    handler: Handler
    api: Any = None  # a wire format object: the /v1/ family's error shape and encoders
    open: bool = False  # answered without the API key (the page, health and readiness)
    model: bool = False  # generates: 503 while the model loads


ROUTES = {
    "/": Route(("GET",), info.page, open=True),  # the browser page (page.html)
    "/favicon.ico": Route(("GET",), info.no_icon, open=True),  # 204: browsers ask; no 404 in their console
    "/health": Route(("GET",), info.health, open=True),  # liveness: 200 while the process serves
    "/ready": Route(("GET",), info.ready, open=True),  # readiness: 503 while loading or draining
    "/complete": Route(("POST",), plain.complete, model=True),
    "/stream": Route(("POST", "GET"), plain.stream, model=True),  # GET ?prompt=...: EventSource's way, resumable
    "/stop": Route(("POST",), resumable.stop),  # {"id": stream}: stop a resumable stream now
    "/ws": Route(("GET",), websocket.websocket, model=True),
    "/log": Route(("GET",), info.log),
    "/metrics": Route(("GET",), info.metrics),  # Prometheus' text format
    "/metrics.json": Route(("GET",), info.metrics_json),  # the same counts and more, as JSON
    "/v1/chat/completions": Route(("POST",), apis.answer, OpenAI(), model=True),  # OpenAI's wire format
    "/v1/messages": Route(("POST",), apis.answer, Anthropic(), model=True),  # Anthropic's
    "/v1/models": Route(("GET",), apis.models, OpenAI()),
}


class Server:
    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        self.config = config
        pool = Pool(list(config.upstream), config.upstream_key, config.upstream_model) if config.upstream else None
        self.runner = runner or Runner(
            config.engine,
            config.job_settings(),
            config.max_batch,
            config.prefill_chunk,
            schedule(config.schedule, config.prefill_budget),
            pool,
        )
        self.log: list[list[Any]] = []  # [path, generated tokens, client left early], one per finished request
        self.connections: set[asyncio.Task[Any]] = set()  # handler tasks
        self.idle: set[asyncio.Task[Any]] = set()  # those waiting for a request: closed at once on shutdown
        self.accepted = 0
        self.served = 0
        self.streams = Store(config.resume_streams, config.resume_keep, config.resume_orphans)  # resumable
        self.shared = Shared(config.store, config.resume_keep, config.resume_grace) if config.shared else None
        self.pumps: set[asyncio.Task[Any]] = set()  # their tasks, which outlive their readers
        self.bodies = Budget(config.body_memory)  # request bodies still arriving, all together
        self.hosts = allowed_hosts(config.host, config.allow_host)
        self.closing = False  # shutdown: the grace is over, answers still running end with an error
        self.loading = False  # the model is loading: /ready says 503, generating endpoints too
        self.draining = False  # shutdown has begun: /ready says 503
        self.metrics = Metrics(
            active=lambda: len(self.runner.stats.active),
            waiting=lambda: self.runner.metrics().get("waiting", 0),
            connections=lambda: len(self.connections),
        )

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        self.accepted += 1
        conn = Connection(reader, writer)
        try:
            await self.requests(conn, task)
        except (ProtocolError, InvalidRequest) as e:
            await conn.fail(e)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            if conn.ws is not None:
                await conn.ws.close(1001, "server shutting down")
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, not the server
            print(f"internal error: {e!r}", file=sys.stderr, flush=True)
            await conn.fail(ProtocolError("internal error", 500, close_code=1011))
        finally:
            self.connections.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def requests(self, conn: Connection, task: asyncio.Task[Any]) -> None:
        """The requests of one connection, one after another (pipelined ones in order), while it
        may stay open: HTTP/1.1 without `Connection: close`, a response with a length, at most
        --keepalive-requests of them, each within --keepalive-timeout of the last, not draining."""
        config = self.config
        for n in range(config.keepalive_requests):
            self.idle.add(task)
            try:
                wait = config.request_timeout if n == 0 else config.keepalive_timeout
                if self.draining or not await conn.next_bytes(wait):
                    return
            finally:
                self.idle.discard(task)
            conn.begin(keep_alive=False)  # a fresh response: a 400 while reading must still be written
            request = await conn.read_request(config.request_timeout, self.bodies)
            if request is None:
                return
            self.served += 1
            close = "close" in request.headers.get("connection", "").lower() or request.version != "HTTP/1.1"
            conn.keep_alive = not close and n + 1 < config.keepalive_requests
            await self.dispatch(conn, request)
            await conn.writer.drain()
            if not conn.keep_alive or conn.gone:
                return

    async def dispatch(self, conn: Connection, request: Any) -> None:
        check_host(request, self.hosts)
        route = ROUTES.get(request.path)
        if route is None:
            raise ProtocolError(f"no such path: {request.path}", 404)
        if route.api is not None:  # the /v1/ family answers every error in its API's shape
            conn.api, conn.error_body, conn.invalid_status = route.api, route.api.error_body, 400
        if request.path != "/ws":  # (a WebSocket's Origin is checked in its handshake)
            conn.extra_headers = cors(request, self.config.allow_origin) or []
        if request.method == "OPTIONS":
            fields = preflight(request, self.config.allow_origin, route.methods)
            conn.extra_headers = []
            conn.write(response(204, content_type=None, headers=fields))
            return
        if request.method not in route.methods:
            allow = ", ".join(route.methods)
            raise ProtocolError(f"{request.path} takes {' or '.join(route.methods)}", 405, headers=[("Allow", allow)])
        if not route.open:
            check_key(request, self.config.api_key)
        check_json(request)
        if route.model and self.loading:
            raise ProtocolError("the model is still loading: GET /ready says when", 503, headers=[("Retry-After", "2")])
        await route.handler(self, conn, request)

    def record(
        self, path: str, job: Job, produced: int, left: bool, what: str = "client left early", whole: bool = False
    ) -> None:
        """The article's log line, and the request's metrics (`whole`: the answer went out at once)."""
        self.log.append([path, produced, left])
        print(f"{path}: generated {produced} tokens, {what}: {left}", flush=True)
        if job.reason is None:
            outcome = "error"
        elif left and what == "client left early":
            outcome = "reader_left"
        else:
            outcome = "stopped" if job.reason == "stopped" else "finished"
        self.metrics.ended(path, job, outcome, whole)

    def watcher(self, conn: Connection, job: Job) -> asyncio.Task[None] | None:
        return None if self.config.naive else asyncio.create_task(conn.watch(job))

    async def pieces(self, job: Job, on_silence: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[str]:
        """Yield the job's text pieces until its end. Raise ProtocolError(500) if it failed.
        After --ping seconds without a piece, call on_silence(); if that says the reader is gone
        (False), stop the job and return early."""
        while True:
            if not job.out.empty():  # a piece is ready: take it without a task or a timer
                item = await job.get()
            else:
                getter = asyncio.ensure_future(job.get())
                while not getter.done():
                    done, _ = await asyncio.wait({getter}, timeout=self.config.ping)
                    if not done and on_silence is not None and not await on_silence():
                        getter.cancel()
                        job.stop.set()
                        return
                item = getter.result()
            if item is None:
                return
            if isinstance(item, ProtocolError):  # an upstream's failure, in its own words
                raise item
            if isinstance(item, BaseException):
                raise ProtocolError(f"generation failed: {item}", 500, close_code=1011, kind="generation_failed")
            now = time.monotonic()
            if job.last_at is None:
                job.first_at = now
            else:
                self.metrics.gaps.observe(now - job.last_at)
            job.last_at = now
            job.arrivals.append(now - job.created)
            yield item

    async def relay(self, conn: Connection, job: Job, frame: Callable[[str], bytes], keep_alive: bytes, matcher=None):
        """Send each piece of the job as `frame(piece)` (through a StopMatcher if given), and
        `keep_alive` during silence; return whether the reader left. Without --naive a failed
        write stops the job; with it, the job goes on for nobody. Raises the job's failure."""
        left, timeout = False, self.config.write_timeout

        async def silence() -> bool:
            nonlocal left
            left = left or not await conn.send(keep_alive, timeout)
            return not left

        async for piece in self.pieces(job, on_silence=silence):
            if left:
                continue  # --naive: keep generating for nobody
            text = matcher.push(piece) if matcher else piece
            if text and not await conn.send(frame(text), timeout):
                left = True
                if not self.config.naive:
                    job.stop.set()
                    break
            if matcher and matcher.matched is not None:
                job.stop.set()
                break
        if matcher and not left and (rest := matcher.flush()):
            left = not await conn.send(frame(rest), timeout)
        return left

    def cut_short(self, job: Job) -> ProtocolError | None:
        """The error to end the answer with if the shutdown stopped its job, else None."""
        if self.closing and job.reason == "stopped":
            return ProtocolError(SHUTTING_DOWN, 503, close_code=1001, kind="shutting_down")
        return None


async def shutdown(srv: Server, listener: asyncio.Server) -> None:
    """Drain: accept no more; let the answers in flight finish for --shutdown-grace seconds;
    then stop the rest, which end as their endpoint says an error (an error event, a 503, a
    close 1001) and are logged; cancel only what still runs after that."""
    listener.close()
    srv.draining = True
    if srv.shared is not None:  # the live streams go on on other replicas: end them here now
        print(f"handing off {srv.shared.hand_off()} live streams", flush=True)
    for task in list(srv.idle):  # keep-alive connections between requests: nothing to finish
        task.cancel()
    busy = set(srv.connections) | set(srv.pumps)
    if busy:
        await asyncio.wait(busy, timeout=srv.config.shutdown_grace)
    srv.closing = True
    srv.runner.stop_all()
    busy = set(srv.connections) | set(srv.pumps)
    if busy:
        await asyncio.wait(busy, timeout=SHUTDOWN_END)
    for task in list(srv.connections) + list(srv.pumps):
        task.cancel()
    await asyncio.gather(*srv.connections, *srv.pumps, return_exceptions=True)
    if srv.shared is not None:
        await srv.shared.close(SHUTDOWN_END)
    await srv.runner.wait_all(SHUTDOWN_JOIN)


async def serve(config: Config, load: Callable[[], str] | None = None) -> int:
    """Listen at once, then run `load` (the model) in a thread while /health and /ready answer;
    serve until SIGTERM or SIGINT, then drain. The exit status: 1 if the model failed to load."""
    srv = Server(config)
    # asyncio sets TCP_NODELAY on every connection
    listener = await asyncio.start_server(srv.handle, config.host, config.port, backlog=config.backlog)
    port = listener.sockets[0].getsockname()[1]
    print(f"listening on http://{config.host}:{port}{' (naive)' if config.naive else ''}", flush=True)
    if srv.shared is not None:
        srv.shared.name = f"{srv.shared.name}:{port}"
        srv.shared.start(srv)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    failed: list[BaseException] = []

    async def loading() -> None:
        try:
            print(await asyncio.to_thread(load), flush=True)  # type: ignore[arg-type]
            srv.loading = False
        except Exception as e:  # noqa: BLE001 - a model that cannot load ends the server, in one line
            failed.append(e)
            done.set()

    if load is not None:
        srv.loading = True
        loader = asyncio.create_task(loading())
    async with listener:
        await done.wait()
        await shutdown(srv, listener)
    if load is not None:
        loader.cancel()
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    print("shut down", flush=True)
    return 0
