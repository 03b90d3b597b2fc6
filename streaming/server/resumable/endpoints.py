"""Resumable streams on the wire: GET /stream?prompt=... (EventSource's way), a POST /stream with
{"resumable": true}, a reader coming back with Last-Event-ID, and POST /stop.

The generation's pieces go into a numbered recording by a pump that outlives its readers
(streams.py, pump.py); each reader follows the recording from where it left off. Closing a
resumable stream only pauses it: generation goes on for the grace period, and POST /stop ends it
now. With --store redis:// a resume of a stream this replica does not know is served from Redis,
and POST /stop reaches the replica that generates it (both through `Streams`).
"""

from __future__ import annotations

import asyncio

from streaming.generation.prompts import Prompt
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.resumable.recordings import RETRY_MS, Recording, valid_id
from streaming.wire import sse
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Request
from streaming.wire.params import flag, plain_request, query_body

# How soon EventSource reconnects, as a field of the first event each connection is sent: a block
# of its own would dispatch nothing by the spec, but some clients (httpx-sse) yield it as an empty
# event, and a `json.loads(event.data)` loop over them fails.
RETRY = f"retry: {RETRY_MS}\n".encode()
PING = sse.comment("ping")


def wanted(request: Request) -> bool:
    """A POST /stream is the article's (it stops when its reader leaves) unless it resumes an
    earlier stream or its body asks for {"resumable": true}."""
    if "last-event-id" in request.headers or "last_event_id" in request.query:
        return True
    return flag(request.json(), "resumable")


async def resumable(ctx: Context, ex: Exchange) -> None:
    request = ex.request
    last = request.headers.get("last-event-id", request.query.get("last_event_id"))
    if last is not None:  # a reader coming back: what it missed, then the live rest
        found = await ctx.streams.find(last)
        if found is None:  # unknown, forgotten, or already complete: 204 stops EventSource
            ex.respond(204, content_type=None)
            return
        await follow(ctx, ex, *found)
        return
    body = query_body(request.query) if request.method == "GET" else request.json()
    body.pop("resumable", None)
    prompt, params = plain_request(body)
    rec = ctx.streams.open(await ctx.backend.open(Prompt(prompt), params))
    await follow(ctx, ex, rec, -1)


async def follow(ctx: Context, ex: Exchange, rec: Recording, after: int) -> None:
    """Send a recording's events after number `after`, then each new one as it comes, with a
    keep-alive during silence, until its end or until this reader leaves (which starts the
    grace period if it was the last reader). Its errors are the recording's own events."""
    config, conn = ctx.config, ex.conn
    rec.attach()
    watcher = asyncio.create_task(conn.watch())
    k, sent, retry = after + 1, 0, RETRY
    try:
        ex.start_stream(sse.RESPONSE_FIELDS, None)
        while True:
            while k < len(rec.events):
                if not await ex.send(retry + rec.events[k]):
                    return
                retry = b""
                k, sent = k + 1, sent + 1
                rec.sent(k)
                if config.drop_after and sent >= config.drop_after and not (rec.ended and k == len(rec.events)):
                    conn.writer.transport.abort()  # testing: the network blinks
                    return
            if rec.ended:
                return
            grew = asyncio.ensure_future(rec.grew.wait())
            done, _ = await asyncio.wait({grew, watcher}, timeout=config.ping, return_when=asyncio.FIRST_COMPLETED)
            grew.cancel()
            if watcher in done:
                return
            if not done and not await ex.send(PING):
                return
    finally:
        watcher.cancel()
        ctx.streams.detach(rec, None if config.naive else config.resume_grace)
        await asyncio.gather(watcher, return_exceptions=True)  # gone before the connection's close reads


async def stop(ctx: Context, ex: Exchange) -> None:
    """POST /stop {"id": stream}: end a resumable stream's generation now."""
    stream_id = ex.request.json().get("id")
    stopped = await ctx.streams.stop(stream_id) if isinstance(stream_id, str) and valid_id(stream_id) else None
    if stopped is None:
        raise ProtocolError("no such stream (or it was forgotten)", 404)
    ex.respond_json(200, {"id": stream_id, "stopped": stopped})
