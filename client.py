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

Leaves out: TLS, redirects, proxies' CONNECT, and HTTP keep-alive (the server closes anyway).
"""

import argparse
import asyncio
import base64
import json
import os
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import http11
import sse
import ws

HOST, PORT = "127.0.0.1", 8765  # the article sets client.PORT = 8766 to go through the proxy
LEAVE_PAUSE = 1.0  # seconds to stay after leaving, so a server has a moment to notice (the article's)


class Result(tuple):
    """(first, total, received, pieces), plus `arrivals`: seconds at which each piece arrived."""

    def __new__(cls, first, total, received, pieces, arrivals=()):
        r = super().__new__(cls, (first, total, received, pieces))
        r.arrivals = list(arrivals)
        return r

    first = property(lambda self: self[0])
    total = property(lambda self: self[1])
    received = property(lambda self: self[2])
    pieces = property(lambda self: self[3])


class ServerError(Exception):
    """The server answered with an error status, an error event or an error message."""


async def read_head(r, w, buffer=b""):
    """Read an HTTP response head; return (status, headers, the bytes after it, bytes read)."""
    received = 0
    while b"\r\n\r\n" not in buffer:
        chunk = await r.read(65536)
        if not chunk:
            raise ServerError("the connection closed before a response")
        received += len(chunk)
        buffer += chunk
    head, _, rest = buffer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, rest, received


class Body:
    """A response body as it arrives: as is (to end-of-file), or decoded from chunked transfer
    coding, which a proxy such as nginx uses towards an HTTP/1.1 client; `done` at its last chunk."""

    def __init__(self, headers):
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        self.decoder = http11.ChunkedDecoder() if chunked else None

    @property
    def done(self):
        return self.decoder is not None and self.decoder.done

    def feed(self, data):
        return self.decoder.feed(data) if self.decoder else data

    async def read_all(self, r, rest):
        """The whole body, given the bytes already read after the head: (data, bytes read now)."""
        data, received = self.feed(rest), 0
        while not self.done and (chunk := await r.read(65536)):
            data += self.feed(chunk)
            received += len(chunk)
        return data, received


async def post(path, prompt, n, stop_after=None, host=None, port=None, seed=0, extra=None):
    """POST a prompt to /complete or /stream and time what comes back."""
    r, w = await asyncio.open_connection(host or HOST, port or PORT)
    body = json.dumps({"prompt": prompt, "max_tokens": n, "seed": seed, **(extra or {})}).encode()
    t0 = time.perf_counter()
    w.write(
        b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n" % (path.encode(), (host or HOST).encode(), len(body)) + body
    )
    try:
        status, headers, rest, received = await read_head(r, w)
        body = Body(headers)
        if path != "/stream":
            data, more = await body.read_all(r, rest)
            received += more
            end = time.perf_counter() - t0
            value = json.loads(data)
            if status != 200:
                raise ServerError(f"{status}: {value}")
            return Result(end, end, received, [value["text"]], [end])
        if status != 200:
            raise ServerError(f"{status}: {rest.decode(errors='replace')}")
        parser, pieces, arrivals, first, done = sse.EventParser(), [], [], None, False
        chunk = rest
        while True:
            for event in parser.feed(body.feed(chunk)):
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
                return Result(first, time.perf_counter() - t0, received, pieces, arrivals)
            if body.done:
                break
            chunk = await r.read(65536)
            if not chunk:
                break
            received += len(chunk)
        if not done:
            raise ServerError("the stream ended without [DONE]: the connection dropped")
        return Result(first, time.perf_counter() - t0, received, pieces, arrivals)
    finally:
        w.close()


async def websocket(prompt, n, stop_after=None, host=None, port=None, seed=0, extra=None):
    """Stream over GET /ws; after `stop_after` pieces send {"stop": true} and read to the end."""
    r, w = await asyncio.open_connection(host or HOST, port or PORT)
    key = base64.b64encode(os.urandom(16)).decode()
    t0 = time.perf_counter()
    w.write(
        (
            f"GET /ws HTTP/1.1\r\nHost: {host or HOST}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    mask = ws.new_mask  # a fresh random key for every frame (RFC 6455 §5.3)
    try:
        status, headers, rest, received = await read_head(r, w)
        if status != 101 or headers.get("sec-websocket-accept") != ws.accept_key(key):
            raise ServerError(f"the WebSocket handshake failed: {status}")
        w.write(ws.text_frame(json.dumps({"prompt": prompt, "max_tokens": n, "seed": seed, **(extra or {})}), mask()))
        parser = ws.Parser(mask_required=False)
        parser.feed(rest)
        pieces, arrivals, first, stopped, close_code = [], [], None, False, None
        while True:
            item = parser.next()
            if item is None:
                chunk = await r.read(65536)
                if not chunk:
                    break
                received += len(chunk)
                parser.feed(chunk)
                continue
            if isinstance(item, ws.Message):
                value = json.loads(item.data)
                if "text" in value:
                    now = time.perf_counter() - t0
                    first = first or now
                    pieces.append(value["text"])
                    arrivals.append(now)
                    if stop_after and len(pieces) >= stop_after and not stopped:
                        w.write(ws.text_frame(json.dumps({"stop": True}), mask()))
                        stopped = True
                elif "error" in value:
                    raise ServerError(f"error message: {value['error']}")
            elif item.opcode == ws.PING:
                w.write(ws.serialize(ws.Frame(ws.PONG, item.data), mask()))
            elif item.opcode == ws.CLOSE:
                close_code, _ = ws.parse_close(item.data)
                w.write(ws.serialize(ws.Frame(ws.CLOSE, item.data[:2]), mask()))  # echo the code
        end = time.perf_counter() - t0
        if close_code not in (1000, None) or (close_code is None and not stopped):
            raise ServerError(f"the WebSocket closed with {close_code}")
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
    value = json.loads(event.data)
    if event.event == "error" or (fmt == "openai" and "error" in value):
        raise ServerError(f"error event: {event.data}")
    if fmt == "openai":
        return "".join((c.get("delta") or {}).get("content") or "" for c in value.get("choices") or [])
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
    path = (u.path.rstrip("/") + spec["path"]) if not u.path.endswith(spec["path"]) else u.path
    body = json.dumps(api_body(fmt, prompt, n, stream, seed, model, extra)).encode()
    key = api_key or os.environ.get(spec["env"], "unused")
    auth = f"Bearer {key}" if spec["key"] == "Authorization" else key
    extra = "anthropic-version: 2023-06-01\r\n" if fmt == "anthropic" else ""
    t0 = time.perf_counter()
    w.write(
        (
            f"POST {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n{spec['key']}: {auth}\r\n"
            f"{extra}Accept-Encoding: identity\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body
    )
    try:
        status, headers, rest, received = await read_head(r, w)
        body = Body(headers)
        if status != 200 or not stream:
            data, more = await body.read_all(r, rest)
            received += more
            if status != 200:
                raise ServerError(f"{status}: {data[:500].decode(errors='replace')}")
            end = time.perf_counter() - t0
            value = json.loads(data)
            if fmt == "openai":
                text = value["choices"][0]["message"]["content"]
            else:
                text = "".join(b.get("text", "") for b in value["content"])
            return Result(end, end, received, [text], [end])
        parser, pieces, arrivals, first = sse.EventParser(), [], [], None
        chunk = rest
        while True:
            for event in parser.feed(body.feed(chunk)):
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
            if body.done:
                break
            chunk = await r.read(65536)
            if not chunk:
                break
            received += len(chunk)
        return Result(first, time.perf_counter() - t0, received, pieces, arrivals)
    finally:
        w.close()


def prompts(k):
    return [p["prompt"] for p in json.load(open(Path(__file__).with_name("prompts.json")))[:k]]


async def measure_rows(texts, n, host=None, port=None, progress=None, fmt="ours", url=None, api_key=None):
    """Each prompt each way, one after another; {way: [Result per prompt]}. Our format: /complete,
    /stream, /ws. OpenAI's or Anthropic's: the same request without and with streaming."""
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
            rows[f"{fmt} whole"].append(await api_post(fmt, prompt, n, url, stream=False, api_key=api_key))
            rows[f"{fmt} stream"].append(await api_post(fmt, prompt, n, url, stream=True, api_key=api_key))
        if progress:
            progress(f"  prompt {i + 1}/{len(texts)} done each way")
    return rows


def summarize(rows):
    """The article's table: lines to print and the figures behind them."""
    k = len(next(iter(rows.values())))
    width = max(10, *(len(name) for name in rows))
    lines, figures = [], {}
    for name, rs in rows.items():
        first = sum(r[0] for r in rs) / k
        total = sum(r[1] for r in rs) / k
        received = sum(r[2] for r in rs)
        chars = sum(len("".join(r[3]).encode()) for r in rs)
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
    same = all(len({"".join(r[3]) for r in answers}) == 1 for answers in zip(*rows.values(), strict=True))
    lines.append(f"the same text {'all three' if len(rows) == 3 else 'both'} ways: {same}")
    figures["same_text"] = same
    return lines, figures


async def get_json(path, host=None, port=None):
    """GET one of the server's JSON endpoints (/log, /metrics, /v1/models)."""
    r, w = await asyncio.open_connection(host or HOST, port or PORT)
    w.write(b"GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n" % path.encode())
    _, headers, rest, _ = await read_head(r, w)
    data, _ = await Body(headers).read_all(r, rest)
    w.close()
    return json.loads(data)


async def server_info(host=None, port=None):
    """The server's model, device and dtype, from GET /metrics."""
    m = await get_json("/metrics", host, port)
    return {k: m.get(k) for k in ("model", "device", "dtype", "quantize")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["measure"])
    p.add_argument("--host", default=HOST)
    p.add_argument("--port", type=int, default=PORT)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--format", choices=["ours", "openai", "anthropic"], default="ours")
    p.add_argument("--url", default=None, help="base URL of any server or proxy (openai/anthropic: http or https)")
    p.add_argument(
        "--api-key", default=None, help="openai/anthropic: the key (else $OPENAI_API_KEY / $ANTHROPIC_API_KEY)"
    )
    p.add_argument("--save", default="results/measure.json", help="where to save the figures ('' to skip)")
    args = p.parse_args(argv)
    if args.url and args.format == "ours":  # our own endpoints through any host:port (a proxy, say)
        u = urlsplit(args.url)
        args.host, args.port, args.url = u.hostname, u.port or 80, None

    async def run():
        info = await server_info(args.host, args.port) if args.url is None else {"url": args.url}
        rows = await measure_rows(
            prompts(args.prompts),
            args.max_tokens,
            args.host,
            args.port,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
            fmt=args.format,
            url=args.url,
            api_key=args.api_key,
        )
        return info, rows

    info, rows = asyncio.run(run())
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
