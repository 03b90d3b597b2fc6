"""A server's life: its parts made from its settings (`build`), listening at once while the model
loads, serving until SIGTERM or SIGINT, then draining (`shutdown`).

Without --naive a job stops the moment its reader leaves; with it, it generates every token for
nobody (answer.py). Leaves out: TLS, HTTP/2, and chunked request bodies.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable

from streaming.generation.backend import Backend
from streaming.generation.policy import schedule
from streaming.generation.upstream.pool import Pool
from streaming.http_client import failure
from streaming.model.loading import Model
from streaming.server.answer import Answers
from streaming.server.config import Config
from streaming.server.context import Context
from streaming.server.metrics import Metrics
from streaming.server.protocol import HttpProtocol
from streaming.server.resumable.recordings import Recordings
from streaming.server.resumable.streams import Streams
from streaming.server.state import Phase, ServerState

SHUTDOWN_JOIN = 5.0  # seconds to wait for generation to end at shutdown


def build(config: Config, model: Model | None = None, backend: Backend | None = None) -> Context:
    """A server's parts: its backend (the engine, with `model` for a local one), its answers'
    log and metrics, its resumable streams (in memory, or shared through Redis), its state."""
    pool = None
    if config.upstream:
        pool = Pool(
            list(config.upstream),
            config.upstream_key,
            config.upstream_model,
            config.upstream_first_text,
            config.upstream_silence,
        )
    backend = backend or Backend(
        config.engine,
        config.job_options(),
        model=model,
        max_batch=config.max_batch,
        max_waiting=config.max_waiting,
        kv_memory=config.kv_memory,
        retain_memory=config.retain_memory,
        prefill_chunk=config.prefill_chunk,
        policy=schedule(config.schedule, config.prefill_budget, config.speculate),
        pool=pool,
    )
    state = ServerState()
    metrics = Metrics(
        active=lambda: len(backend.stats.active),
        waiting=backend.waiting,
        connections=lambda: len(state.connections),
    )
    answers = Answers(metrics, state, config.ping, config.naive, config.log_keep)
    recordings = Recordings(config.resume_streams, config.resume_keep, config.resume_orphans)
    streams = Streams(recordings, answers)
    if config.replicated:
        streams.replicate(
            config.store,
            config.resume_keep,
            config.resume_grace,
            backend,
            on_error=metrics.store_errors.inc,
            on_takeover=metrics.takeovers.inc,
        )
    return Context(config, backend, answers, streams, state)


async def shutdown(ctx: Context, listener: asyncio.Server) -> None:
    """Drain: accept no more; let the answers in flight finish for --shutdown-grace seconds;
    then stop the rest, which end as their endpoint says an error (an error event, a 503, a
    close 1001) and are logged, within --shutdown-end seconds; cancel what still runs after that
    (a reader too slow to take its end within them is dropped without it)."""
    state = ctx.state
    listener.close()
    state.phase = Phase.DRAINING
    if ctx.config.replicated:  # the live streams go on on other replicas: end them here now
        print(f"handing off {ctx.streams.hand_off()} live streams", flush=True)
    for task in list(state.idle):  # keep-alive connections between requests: nothing to finish
        task.cancel()
    busy = state.connections | state.background
    if busy:
        await asyncio.wait(busy, timeout=ctx.config.shutdown_grace)
    state.phase = Phase.CLOSING
    ctx.backend.stop_all()
    busy = state.connections | state.background
    if busy:
        await asyncio.wait(busy, timeout=ctx.config.shutdown_end)
    tasks = list(state.connections | state.background)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await ctx.streams.close(ctx.config.shutdown_end)
    await ctx.backend.wait_all(SHUTDOWN_JOIN)


async def serve(config: Config, model: Model | None = None, load: Callable[[], str] | None = None) -> int:
    """Listen at once, then run `load` (the model) in a thread while /health and /ready answer;
    serve until SIGTERM or SIGINT, then drain. The exit status: 1 if the model failed to load."""
    ctx = build(config, model)
    # asyncio sets TCP_NODELAY on every connection
    try:
        listener = await asyncio.start_server(
            HttpProtocol(ctx).handle, config.host, config.port, backlog=config.backlog
        )
    except OSError as e:  # a port taken or not ours to take, an address not this machine's, a name unknown
        print(f"error: cannot listen on {config.host}:{config.port}: {failure(e)}", file=sys.stderr, flush=True)
        return 1
    port = listener.sockets[0].getsockname()[1]
    print(f"listening on http://{config.host}:{port}{' (naive)' if config.naive else ''}", flush=True)
    ctx.streams.start(port)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    failed: list[BaseException] = []

    async def loading(load: Callable[[], str]) -> None:
        try:
            print(await ctx.backend.load(load), flush=True)
        except Exception as e:  # noqa: BLE001 - a model that cannot load ends the server, in one line
            failed.append(e)
            done.set()

    loader = asyncio.create_task(loading(load)) if load is not None else None
    async with listener:
        await done.wait()
        await shutdown(ctx, listener)
    if loader is not None:
        loader.cancel()
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        return 1
    print("shut down", flush=True)
    return 0
