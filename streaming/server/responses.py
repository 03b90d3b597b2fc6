"""/v1/responses: OpenAI's Responses API, stateless, with streams that can be resumed.

- POST /v1/responses: the whole response (`stream` false), or its stream. A stream is recorded
  like GET /stream's (streaming.server.resumable): each event carries `id: S.k` and
  sequence_number k, and the response is resp_S. It goes on for --resume-grace seconds after
  its reader leaves, so a reader whose network blinks comes back to the same answer; with
  `background: true` it goes on to its end, read or not (OpenAI's background mode).
- GET /v1/responses/resp_S?stream=true&starting_after=N (the SDKs' `responses.stream(
  response_id=..., starting_after=N)`), or with Last-Event-ID: S.N: the events after N, then
  the live rest, once, on any replica with --store redis://, and after its replica died.
- POST /v1/responses/resp_S/cancel: stop generating it now.

Leaves out what streaming.wire.responses leaves out; a GET without stream=true (no response is
stored to be read whole).
"""

from __future__ import annotations

from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.server.resumable.encodings import ResponsesEvents
from streaming.server.resumable.endpoints import follow
from streaming.server.resumable.recordings import EVENT_NUMBER, valid_id
from streaming.server.v1 import model_id, prompt_of, reader_prefill, route_format, whole
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.responses import ResponsesStream

PREFIX = "/v1/responses/"


def not_found(response_id: str) -> ProtocolError:
    return ProtocolError(f"no response {response_id[:80]!r} to stream here (unknown, or already over)", 404)


async def create(ctx: Context, ex: Exchange) -> None:
    if "last-event-id" in ex.request.headers:  # a reader reconnecting the way EventSource does
        await resume(ctx, ex, ex.request.headers["last-event-id"])
        return
    fmt = route_format(ex)
    api = fmt.parse(ex.request.json())
    job = await ctx.backend.open(prompt_of(api), api.params)
    if not api.stream:
        await whole(ctx, ex, fmt, api, job)
        return
    model = model_id(ctx)
    start = reader_prefill(ctx, job)
    rec = ctx.streams.open(job, lambda sid: ResponsesEvents.new(sid, model, api.tools, start), path="/v1/responses")
    rec.background = api.background
    await follow(ctx, ex, rec, -1)


async def item(ctx: Context, ex: Exchange) -> None:
    """GET /v1/responses/{id} (its stream again) and POST /v1/responses/{id}/cancel."""
    rest = ex.request.path.removeprefix(PREFIX)
    response_id, _, action = rest.partition("/")
    stream_id = response_id.removeprefix("resp_")
    known = response_id.startswith("resp_") and valid_id(stream_id)
    if ex.request.method == "POST":
        if action != "cancel":
            raise ProtocolError(
                f"{ex.request.path} takes GET (POST only to .../cancel)", 405, headers=[("Allow", "GET")]
            )
        stopped = await ctx.streams.stop(stream_id) if known else None
        if stopped is None:
            raise not_found(response_id)
        if not stopped:  # (its end, completed, incomplete or failed, was sent: "cancelled" would be untrue)
            raise InvalidRequest(f"response {response_id} is already over: only one in progress can be cancelled")
        ex.respond_json(200, ResponsesStream(response_id, model_id(ctx), 0).response("cancelled"))
        return
    if action:
        raise ProtocolError(f"no such endpoint: {ex.request.path}", 404)
    if ex.request.query.get("stream") != "true":
        raise InvalidRequest(
            "this server keeps no responses: only a stream can be read again (stream=true, with starting_after)",
            "stream",
        )
    if not known:
        raise not_found(response_id)
    last = ex.request.headers.get("last-event-id")
    if last is None:
        after = ex.request.query.get("starting_after", "-1")
        if after != "-1" and not EVENT_NUMBER.fullmatch(after):
            raise InvalidRequest("starting_after must be a sequence number (an integer from 0)", "starting_after")
        last = f"{stream_id}.{after}"
    await resume(ctx, ex, last)


async def resume(ctx: Context, ex: Exchange, last: str) -> None:
    """The events after Last-Event-ID `last` (S.k; S.-1: all of them), then the live rest."""
    stream_id, _, number = last.strip().rpartition(".")
    everything = number == "-1"
    found = await ctx.streams.find(f"{stream_id}.0" if everything else last)
    if found is None:
        raise not_found("resp_" + stream_id)
    rec, k = found
    if not rec.events[0].startswith(b"event: response.created"):  # a GET /stream stream: not a response
        raise not_found("resp_" + stream_id)
    await follow(ctx, ex, rec, -1 if everything else k)
