"""The article's worst-case hop: a proxy that forwards responses only in 8 KB blocks.

    python proxy.py [--honor] [--port 8766] [--upstream-port 8765] [--block 8192]
                    [--connect-timeout 10] [--read-timeout 600] [--send-timeout 60]

It passes each request up at once and holds the response back until it has a whole block (the
rest goes at the end), as nginx's proxy_buffering, a gzip filter or a CDN can. With --honor it
passes a response straight through when its headers carry `X-Accel-Buffering: no`, the header
nginx honors to turn buffering off for one response. When the client closes, it closes its
upstream connection, so the server still sees the reader leave. Each wait is bounded, as nginx
bounds them: an upstream that does not accept, or says nothing before its head, gets the client a
504; one that goes quiet mid-answer, or a client that takes no bytes, ends the connection.

Leaves out: parsing the request (bytes are piped as they are), several requests per connection,
and everything else a real proxy does.
"""

import argparse
import asyncio

from streaming.http_client import failure
from streaming.options import AT_LEAST_ONE, PEER_PORT, PORT, SECONDS
from streaming.wire.http11 import HEAD_END, response

BLOCK = 8192  # bytes: one memory page of nginx's proxy buffers on many systems
MAX_HEAD = 64 * 1024  # a response head past this (or one never ended) is not HTTP: 502, as nginx says
# Seconds. An upstream that has not accepted in this long is down (one upstream here, so longer than
# nginx/streaming.conf's 2 s, which has replicas to try next): 504.
CONNECT_TIMEOUT = 10.0
# Between two reads from upstream: as nginx/streaming.conf's proxy_read_timeout, since a whole
# answer ("stream": false) says nothing until it is done; streams ping every 15 s.
READ_TIMEOUT = 600.0
# For a client to take what is written: nginx's send_timeout. A client that never reads would
# otherwise hold the connection, its upstream (generating on) and the held bytes for good.
SEND_TIMEOUT = 60.0


def gateway_error(client_w, status):
    """A 502 or 504 with no body (Content-Length: 0, Connection: close)."""
    client_w.write(response(status, content_type=None))


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
        connecting = asyncio.open_connection(args.upstream_host, args.upstream_port)
        up_r, up_w = await asyncio.wait_for(connecting, args.connect_timeout)
    except (OSError, TimeoutError) as e:
        gateway_error(client_w, 504 if isinstance(e, TimeoutError) else 502)
        client_w.close()
        return
    up = asyncio.create_task(pipe_up(client_r, up_w))
    buffered, head, passthrough, taken = b"", None, False, True

    async def send(data):
        nonlocal taken
        client_w.write(data)
        taken = False  # until drained: a client that never reads is aborted below, not waited on
        await asyncio.wait_for(client_w.drain(), args.send_timeout)
        taken = True

    try:
        while data := await asyncio.wait_for(up_r.read(65536), args.read_timeout):
            if head is None:
                buffered += data
                if (end := HEAD_END.search(buffered)) is None:
                    if len(buffered) > MAX_HEAD:
                        gateway_error(client_w, 502)
                        buffered = b""
                        break
                    continue
                head = buffered[: end.start()]
                passthrough = args.honor and b"x-accel-buffering: no" in head.lower()
                data, buffered = buffered, b""
            if passthrough:
                await send(data)
                continue
            buffered += data
            while len(buffered) >= args.block:
                block, buffered = buffered[: args.block], buffered[args.block :]
                await send(block)
        await send(buffered)
    except TimeoutError:
        if head is None and taken:  # the upstream said nothing in time: nothing went to the client
            gateway_error(client_w, 504)
    except ConnectionError:
        pass
    finally:
        up.cancel()
        up_w.close()
        if taken:
            client_w.close()
        else:
            client_w.transport.abort()  # close() would wait for a client that never reads


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--honor", action="store_true", help="pass through responses with X-Accel-Buffering: no")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=PORT, default=8766, help="0 picks a free port (printed)")
    p.add_argument("--upstream-host", default="127.0.0.1")
    p.add_argument("--upstream-port", type=PEER_PORT, default=8765)
    p.add_argument("--block", type=AT_LEAST_ONE, default=BLOCK, help="bytes forwarded at a time")
    p.add_argument("--connect-timeout", type=SECONDS, default=CONNECT_TIMEOUT, help="seconds (504 past it)")
    p.add_argument("--read-timeout", type=SECONDS, default=READ_TIMEOUT, help="seconds between upstream reads")
    p.add_argument("--send-timeout", type=SECONDS, default=SEND_TIMEOUT, help="seconds for a client to take a block")
    return p.parse_args(argv)


async def serve(args):
    try:
        server = await asyncio.start_server(lambda r, w: handle(r, w, args), args.host, args.port)
    except OSError as e:  # a port taken, an address not this machine's
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {failure(e)}") from None
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
