"""The article's endpoints: POST /complete (the whole text as JSON at the end) and POST /stream
(server-sent events, `data: {"text": piece}` per event then `data: [DONE]`; an event carries one
piece, or several as merging.py says, the request's `"stream_interval": N` included).

Either stops its generation the moment the reader leaves (end-of-file or a failed write), unless
the server is --naive (answer.py). A GET /stream, or a POST that resumes or asks for
{"resumable": true}, is a resumable stream instead (resumable/endpoints.py). Leaves out: stop
strings (the /v1/ APIs have them).
"""

from __future__ import annotations

import json

from streaming.generation.job import Job
from streaming.generation.prompts import Prompt
from streaming.server.answer import Answer, ping_note
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.resumable import endpoints as resumable
from streaming.wire import sse
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.params import plain_request, stream_interval


def text_event(piece: str) -> bytes:
    return sse.event(json.dumps({"text": piece}))


def error_event(err: ProtocolError) -> bytes:
    """An error after the 200, in our own endpoints' shape: an `error` event."""
    return sse.event(json.dumps(error_body(err)), event="error")


async def start(ctx: Context, ex: Exchange) -> Job:
    prompt, params = plain_request(ex.request.json())
    return await ctx.backend.open(Prompt(prompt), params)


async def complete(ctx: Context, ex: Exchange) -> None:
    job = await start(ctx, ex)
    async with Answer(ctx.answers, job, "/complete", watch=ex.conn, whole=True) as answer:
        text = "".join([piece async for piece in answer.pieces()])
    if not answer.left:
        ex.respond_json(200, {"text": text})


async def stream(ctx: Context, ex: Exchange) -> None:
    if ex.request.method == "GET" or resumable.wanted(ex.request):
        await resumable.resumable(ctx, ex)
        return
    interval = stream_interval(ex.request.json())  # (checked before the job starts: a 422)
    job = await start(ctx, ex)

    async def ending(err: ProtocolError) -> None:
        await ex.send(error_event(err))

    async def deliver(piece: str) -> bool:
        return await ex.send(text_event(piece))

    async def ping() -> bool:
        return await ex.send(sse.comment(ping_note(ctx.backend.position(job))))

    async with Answer(ctx.answers, job, "/stream", watch=ex.conn) as answer:
        ex.start_stream(sse.RESPONSE_FIELDS, ending)
        await answer.relay(deliver, ping, merging=ctx.config.merging(interval), outlet=ex)
    if not answer.left:
        ex.end_stream()
        await ex.send(sse.DONE)
