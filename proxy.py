"""The article's worst-case hop: a proxy that forwards responses only in 8 KB blocks.

    python proxy.py [--honor] [--port 8766] [--upstream-port 8765] [--block 8192]

It passes each request up at once and holds the response back until it has a whole block (the
rest goes at the end), as nginx's proxy_buffering, a gzip filter or a CDN can. With --honor it
passes a response straight through when its headers carry `X-Accel-Buffering: no`, the header
nginx honors to turn buffering off for one response. When the client closes, it closes its
upstream connection, so the server still sees the reader leave.

Leaves out: parsing the request (bytes are piped as they are), several requests per connection,
and everything else a real proxy does.
"""

import argparse
import asyncio

from streaming.wire.http11 import HEAD_END, response

BLOCK = 8192  # bytes: one memory page of nginx's proxy buffers on many systems
MAX_HEAD = 64 * 1024  # a response head past this (or one never ended) is not HTTP: 502, as nginx says


async def pipe_up(client_r, up_w):
    """Client to server, as it comes. The client closing means it left: close upstream too."""
    try:
        while data := await client_r.read(65536):
            up_w.write(data)
            await up_w.drain()
    except ConnectionError:
        pass
    up_w.close()


async def handle(client_r, client_w, args):
    try:
        up_r, up_w = await asyncio.open_connection(args.upstream_host, args.upstream_port)
    except OSError:
        client_w.write(response(502, content_type=None))  # Content-Length: 0, Connection: close
        client_w.close()
        return
    up = asyncio.create_task(pipe_up(client_r, up_w))
    buffered, head, passthrough = b"", None, False
    try:
        while data := await up_r.read(65536):
            if head is None:
                buffered += data
                if (end := HEAD_END.search(buffered)) is None:
                    if len(buffered) > MAX_HEAD:
                        client_w.write(response(502, content_type=None))
                        buffered = b""
                        break
                    continue
                head = buffered[: end.start()]
                passthrough = args.honor and b"x-accel-buffering: no" in head.lower()
                data, buffered = buffered, b""
            if passthrough:
                client_w.write(data)
                await client_w.drain()
                continue
            buffered += data
            while len(buffered) >= args.block:
                client_w.write(buffered[: args.block])
                buffered = buffered[args.block :]
                await client_w.drain()
        client_w.write(buffered)
        await client_w.drain()
    except ConnectionError:
        pass
    finally:
        up.cancel()
        up_w.close()
        client_w.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--honor", action="store_true", help="pass through responses with X-Accel-Buffering: no")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8766, help="0 picks a free port (printed)")
    p.add_argument("--upstream-host", default="127.0.0.1")
    p.add_argument("--upstream-port", type=int, default=8765)
    p.add_argument("--block", type=int, default=BLOCK, help="bytes forwarded at a time")
    args = p.parse_args(argv)
    if args.block < 1:
        p.error("--block must be at least 1 byte")
    return args


async def serve(args):
    server = await asyncio.start_server(lambda r, w: handle(r, w, args), args.host, args.port)
    port = server.sockets[0].getsockname()[1]
    mode = "honoring X-Accel-Buffering" if args.honor else f"buffering {args.block}-byte blocks"
    print(
        f"proxy listening on http://{args.host}:{port}, {mode}, to {args.upstream_host}:{args.upstream_port}",
        flush=True,
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(serve(parse_args()))
    except KeyboardInterrupt:
        pass
