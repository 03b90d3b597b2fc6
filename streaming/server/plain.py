"""The article's endpoints: POST /complete (the whole text as JSON at the end) and POST /stream
(server-sent events, `data: {"text": piece}` per piece then `data: [DONE]`).

Either stops its generation the moment the reader leaves (end-of-file or a failed write), unless
the server is --naive. A GET /stream, or a POST that resumes or asks for {"resumable": true}, is
a resumable stream instead (resumable.py). Leaves out: stop strings (the /v1/ APIs have them).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from streaming.generation.prompts import Prompt
from streaming.server import resumable
from streaming.server.connection import Connection
from streaming.wire import sse
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.http11 import Request, head, json_response
from streaming.wire.params import plain_request

if TYPE_CHECKING:
    from streaming.server.app import Server

SSE_HEAD = head(200, sse.RESPONSE_FIELDS)


def text_event(piece: str) -> bytes:
    return sse.event(json.dumps({"text": piece}))


async def start(srv: Server, request: Request):
    prompt, params = plain_request(request.json())
    return await srv.runner.open(Prompt(prompt), params)


async def complete(srv: Server, conn: Connection, request: Request) -> None:
    job = await start(srv, request)
    watcher = srv.watcher(conn, job)
    try:
        text = "".join([piece async for piece in srv.pieces(job)])
    finally:
        left = job.stop.is_set()  # only the watcher sets it before the end: the reader left
        job.stop.set()  # whatever happened, this request's generation must end
        if watcher:
            watcher.cancel()
        srv.record("/complete", job, await job.done, left, whole=True)
    if left:
        return
    if cut := srv.cut_short(job):
        raise cut
    conn.write(json_response(200, {"text": text}))


async def stream(srv: Server, conn: Connection, request: Request) -> None:
    if request.method == "GET" or resumable.wanted(request):
        await resumable.resumable(srv, conn, request)
        return
    job = await start(srv, request)
    conn.start_stream(SSE_HEAD)
    watcher = srv.watcher(conn, job)
    try:
        left = await srv.relay(conn, job, text_event, sse.comment("ping"))
        cut = srv.cut_short(job)
        end = sse.event(json.dumps(error_body(cut)), event="error") if cut else sse.DONE
    except ProtocolError as e:  # after the 200 the status can't change: an error event
        left, end = False, sse.event(json.dumps(error_body(e)), event="error")
    finally:
        job.stop.set()
        if watcher:
            watcher.cancel()
    left = left or conn.gone
    if not left:
        await conn.send(end, srv.config.write_timeout)
    srv.record("/stream", job, await job.done, left)
