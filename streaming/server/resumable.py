"""Resumable streams: GET /stream?prompt=... (EventSource's way), a POST /stream with
{"resumable": true}, a reader coming back with Last-Event-ID, and POST /stop.

The generation's pieces go into a numbered record (streams.py) by a pump task that outlives its
readers; each reader follows the record from where it left off. Closing a resumable stream only
pauses it: generation goes on for the grace period, and POST /stop ends it now. With
--store redis:// (shared.py) the record is mirrored to Redis: a resume of a stream this replica does not know is served from there
(takeover.py), and POST /stop reaches the replica that generates it.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from streaming.generation.prompts import Prompt
from streaming.server import takeover
from streaming.server.connection import Connection
from streaming.server.streams import RETRY_MS, Recording
from streaming.wire import sse
from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.http11 import Request, head, json_response, response
from streaming.wire.params import flag, plain_request, query_body

if TYPE_CHECKING:
    from streaming.server.app import Server

SSE_HEAD = head(200, sse.RESPONSE_FIELDS) + f"retry: {RETRY_MS}\n\n".encode()


def wanted(request: Request) -> bool:
    """A POST /stream is the article's (it stops when its reader leaves) unless it resumes an
    earlier stream or its body asks for {"resumable": true}."""
    if "last-event-id" in request.headers or "last_event_id" in request.query:
        return True
    return flag(request.json(), "resumable")


async def resumable(srv: Server, conn: Connection, request: Request) -> None:
    last = request.headers.get("last-event-id", request.query.get("last_event_id"))
    if last is not None:  # a reader coming back: what it missed, then the live rest
        found = srv.streams.find(last)
        if found is None and srv.shared is not None:  # perhaps generated on another replica
            found = await takeover.find(srv, srv.shared, last)
        if found is None:  # unknown, forgotten, or already complete: 204 stops EventSource
            conn.write(response(204, content_type=None))
            return
        await follow(srv, conn, *found)
        return
    body = query_body(request.query) if request.method == "GET" else request.json()
    body.pop("resumable", None)
    prompt, params = plain_request(body)
    rec = srv.streams.create(await srv.runner.open(Prompt(prompt), params))
    rec.add(json.dumps({"id": rec.id}), event="stream")  # event 0 names the stream, for /stop
    if srv.shared is not None:
        srv.shared.own(rec)
    start_pump(srv, rec)
    await follow(srv, conn, rec, -1)


def start_pump(srv: Server, rec: Recording) -> None:
    task = asyncio.create_task(pump(srv, rec))
    srv.pumps.add(task)
    task.add_done_callback(srv.pumps.discard)


async def pump(srv: Server, rec: Recording) -> None:
    """Move the job's pieces into its recording, whoever is reading (or nobody, for a while).
    A job handed off to another replica (shutdown) ends without an end event: its readers
    reconnect, and the replica that takes it over writes the rest."""
    job = rec.job
    try:
        async for piece in srv.pieces(job):
            rec.add(json.dumps({"text": piece}), ids=getattr(piece, "ids", ()))
        if not job.handed_off:  # (handed off: no end here, the taker writes it)
            cut = srv.cut_short(job)
            rec.add(json.dumps(error_body(cut)), event="error", last=True) if cut else rec.add("[DONE]", last=True)
    except ProtocolError as e:
        rec.add(json.dumps(error_body(e)), event="error", last=True)
    finally:
        job.stop.set()
        rec.end()
        srv.record("/stream", job, await job.done, job.reason == "stopped", "stopped early")


async def follow(srv: Server, conn: Connection, rec: Recording, after: int) -> None:
    """Send a recording's events after number `after`, then each new one as it comes, with a
    keep-alive during silence, until its end or until this reader leaves (which starts the
    grace period if it was the last reader)."""
    config = srv.config
    conn.start_stream(SSE_HEAD)
    rec.attach()
    watcher = asyncio.create_task(conn.watch())
    k, sent = after + 1, 0
    try:
        while True:
            while k < len(rec.events):
                if not await conn.send(rec.events[k], config.write_timeout):
                    return
                k, sent = k + 1, sent + 1
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
            if not done and not await conn.send(sse.comment("ping"), config.write_timeout):
                return
    finally:
        watcher.cancel()
        rec.detach(None if config.naive else config.resume_grace)
        if not config.naive:
            srv.streams.limit_orphans()


async def stop(srv: Server, conn: Connection, request: Request) -> None:
    """POST /stop {"id": stream}: end a resumable stream's generation now."""
    stream_id = request.json().get("id")
    rec = srv.streams.streams.get(stream_id) if isinstance(stream_id, str) else None
    if rec is not None and rec.job is not None:
        rec.job.stop.set()
        stopped: bool | None = not rec.ended
    elif srv.shared is not None and isinstance(stream_id, str):  # generated on another replica, if at all: Redis says
        stopped = await srv.shared.stop(stream_id)
    else:
        stopped = None
    if stopped is None:
        raise ProtocolError("no such stream (or it was forgotten)", 404)
    conn.write(json_response(200, {"id": stream_id, "stopped": stopped}))
