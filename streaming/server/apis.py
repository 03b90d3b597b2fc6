"""/v1/: the OpenAI and Anthropic APIs, driven through their wire format objects.

One handler serves both: the route names the format (streaming.wire.openai / .anthropic), which
parses the request, shapes errors, and writes the whole answer or the stream's events; this
module only checks the key, starts the job, and relays, with the same stop-on-leave as /stream.
Leaves out what streaming.wire.apis leaves out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lm
from streaming.generation.prompts import Prompt
from streaming.server.connection import Connection
from streaming.server.plain import SSE_HEAD
from streaming.wire.apis import ApiRequest, Format
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Request, json_response
from streaming.wire.stops import StopMatcher

if TYPE_CHECKING:
    from streaming.server.app import Server


def model_id(srv: Server) -> str:
    """--served-model-name, else the upstream's model, else the model's short name (never a file's
    full path)."""
    if srv.config.served_model_name:
        return srv.config.served_model_name
    pool = srv.runner.pool
    return (pool.model or "upstream") if pool is not None else lm.served_name()


async def models(srv: Server, conn: Connection, _request: Request) -> None:
    fmt: Format = conn.api  # the route's format (app.ROUTES)
    conn.write(json_response(200, {"object": "list", "data": [fmt.models(model_id(srv))]}))


async def answer(srv: Server, conn: Connection, request: Request) -> None:
    fmt: Format = conn.api  # the route's format (app.ROUTES)
    api = fmt.parse(request.json())
    job = await srv.runner.open(Prompt(None, tuple(api.messages), api.continue_final), api.params)
    try:
        if api.stream:
            await stream(srv, conn, request.path, fmt, api, job)
        else:
            await whole(srv, conn, request.path, fmt, api, job)
    finally:
        job.stop.set()


async def whole(srv: Server, conn: Connection, path: str, fmt: Format, api: ApiRequest, job: Any) -> None:
    watcher = srv.watcher(conn, job)
    matcher, parts = StopMatcher(api.stop), []
    try:
        async for piece in srv.pieces(job):
            parts.append(matcher.push(piece))
            if matcher.matched is not None:
                job.stop.set()
                break
        parts.append(matcher.flush())
    except ProtocolError as e:
        raise ProtocolError(e.message, 500) from None
    finally:
        if watcher:
            watcher.cancel()
        produced = await job.done
        srv.record(path, job, produced, conn.gone, whole=True)
    if cut := srv.cut_short(job):
        raise cut
    value = fmt.whole(
        model_id(srv), "".join(parts), fmt.finish(job.reason, matcher.matched), job.prompt_tokens, produced
    )
    if not conn.gone:
        conn.write(json_response(200, value))


async def stream(srv: Server, conn: Connection, path: str, fmt: Format, api: ApiRequest, job: Any) -> None:
    enc = fmt.stream(model_id(srv), api, job.prompt_tokens)
    conn.start_stream(SSE_HEAD)
    watcher = srv.watcher(conn, job)
    matcher = StopMatcher(api.stop)
    first = await conn.send(enc.start(), srv.config.write_timeout)
    end = None
    try:
        left = await srv.relay(conn, job, enc.text, enc.keep_alive(), matcher) or not first
    except ProtocolError as e:  # after the 200: the API's own error event
        left, end = not first, enc.error(e.message)
    if watcher:
        watcher.cancel()
    produced = await job.done
    left = left or conn.gone
    enc.prompt_tokens = job.prompt_tokens  # again: an upstream's count arrives with its last chunk
    if end is None:
        cut = srv.cut_short(job)
        end = enc.error(cut.message) if cut else enc.end(fmt.finish(job.reason, matcher.matched), produced)
    if not left:
        await conn.send(end, srv.config.write_timeout)
    srv.record(path, job, produced, left)
