"""`Server`: the route table, the state one server owns, and relaying a job's pieces; `serve()`.

A request is read (connection.py), looked up in ROUTES (a path's methods, its handler, and the
error shape of its family), and handed to the handler, which streams a job's pieces through
`pieces()` or `relay()`. Every error a handler raises reaches `Connection.fail`. Without --naive
a job stops the moment its reader leaves; with it, it generates every token for nobody.
Leaves out: keep-alive, TLS, HTTP/2, and chunked request bodies.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

from streaming.generation.job import Job
from streaming.generation.runner import Runner
from streaming.server import apis, info, plain, resumable, websocket
from streaming.server.config import Config
from streaming.server.connection import Connection
from streaming.server.streams import Store
from streaming.wire.anthropic import Anthropic
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.openai import OpenAI
from streaming.wire.params import GenerationParams

SHUTDOWN_JOIN = 5.0  # seconds to wait for generation to end at shutdown
Handler = Callable[["Server", Connection, Any], Awaitable[None]]


class Route(NamedTuple):
    methods: tuple[str, ...]
    handler: Handler
    api: Any = None  # a wire format object: the /v1/ family's error shape and encoders


ROUTES = {
    "/": Route(("GET",), info.page),  # the browser page (page.html)
    "/complete": Route(("POST",), plain.complete),
    "/stream": Route(("POST", "GET"), plain.stream),  # GET ?prompt=...: EventSource's way, resumable
    "/stop": Route(("POST",), resumable.stop),  # {"id": stream}: stop a resumable stream now
    "/ws": Route(("GET",), websocket.websocket),
    "/log": Route(("GET",), info.log),
    "/metrics": Route(("GET",), info.metrics),
    "/v1/chat/completions": Route(("POST",), apis.answer, OpenAI()),  # OpenAI's wire format
    "/v1/messages": Route(("POST",), apis.answer, Anthropic()),  # Anthropic's
    "/v1/models": Route(("GET",), apis.models, OpenAI()),
}


class Server:
    def __init__(self, config: Config, runner: Runner | None = None) -> None:
        self.config = config
        self.runner = runner or Runner(config.engine, config.job_settings(), config.max_batch, config.prefill_chunk)
        self.log: list[list[Any]] = []  # [path, generated tokens, client left early], one per finished request
        self.connections: set[asyncio.Task[Any]] = set()  # handler tasks
        self.websockets: set[Any] = set()  # open WebSocket sessions, closed with 1001 at shutdown
        self.served = 0
        self.streams = Store(config.resume_streams, config.resume_keep)  # resumable streams
        self.pumps: set[asyncio.Task[Any]] = set()  # their tasks, which outlive their readers

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        conn = Connection(reader, writer)
        try:
            request = await conn.read_request(self.config.request_timeout)
            if request is not None:
                self.served += 1
                await self.dispatch(conn, request)
                await conn.writer.drain()
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

    async def dispatch(self, conn: Connection, request: Any) -> None:
        route = ROUTES.get(request.path)
        if route is None:
            raise ProtocolError(f"no such path: {request.path}", 404)
        if route.api is not None:  # the /v1/ family answers every error in its API's shape
            conn.api, conn.error_body, conn.invalid_status = route.api, route.api.error_body, 400
        if request.method not in route.methods:
            allow = ", ".join(route.methods)
            raise ProtocolError(f"{request.path} takes {' or '.join(route.methods)}", 405, headers=[("Allow", allow)])
        await route.handler(self, conn, request)

    def job(self, ids: list[int], params: GenerationParams) -> Job:
        return self.runner.start(ids, params)

    def record(self, path: str, produced: int, left: bool, what: str = "client left early") -> None:
        self.log.append([path, produced, left])
        print(f"{path}: generated {produced} tokens, {what}: {left}", flush=True)

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
            if isinstance(item, BaseException):
                raise ProtocolError(f"generation failed: {item}", 500, close_code=1011, kind="generation_failed")
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

    def metrics(self) -> dict[str, Any]:
        stats = self.runner.stats
        return {
            **info.model_facts(),
            "naive": self.config.naive,
            "active_generations": len(stats.active),
            "generation_threads": sum(t.name == "generate" for t in threading.enumerate()),
            "open_connections": len(self.connections),
            "requests_served": self.served,
            "requests_logged": len(self.log),
            "requests_stopped": stats.stopped,  # early: the reader left or said stop
            "tokens_after_stop": stats.tokens_after_stop,  # generated for nobody after those stops
            "resumable_streams": len(self.streams.streams),
            **self.runner.metrics(),
        }

    async def shutdown(self, listener: asyncio.Server) -> None:
        listener.close()
        self.runner.stop_all()
        await asyncio.gather(*(s.close(1001, "server shutting down") for s in list(self.websockets)))
        for task in list(self.connections) + list(self.pumps):
            task.cancel()
        await asyncio.gather(*self.connections, *self.pumps, return_exceptions=True)
        await self.runner.wait_all(SHUTDOWN_JOIN)


async def serve(config: Config) -> None:
    srv = Server(config)
    listener = await asyncio.start_server(srv.handle, config.host, config.port)  # asyncio sets TCP_NODELAY
    port = listener.sockets[0].getsockname()[1]
    print(f"listening on http://{config.host}:{port}{' (naive)' if config.naive else ''}", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    async with listener:
        await done.wait()
        await srv.shutdown(listener)
    print("shut down", flush=True)
