"""Raw-socket clients that time every byte, and `measure`, the article's three-way comparison.

    python client.py measure [--host 127.0.0.1] [--port 8765] [--prompts 5] [--max-tokens 100]

`post(path, prompt, n)` for /complete and /stream and `websocket(prompt, n)` for /ws each return
(seconds to first text, seconds to the end, bytes received, pieces of text), timed from sending
the request; `stop_after` leaves (SSE: closes the socket; WebSocket: sends {"stop": true}) after
that many pieces. They read with asyncio streams and count every byte, headers included: no HTTP
or WebSocket library stands between the wire and the figures. The SSE body goes through
sse.EventParser, a real event-stream parser, not the article's `event[len("data: "):]`. The
WebSocket client masks its frames with fresh random keys, answers pings, and does the close
handshake.

Responses are read with streaming.wire.http11.ResponseReader (through streaming/http_client.py,
as the upstream relay reads), OpenAI's chunks with the wire layer's `read_chunk`, and WebSocket
frames with the sans-I/O streaming.wire.session.Session, the same code the server's side of the
wire uses.

Leaves out: redirects, proxies' CONNECT, and HTTP keep-alive (each request asks `Connection: close`,
so that the figures are those of one request on a fresh connection, as in the article).
"""

import argparse
import asyncio
import json
import os
import ssl
import sys
import time
from pathlib import Path
from typing import NamedTuple
from urllib.parse import urlsplit

from streaming import http_client, options
from streaming.launch import REPEATS_EXACTLY
from streaming.qoe import EXPECTED_TTFT, READING_RATE, qoe
from streaming.wire import http11, sse
from streaming.wire import websocket as websocket_frames
from streaming.wire.errors import ProtocolError
from streaming.wire.openai import read_chunk
from streaming.wire.session import ABNORMAL, Closed, Session

HOST, PORT = "127.0.0.1", 8765  # the defaults; every function takes host= and port=
READ_SIZE = 65536
LEAVE_PAUSE = 1.0  # seconds to stay after leaving, so a server has a moment to notice (the article's)


class Timing(NamedTuple):
    """The article's four figures of one answer."""

    first: float | None  # seconds to the first text
    total: float  # seconds to the end
    received: int  # bytes received, headers included
    pieces: list  # the text pieces


class Result(Timing):
    """A Timing (it unpacks as the article's four values), plus `arrivals`: the seconds at which
    each piece arrived, and `usage`: the token counts the server reported (an API's usage), if any."""

    def __new__(cls, first, total, received, pieces, arrivals=(), usage=None):
        r = super().__new__(cls, first, total, received, pieces)
        r.arrivals = list(arrivals)
        r.usage = usage
        return r


class ServerError(Exception):
    """The server answered with an error status, an error event or an error message."""


class Reply(http_client.Reply):
    """One response as it arrives on a connection (streaming/http_client.py: head, then a
    Content-Length, chunked or until-close body: nginx sends a stream to an HTTP/1.1 client
    chunked), counting every byte received, headers included. A broken head is a ServerError; a
    body cut short just ends (the caller sees what is missing)."""

    async def read_head(self):
        try:
            return await super().read_head()
        except ProtocolError as e:
            raise ServerError(e.message) from None

    async def chunks(self):
        try:
            async for data in super().chunks():
                yield data
        except ProtocolError:
            return


def json_post(path, host, body):
    """A POST of a JSON body, as every client here sends it."""
    fields = [("Content-Type", "application/json"), ("Content-Length", str(len(body))), ("Connection", "close")]
    return http11.request_head("POST", path, host, fields) + body


async def post(path, prompt, n, stop_after=None, host=None, port=None, seed=0, extra=None):
    """POST a prompt to /complete or /stream and time what comes back."""
    host, port = host or HOST, port or PORT
    r, w = await asyncio.open_connection(host, port)
    body = json.dumps({"prompt": prompt, "max_tokens": n, "seed": seed, **(extra or {})}).encode()
    t0 = time.perf_counter()
    w.write(json_post(path, host, body))
    try:
        reply = Reply(r)
        head = await reply.read_head()
        if path != "/stream":
            data = await reply.body()
            end = time.perf_counter() - t0
            value = json.loads(data)
            if head.status != 200:
                raise ServerError(f"{head.status}: {value}")
            return Result(end, end, reply.received, [value["text"]], [end])
        if head.status != 200:
            raise ServerError(f"{head.status}: {(await reply.body()).decode(errors='replace')}")
        parser, pieces, arrivals, first, done = sse.EventParser(), [], [], None, False
        async for data in reply.chunks():
            for event in parser.feed(data):
                if event.event == "error":
                    raise ServerError(f"error event: {event.data}")
                if event.data == "[DONE]":
                    done = True
                    continue
                now = time.perf_counter() - t0
                first = first or now
                pieces.append(json.loads(event.data)["text"])
                arrivals.append(now)
            if stop_after and len(pieces) >= stop_after:
                w.close()  # leave, then give the server a moment to notice
                await asyncio.sleep(LEAVE_PAUSE)
                return Result(first, time.perf_counter() - t0, reply.received, pieces, arrivals)
        if not done:
            raise ServerError("the stream ended without [DONE]: the connection dropped")
        return Result(first, time.perf_counter() - t0, reply.received, pieces, arrivals)
    finally:
        w.close()


async def websocket(prompt, n, stop_after=None, host=None, port=None, seed=0, extra=None):
    """Stream over GET /ws; after `stop_after` pieces send {"stop": true} and read to the end.
    The sans-I/O session masks every frame with a fresh key, answers pings and echoes the close."""
    host, port = host or HOST, port or PORT
    r, w = await asyncio.open_connection(host, port)
    key = websocket_frames.new_key()
    t0 = time.perf_counter()
    w.write(websocket_frames.client_handshake(host, key))
    try:
        reply = Reply(r)
        head = await reply.read_head()
        if head.status != 101 or head.headers.get("sec-websocket-accept") != websocket_frames.accept_key(key):
            raise ServerError(f"the WebSocket handshake failed: {head.status}")
        await reply.body()  # a 101 has none: what follows it is the first frames
        session = Session(client=True)
        session.receive_data(reply.parser.trailing)
        session.send_text(json.dumps({"prompt": prompt, "max_tokens": n, "seed": seed, **(extra or {})}))
        received, pieces, arrivals, first, stopped = reply.received, [], [], None, False
        while True:
            event = session.next_event()
            w.write(session.data_to_send())  # our request, a pong, {"stop"}, the echo of the close
            if event is None:
                chunk = await r.read(READ_SIZE)
                received += len(chunk)
                if chunk:
                    session.receive_data(chunk)
                else:
                    session.receive_eof()
            elif isinstance(event, Closed):
                break
            elif isinstance(event, websocket_frames.Message):
                value = json.loads(event.data)
                if "text" in value:
                    now = time.perf_counter() - t0
                    first = first or now
                    pieces.append(value["text"])
                    arrivals.append(now)
                    if stop_after and len(pieces) >= stop_after and not stopped:
                        session.send_text(json.dumps({"stop": True}))
                        stopped = True
                elif "error" in value:
                    raise ServerError(f"error message: {value['error']}")
        end = time.perf_counter() - t0
        if event.code != 1000 and not (event.code == ABNORMAL and stopped):
            raise ServerError(f"the WebSocket closed with {event.code}")
        return Result(first, end, received, pieces, arrivals)
    finally:
        w.close()


# The real APIs' formats: where the text is in each event, and how the request is shaped.
FORMATS = {
    "openai": {"path": "/v1/chat/completions", "key": "Authorization", "env": "OPENAI_API_KEY"},
    "anthropic": {"path": "/v1/messages", "key": "x-api-key", "env": "ANTHROPIC_API_KEY"},
}


def api_body(fmt, prompt, n, stream, seed=0, model=None, extra=None):
    messages = [{"role": "user", "content": prompt}]
    body = {"model": model or "default", "messages": messages, "max_tokens": n, "stream": stream}
    if fmt == "openai":
        body["seed"] = seed
    return dict(body, **(extra or {}))


def api_text(fmt, event):
    """The text a streamed event carries ('' for none); raises ServerError for an error event."""
    if event.data == "[DONE]":
        return None
    if fmt == "openai":  # the wire layer's reading of a chunk (the upstream relay's too)
        try:
            chunk = read_chunk(event.data)
        except ProtocolError as e:
            raise ServerError(e.message) from None
        if event.event == "error" or chunk.error is not None:
            raise ServerError(f"error event: {event.data}")
        return chunk.text
    value = json.loads(event.data)
    if event.event == "error":
        raise ServerError(f"error event: {event.data}")
    if value.get("type") == "content_block_delta":
        return value["delta"].get("text", "")
    return ""


async def api_post(fmt, prompt, n, url, stream=True, api_key=None, model=None, seed=0, stop_after=None, extra=None):
    """One request in OpenAI's or Anthropic's format to `url` (http or https, e.g. a proxy in front
    of a real API), timed like post(): (first text, the end, bytes received, pieces)."""
    spec, u = FORMATS[fmt], urlsplit(url)
    tls = ssl.create_default_context() if u.scheme == "https" else None
    port = u.port or (443 if tls else 80)
    r, w = await asyncio.open_connection(u.hostname, port, ssl=tls, server_hostname=u.hostname if tls else None)
    base = u.path.rstrip("/").removesuffix("/v1")  # an SDK's base_url ends in /v1; a bare host does not
    path = u.path if u.path.endswith(spec["path"]) else base + spec["path"]
    body = json.dumps(api_body(fmt, prompt, n, stream, seed, model, extra)).encode()
    key = api_key or os.environ.get(spec["env"], "unused")
    auth = f"Bearer {key}" if spec["key"] == "Authorization" else key
    fields = [("Content-Type", "application/json"), (spec["key"], auth)]
    fields += [("anthropic-version", "2023-06-01")] if fmt == "anthropic" else []
    fields += [("Accept-Encoding", "identity"), ("Connection", "close"), ("Content-Length", str(len(body)))]
    t0 = time.perf_counter()
    w.write(http11.request_head("POST", path, u.netloc, fields) + body)
    try:
        reply = Reply(r)
        head = await reply.read_head()
        if head.status != 200 or not stream:
            data = await reply.body()
            if head.status != 200:
                raise ServerError(f"{head.status}: {data[:500].decode(errors='replace')}")
            end = time.perf_counter() - t0
            value = json.loads(data)
            if fmt == "openai":
                text = value["choices"][0]["message"]["content"]
            else:
                text = "".join(b.get("text", "") for b in value["content"])
            return Result(end, end, reply.received, [text], [end], value.get("usage"))
        parser, pieces, arrivals, first, usage = sse.EventParser(), [], [], None, None
        async for data in reply.chunks():
            for event in parser.feed(data):
                usage = api_usage(fmt, event) or usage
                text = api_text(fmt, event)
                if text:
                    now = time.perf_counter() - t0
                    first = first or now
                    pieces.append(text)
                    arrivals.append(now)
            if stop_after and len(pieces) >= stop_after:
                w.close()
                await asyncio.sleep(LEAVE_PAUSE)
                break
        return Result(first, time.perf_counter() - t0, reply.received, pieces, arrivals, usage)
    finally:
        w.close()


def api_usage(fmt, event):
    """The token counts an event reports (OpenAI's usage chunk, Anthropic's message_delta), if any."""
    if event.data == "[DONE]" or event.event == "error":
        return None
    if fmt == "openai":
        try:
            return read_chunk(event.data).usage
        except ProtocolError:
            return None
    value = json.loads(event.data)
    return value.get("usage") if value.get("type") == "message_delta" else None


PROMPTS_FILE = Path(__file__).with_name("prompts.json")


def prompts(k=None):
    """The first k prompts of prompts.json (all of them if k is None)."""
    return [p["prompt"] for p in json.loads(PROMPTS_FILE.read_text())[:k]]


async def measure_rows(texts, n, host=None, port=None, progress=None, fmt="ours", url=None, api_key=None, model=None):
    """Each prompt each way, one after another; {way: [Result per prompt]}. Our format: /complete,
    /stream, /ws. OpenAI's or Anthropic's: the same request without and with streaming, naming
    `model` (another server, vLLM's say, refuses a model it does not serve)."""
    if fmt == "ours":
        rows = {"/complete": [], "/stream": [], "/ws": []}
    else:
        rows = {f"{fmt} whole": [], f"{fmt} stream": []}
    for i, prompt in enumerate(texts):
        if fmt == "ours":
            rows["/complete"].append(await post("/complete", prompt, n, host=host, port=port))
            rows["/stream"].append(await post("/stream", prompt, n, host=host, port=port))
            rows["/ws"].append(await websocket(prompt, n, host=host, port=port))
        else:
            url = url or f"http://{host or HOST}:{port or PORT}"
            for way, stream in ((f"{fmt} whole", False), (f"{fmt} stream", True)):
                rows[way].append(await api_post(fmt, prompt, n, url, stream=stream, api_key=api_key, model=model))
        if progress:
            progress(f"  prompt {i + 1}/{len(texts)} done each way")
    return rows


def summarize(rows):
    """The article's table: lines to print and the figures behind them."""
    k = len(next(iter(rows.values())))
    width = max(10, *(len(name) for name in rows))
    lines, figures = [], {}
    for name, rs in rows.items():
        first = sum(r.first for r in rs) / k
        total = sum(r.total for r in rs) / k
        received = sum(r.received for r in rs)
        chars = sum(len("".join(r.pieces).encode()) for r in rs)
        figures[name] = {
            "first_s": first,
            "total_s": total,
            "bytes_per_answer": received / k,
            "text_bytes_per_answer": chars / k,
            "ratio": received / chars,
        }
        lines.append(
            f"{name:{width}s} first text after {first:5.2f} s, all of it after {total:5.2f} s; "
            f"{received / k:6.0f} bytes on the wire per answer, for {chars / k:4.0f} bytes of text "
            f"({received / chars:.1f}x)"
        )
    same = all(len({"".join(r.pieces) for r in answers}) == 1 for answers in zip(*rows.values(), strict=True))
    lines.append(f"the same text {'all three' if len(rows) == 3 else 'both'} ways: {same}")
    if not same and "/ws" in rows:  # this server's three ways (another server's flags are its own)
        lines.append(
            "  (a seeded text repeats where the arithmetic does: guessed tokens and a retained prompt change"
            f" a pass's shape, which rounds differently in bfloat16; `python server.py {' '.join(REPEATS_EXACTLY)}`"
            " repeats exactly)"
        )
    figures["same_text"] = same
    for name, value in reader_qoe(rows).items():
        figures[name]["qoe"] = value
    lines.append(
        f"the reader's QoE (first text expected within {EXPECTED_TTFT:g} s, reading {READING_RATE} tokens/s): "
        + ", ".join(f"{name} {figures[name]['qoe']:.2f}" for name in rows)
    )
    return lines, figures


def reader_qoe(rows):
    """Each way's mean QoE (streaming.qoe) over its answers. A piece is a token; a whole answer
    arrives as one piece, weighed as the token count of the same answer streamed."""
    out = {}
    for name, rs in rows.items():
        values = []
        for k, r in enumerate(rs):
            tokens = max(len(other[k].pieces) for other in rows.values())
            arrivals = [(t, 1) for t in r.arrivals] if len(r.pieces) > 1 else [(r.total, tokens)]
            values.append(qoe(arrivals))
        out[name] = sum(values) / len(values)
    return out


async def get_json(path, host=None, port=None):
    """GET one of the server's JSON endpoints (/log, /metrics, /v1/models)."""
    host, port = host or HOST, port or PORT
    r, w = await asyncio.open_connection(host, port)
    w.write(http11.request_head("GET", path, host, [("Connection", "close")]))
    try:
        reply = Reply(r)
        await reply.read_head()
        return json.loads(await reply.body())
    finally:
        w.close()


# seconds to wait for a server that is starting (its model loading) to be ready
READY_WAIT = float(os.environ.get("STREAMING_READY_WAIT", 120))


async def wait_ready(host=None, port=None, timeout=READY_WAIT):
    """Wait until the server (or a proxy in front of it) answers GET /ready with 200; a
    ServerError with one clear line if nothing does within `timeout` seconds."""
    host, port = host or HOST, port or PORT
    deadline, said = time.monotonic() + timeout, False

    async def ready() -> bool:
        r, w = await asyncio.open_connection(host, port)
        try:
            w.write(http11.request_head("GET", "/ready", host, [("Connection", "close")]))
            return (await Reply(r).read_head()).status == 200
        finally:
            w.close()

    while True:
        try:  # (each try within the deadline: a peer that accepts and never answers must not hold it)
            if await asyncio.wait_for(ready(), max(0.1, deadline - time.monotonic())):
                return
        except (OSError, ServerError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise ServerError(f"no server ready at {host}:{port}: start `python server.py` first")
        if not said:
            print(f"waiting for the server at {host}:{port} to be ready ...", file=sys.stderr, flush=True)
            said = True
        await asyncio.sleep(0.5)


async def server_info(host=None, port=None):
    """The server's model, device and dtype, from GET /metrics.json."""
    m = await get_json("/metrics.json", host, port)
    return {k: m.get(k) for k in ("model", "device", "dtype", "quantize")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["measure"], help="measure: each prompt each way, the article's table")
    p.add_argument("--host", default=HOST, help="the server's address")
    p.add_argument("--port", type=options.PEER_PORT, default=PORT, help="the server's port")
    p.add_argument("--prompts", type=options.AT_LEAST_ONE, default=5, help="how many of prompts.json's prompts")
    p.add_argument("--max-tokens", type=options.AT_LEAST_ONE, default=100, help="tokens asked for each answer")
    p.add_argument(
        "--format", choices=["ours", "openai", "anthropic"], default="ours", help="our endpoints, or an API's"
    )
    p.add_argument(
        "--url", default=None, help="base URL of any server or proxy, as an SDK's base_url (with or without /v1)"
    )
    p.add_argument(
        "--api-key", default=None, help="openai/anthropic: the key (else $OPENAI_API_KEY / $ANTHROPIC_API_KEY)"
    )
    p.add_argument("--model", default=None, help="openai/anthropic: the model to name (default: 'default')")
    p.add_argument(
        "--save",
        default=None,
        help="where to save the figures ('' to skip; default results/measure.json, and for another --url "
        "results/measure-HOST.json, so a third party's run does not overwrite ours)",
    )
    args = p.parse_args(argv)
    try:
        urlsplit(args.url or "").port  # noqa: B018 - a port past 65535 raises here, not mid-run
    except ValueError as e:
        p.error(f"--url {args.url}: {e}")
    if args.save is None:
        third = args.url and args.format != "ours"
        args.save = f"results/measure-{urlsplit(args.url).hostname}.json" if third else "results/measure.json"
    if args.url and args.format == "ours":  # our own endpoints through any host:port (a proxy, say)
        u = urlsplit(args.url)
        args.host, args.port, args.url = u.hostname, u.port or 80, None

    async def run():
        if args.url is None:
            await wait_ready(args.host, args.port)
        info = await server_info(args.host, args.port) if args.url is None else {"url": args.url, "model": args.model}
        rows = await measure_rows(
            prompts(args.prompts),
            args.max_tokens,
            args.host,
            args.port,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
            fmt=args.format,
            url=args.url,
            api_key=args.api_key,
            model=args.model,
        )
        return info, rows

    try:
        info, rows = asyncio.run(run())
    except (ServerError, OSError) as e:
        sys.exit(f"error: {e}")
    lines, figures = summarize(rows)
    print("\n".join(lines))
    if args.save:
        save(args.save, dict(info, prompts=args.prompts, max_tokens=args.max_tokens, **figures))


def save(path, value):
    value = dict(value, date=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(value, indent=1) + "\n")


if __name__ == "__main__":
    main()
