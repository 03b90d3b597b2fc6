"""client.py against the server, proxy.py against a fake upstream, experiments.py end to end."""

import asyncio
import json
import socket
import subprocess
import sys

import pytest
from helpers import ROOT, server_log, wait_for_log

import client
import proxy

PROMPT = "Glaciers look still from a distance"


def test_post_and_websocket_clients_time_and_count_every_byte(servers):
    port = servers["plain"].port

    async def main():
        c = await client.post("/complete", PROMPT, 20, port=port)
        s = await client.post("/stream", PROMPT, 20, port=port)
        w = await client.websocket(PROMPT, 20, port=port)
        return c, s, w

    c, s, w = asyncio.run(main())
    first, total, received, pieces = c
    assert first == total and len(pieces) == 1
    assert "".join(s.pieces) == "".join(w.pieces) == pieces[0]
    assert 0 < s.first <= s.total and 0 < w.first <= w.total
    assert len(s.arrivals) == len(s.pieces) and s.arrivals == sorted(s.arrivals)
    # every byte counted, headers included: more than the events' own bytes
    assert s.received > sum(len(b'data: {"text": ""}\n\n') + len(p) for p in s.pieces)
    assert w.received > c.received / 2


def test_client_errors_are_raised(servers):
    port = servers["failing"].port
    with pytest.raises(client.ServerError, match="error event"):
        asyncio.run(client.post("/stream", PROMPT, 20, port=port))
    with pytest.raises(client.ServerError, match="500"):
        asyncio.run(client.post("/complete", PROMPT, 20, port=port))
    with pytest.raises(client.ServerError, match="error message"):
        asyncio.run(client.websocket(PROMPT, 20, port=port))


def test_websocket_client_answers_pings_and_closes_cleanly(servers):
    s = servers["quiet"]  # pings every 0.2 s while a token takes 0.6 s
    before = len(server_log(s.port))
    r = asyncio.run(client.websocket("Hi", 3, port=s.port))
    assert len(r.pieces) >= 1
    assert wait_for_log(s.port, before + 1)[-1][2] is False


def test_measure_prints_the_articles_table(servers):
    # the exact model: the same text all three ways whatever shape each pass had (guessed tokens,
    # a retained prompt), where a real model's may part at a near tie (README, `seed`)
    out = subprocess.run(
        [sys.executable, "client.py", "measure", "--port", str(servers["exact"].port), "--prompts", "2"]
        + ["--max-tokens", "10", "--save", ""],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines[:3]] == ["/complete", "/stream", "/ws"]
    assert "bytes on the wire per answer" in lines[0]
    assert lines[3] == "the same text all three ways: True"
    assert lines[4].startswith("the reader's QoE") and all(
        f"{way} " in lines[4] for way in ("/complete", "/stream", "/ws")
    )


# --- the proxy, against a fake upstream that streams on command ---------------------------------


async def fake_upstream(header_lines, chunks, gap, events):
    """A server that sends a head and then `chunks` with `gap` seconds between them; it records
    when its client (the proxy) closes."""

    async def handle(r, w):
        events.append("connected")
        await r.read(65536)  # the request, passed up at once
        events.append("request")

        async def watch():  # like the server: end-of-file from the proxy means the client left
            if await r.read(65536) == b"":
                events.append("upstream saw end-of-file")

        watcher = asyncio.create_task(watch())
        w.write(b"HTTP/1.1 200 OK\r\n" + b"".join(h + b"\r\n" for h in header_lines) + b"\r\n")
        try:
            for chunk in chunks:
                await asyncio.sleep(gap)
                if watcher.done():
                    break
                w.write(chunk)
                await w.drain()
        except ConnectionError:
            pass
        await asyncio.sleep(0.05)
        watcher.cancel()
        w.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def through_proxy(honor, header_lines, chunks, gap=0.01, leave_after=None):
    events = []
    up = await fake_upstream(header_lines, chunks, gap, events)
    args = proxy.parse_args(
        ["--port", "0", "--upstream-port", str(up.sockets[0].getsockname()[1])] + (["--honor"] if honor else [])
    )
    px = await asyncio.start_server(lambda r, w: proxy.handle(r, w, args), "127.0.0.1", 0)
    r, w = await asyncio.open_connection("127.0.0.1", px.sockets[0].getsockname()[1])
    w.write(
        b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    reads = []
    while data := await r.read(65536):
        reads.append(data)
        if leave_after and len(reads) >= leave_after:
            w.close()
            break
    await asyncio.sleep(0.3)
    w.close()
    px.close()
    up.close()
    return reads, events


def test_proxy_forwards_exactly_8_kb_blocks_until_the_end():
    chunks = [b"x" * 1000] * 20  # 20,000 bytes of body after the head
    reads, events = asyncio.run(through_proxy(False, [b"X-Accel-Buffering: no"], chunks))
    body = b"".join(reads)
    sizes = [len(x) for x in reads]
    assert all(size % 8192 == 0 for size in sizes[:-1]), sizes
    assert len(body) == len(b"".join(chunks)) + len(b"HTTP/1.1 200 OK\r\nX-Accel-Buffering: no\r\n\r\n")
    assert events[:2] == ["connected", "request"]


def test_proxy_with_honor_passes_marked_responses_straight_through():
    chunks = [b"data: %d\n\n" % i for i in range(10)]
    reads, _ = asyncio.run(through_proxy(True, [b"Content-Type: text/event-stream", b"X-Accel-Buffering: no"], chunks))
    assert len(reads) >= 10  # every event on its own, as it came
    reads, _ = asyncio.run(through_proxy(True, [b"Content-Type: text/event-stream"], chunks))
    assert len(reads) == 1  # unmarked: held to the end even with --honor


def test_proxy_closes_upstream_when_the_client_leaves():
    chunks = [b"data: %d\n\n" % i for i in range(200)]
    reads, events = asyncio.run(through_proxy(True, [b"X-Accel-Buffering: no"], chunks, gap=0.01, leave_after=3))
    assert "upstream saw end-of-file" in events


def test_proxy_answers_502_to_a_head_past_64_kib_and_refuses_a_block_of_0():
    """A response head past proxy.MAX_HEAD (or one never ended) is not HTTP: a 502, where the
    buffer grew with every read until the upstream closed. --block 0 spun for ever."""
    reads, _ = asyncio.run(through_proxy(False, [b"X-Big: " + b"a" * 200_000], [b"body"]))
    assert b"".join(reads).startswith(b"HTTP/1.1 502")
    with pytest.raises(SystemExit):
        proxy.parse_args(["--block", "0"])


async def proxied(upstream_handle, extra_args, left=None, request=b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
    """proxy.py in front of `upstream_handle`; returns what its client got and how long it took
    to end (None: the proxy never ended it within 10 s). With `left` (an event the upstream sets
    when the proxy leaves it), the client never reads, and the time is until `left` is set."""
    up = await asyncio.start_server(upstream_handle, "127.0.0.1", 0)
    argv = ["--port", "0", "--upstream-port", str(up.sockets[0].getsockname()[1]), *extra_args]
    args = proxy.parse_args(argv)
    px = await asyncio.start_server(lambda r, w: proxy.handle(r, w, args), "127.0.0.1", 0)
    loop = asyncio.get_running_loop()
    start = loop.time()
    if left is None:
        r, w = await asyncio.open_connection("127.0.0.1", px.sockets[0].getsockname()[1])
        w.write(request)
        got, took = b"", None
        try:
            async with asyncio.timeout(10):
                while data := await r.read(65536):
                    got += data
                took = loop.time() - start
        except TimeoutError:
            pass
        w.close()
    else:  # a client that sends its request and then never reads: a socket with a tiny receive buffer
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", px.sockets[0].getsockname()[1]))
        await loop.sock_sendall(sock, request)
        got, took = b"", None
        async with asyncio.timeout(10):  # the proxy ends the connection: the upstream sees it leave
            await left.wait()
            took = loop.time() - start
        sock.close()
    px.close()
    up.close()
    return got, took


def test_proxy_bounds_every_wait_as_nginx_does():
    """An upstream that never accepts in time, one that never answers, one that goes quiet
    mid-answer, and a client that never reads each held the proxy's connection (and, for the
    client, the upstream, generating on) for good."""

    async def silent(r, w):  # reads the request, says nothing until the proxy leaves
        await r.read(65536)
        await r.read(65536)
        w.close()

    async def quiet_midway(r, w):
        await r.read(65536)
        w.write(b"HTTP/1.1 200 OK\r\nX-Accel-Buffering: no\r\n\r\ndata: 1\n\n")
        await r.read(65536)
        w.close()

    left = asyncio.Event()

    async def endless(r, w):  # streams until its client (the proxy) leaves
        await r.read(65536)
        w.write(b"HTTP/1.1 200 OK\r\n\r\n")
        try:
            while True:
                w.write(b"x" * 65536)
                await w.drain()
        except ConnectionError:
            left.set()
        w.close()

    async def run():
        # connect: a listening socket whose backlog is full accepts nothing
        backlog = socket.socket()
        backlog.bind(("127.0.0.1", 0))
        backlog.listen(0)
        fillers = []
        for _ in range(8):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(backlog.getsockname())
            fillers.append(s)
        args = proxy.parse_args(["--upstream-port", str(backlog.getsockname()[1]), "--connect-timeout", "0.5"])
        px = await asyncio.start_server(lambda r, w: proxy.handle(r, w, args), "127.0.0.1", 0)
        r, w = await asyncio.open_connection("127.0.0.1", px.sockets[0].getsockname()[1])
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):
            connect = await r.read()
        w.close()
        px.close()
        for s in [backlog, *fillers]:
            s.close()
        silent_got, silent_took = await proxied(silent, ["--read-timeout", "0.5"])
        quiet_got, quiet_took = await proxied(quiet_midway, ["--read-timeout", "0.5", "--honor"])
        _, unread_took = await proxied(endless, ["--send-timeout", "0.5"], left=left)
        return connect, (silent_got, silent_took), (quiet_got, quiet_took), unread_took

    connect, unanswered, quiet, unread_took = asyncio.run(run())
    assert connect.startswith(b"HTTP/1.1 504"), connect
    assert unanswered[0].startswith(b"HTTP/1.1 504") and unanswered[1] is not None and unanswered[1] < 5, unanswered
    assert quiet[0].endswith(b"data: 1\n\n") and quiet[1] is not None and quiet[1] < 5, quiet
    assert unread_took is not None and unread_took < 5, unread_took
    for flag in ("--connect-timeout", "--read-timeout", "--send-timeout"):
        for bad in ("0", "nan"):
            with pytest.raises(SystemExit):
                proxy.parse_args([flag, bad])


def test_experiments_all_end_to_end_with_the_tiny_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "experiments.py", "all", "--model", "tiny", "--prompts", "2", "--results", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    printed = out.stdout
    assert "the same text all three ways: True" in printed
    assert "Started with --naive:" in printed and "through the proxy: first text after" in printed
    results = json.loads((tmp_path / "experiments.json").read_text())
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    assert results["model"] == "tiny" and results["date"]
    assert results["leave_naive"] == 100
    # The article's "at most 11 tokens" needs a token to take longer than the stop takes to arrive
    # (its model's); the tiny model makes a few more meanwhile. At most one after the server has it:
    assert results["leave_after_stop"] <= 1 and results["stop_after_stop"] <= 1
    assert results["leave"] <= 11 + 5 and results["stop"] <= 11 + 5
    held = {c["conclusion"]: c["holds"] for c in results["conclusions"]}
    # the conclusions that do not depend on the model's speed
    for name in (
        "/complete: first text equals all of it",
        "the same text all three ways",
        "buffering proxy: first text within 5% of the end",
        "bytes: /stream several times the text",
        "bytes: /ws several times the text",
        "leave: at most one token after the server had the stop",
        "stop: at most one token after the server had the stop",
    ):
        assert held[name], (name, results["conclusions"])
    # no child is left behind
    left = subprocess.run(["pgrep", "-f", "proxy.py --(honor --)?port"], capture_output=True, text=True).stdout
    assert not left.strip()


def test_waiting_for_a_server_that_accepts_and_never_answers_ends_at_its_deadline():
    """Each try is bounded by the deadline: a peer that accepted and said nothing held the wait
    for good (client.py measure, the experiments)."""

    async def run():
        held = []

        async def mute(reader, writer):  # accepts, reads, answers nothing
            held.append(writer)
            await reader.read()

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            with pytest.raises(client.ServerError, match=f"no server ready at 127.0.0.1:{port}"):
                await asyncio.wait_for(client.wait_ready("127.0.0.1", port, timeout=1), 10)
            return loop.time() - t0
        finally:
            for w in held:
                w.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) < 5
