"""/v1/: the OpenAI and Anthropic APIs, driven through their wire format objects.

One handler serves both: the route names the format (streaming.wire.openai / .anthropic), which
parses the request, shapes errors, and writes the whole answer or the stream's events; this
module only starts the job and relays it as one Answer, with the same stop-on-leave as /stream
and the request's stop strings. Leaves out what streaming.wire.apis leaves out.
"""

from __future__ import annotations

from streaming.generation.job import Job
from streaming.generation.prompts import Prompt
from streaming.server.answer import Answer, ping_note
from streaming.server.context import Context
from streaming.server.exchange import Exchange
from streaming.wire import sse
from streaming.wire.answers import AnswerStream, prefill
from streaming.wire.apis import ApiRequest, Format, StreamEncoder
from streaming.wire.errors import ProtocolError


def model_id(ctx: Context) -> str:
    """--served-model-name, else the backend's (the upstream's model, or the model's short name)."""
    return ctx.config.served_model_name or ctx.backend.model_id()


def route_format(ex: Exchange) -> Format:
    assert ex.format is not None, "a /v1/ route names its wire format (routes.py)"
    return ex.format


async def models(ctx: Context, ex: Exchange) -> None:
    ex.respond_json(200, {"object": "list", "data": [route_format(ex).models(model_id(ctx))]})


def prompt_of(api: ApiRequest) -> Prompt:
    if api.text is not None:  # a text completion: the prompt as it is
        return Prompt(api.text, raw=True)
    if api.tools is None or api.tools.choice == "none":
        return Prompt(None, tuple(api.messages), api.continue_final)
    start = prefill(api.tools.choice, api.tools.name)  # a required call: the model continues its opening
    return Prompt(None, tuple(api.messages), api.continue_final, tools=tuple(api.tools.specs), prefill=start)


async def answer(ctx: Context, ex: Exchange) -> None:
    fmt = route_format(ex)
    api = fmt.parse(ex.request.json())
    job = await ctx.backend.open(prompt_of(api), api.params)
    if api.stream:
        await stream(ctx, ex, fmt, api, job)
    else:
        await whole(ctx, ex, fmt, api, job)


def answer_stream(
    ctx: Context, fmt: Format, api: ApiRequest, job: Job, enc: StreamEncoder | None = None
) -> AnswerStream:
    """The reader of this answer's text and tool calls, starting from its prefill."""
    return AnswerStream(api.stop, api.tools, enc, id_prefix(fmt), prefill=reader_prefill(ctx, job))


def reader_prefill(ctx: Context, job: Job) -> str:
    """What the answer's reader starts from: a local model's prefill (an upstream is asked with
    tool_choice instead, and its calls come whole)."""
    return job.prompt.prefill if job.prompt is not None and ctx.backend.pool is None else ""


def id_prefix(fmt: Format) -> str:
    return "toolu_" if fmt.name == "anthropic" else "call_"  # each API's call ids look like its own


async def whole(ctx: Context, ex: Exchange, fmt: Format, api: ApiRequest, job: Job) -> None:
    out = answer_stream(ctx, fmt, api, job)
    async with Answer(ctx.answers, job, ex.request.path, watch=ex.conn, whole=True) as reply:
        async for piece in reply.pieces():  # (a failure: a 500, or an upstream's 502/504, before any byte)
            out.push(piece)
            if out.matched is not None:
                reply.matched()
                break
        out.flush()
    if reply.left:
        return
    finish = fmt.finish(job.reason, out.matched, out.called)
    value = fmt.whole(model_id(ctx), out.text, finish, job.prompt_tokens, reply.counted(), out.calls)
    ex.respond_json(200, value)


async def stream(ctx: Context, ex: Exchange, fmt: Format, api: ApiRequest, job: Job) -> None:
    enc = fmt.stream(model_id(ctx), api, job.prompt_tokens)
    out = answer_stream(ctx, fmt, api, job, enc)  # stop strings and tool calls

    async def ending(err: ProtocolError) -> None:
        await ex.send(enc.error(err.message, err.status))

    async def deliver(piece: str) -> bool:
        data = out.push(piece)
        if out.matched is not None:
            reply.matched()  # (the pieces that still come are dropped)
        return await ex.send(data) if data else True

    async def keep_alive() -> bool:
        return await ex.send(enc.keep_alive(ping_note(ctx.backend.position(job))))

    async with Answer(ctx.answers, job, ex.request.path, watch=ex.conn) as reply:
        ex.start_stream(sse.RESPONSE_FIELDS, ending)
        reply.left = not await ex.send(enc.start())
        if not reply.left:
            await reply.relay(deliver, keep_alive, merging=ctx.config.merging(api.stream_interval), outlet=ex)
            if not reply.left and (rest := out.flush()):
                reply.left = not await ex.send(rest)
    if not reply.left:
        enc.prompt_tokens = job.prompt_tokens  # again: an upstream's count arrives with its last chunk
        ex.end_stream()
        await ex.send(enc.end(fmt.finish(job.reason, out.matched, out.called), reply.counted()))
