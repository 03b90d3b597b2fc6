"""server.py over real sockets, against real server processes running the tiny model."""

import json
import socket
import time

import pytest
from helpers import (
    WSClient,
    connect,
    http,
    read_response,
    server_log,
    stream_texts,
    wait_for_log,
    wait_idle,
)

from streaming.wire import websocket as ws
from streaming.wire.session import Closed

PROMPT = {"prompt": "The keeper of a small lighthouse", "max_tokens": 30, "seed": 3}


def ws_generate(port, request):
    c = WSClient(port)
    assert c.status == 101
    c.send_json(request)
    messages, code = c.until_close()
    c.close()
    return messages, code


def test_the_same_text_from_complete_stream_and_ws(servers):
    port = servers["plain"].port
    status, headers, body = http(port, "POST", "/complete", PROMPT)
    assert status == 200 and headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    text = json.loads(body)["text"]

    status, headers, body = http(port, "POST", "/stream", PROMPT)
    assert status == 200
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache" and headers["x-accel-buffering"] == "no"
    assert "content-length" not in headers  # the end of the stream is the connection closing
    pieces, done = stream_texts(body)
    assert done and len(pieces) > 5 and "".join(pieces) == text
    assert all(pieces)  # no empty events

    messages, code = ws_generate(port, PROMPT)
    assert messages[-1] == {"done": True} and code == 1000
    assert "".join(m["text"] for m in messages[:-1]) == text

    other = json.loads(http(port, "POST", "/complete", dict(PROMPT, seed=4))[2])["text"]
    assert other != text


def test_log_records_each_request_and_stdout_has_the_articles_lines(servers):
    s = servers["plain"]
    before = len(server_log(s.port))
    http(s.port, "POST", "/complete", dict(PROMPT, max_tokens=7))
    ws_generate(s.port, dict(PROMPT, max_tokens=6))
    log = wait_for_log(s.port, before + 2)
    assert log[before:] == [["/complete", 7, False], ["/ws", 6, False]]
    assert s.wait_line("/complete: generated 7 tokens, client left early: False")
    assert s.wait_line("/ws: generated 6 tokens, client said stop: False")


def test_max_tokens_defaults_to_100_and_parameters_are_accepted(servers):
    port = servers["plain"].port
    status, _, body = http(port, "POST", "/complete", {"prompt": "Hi", "temperature": 0, "top_p": 0.5, "seed": 1})
    assert status == 200
    assert server_log(port)[-1][1] == 100  # random weights never say EOS in 100 tokens


def read_events_then_leave(port, request, n):
    """POST /stream, read until n text events have arrived, then close the socket."""
    from streaming.wire.sse import EventParser

    s = connect(port)
    body = json.dumps(request).encode()
    s.sendall(
        b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body
    )
    parser, buf, got = EventParser(), b"", 0
    while got < n:
        data = s.recv(65536)
        assert data, "the stream ended early"
        buf += data
        if b"\r\n\r\n" in buf:
            head, _, rest = buf.partition(b"\r\n\r\n")
            got += len(parser.feed(rest))
            buf = head + b"\r\n\r\n"
    s.close()


def test_sse_client_leaving_after_10_pieces_stops_generation(servers):
    port = servers["slow"].port
    before = len(server_log(port))
    read_events_then_leave(port, {"prompt": "Hello", "max_tokens": 100}, 10)
    path, generated, left = wait_for_log(port, before + 1)[-1]
    assert path == "/stream" and left is True
    assert generated <= 11
    wait_idle(port)


def test_the_naive_server_generates_all_100_for_nobody(servers):
    port = servers["naive"].port
    before = len(server_log(port))
    read_events_then_leave(port, {"prompt": "Hello", "max_tokens": 100}, 10)
    path, generated, left = wait_for_log(port, before + 1, timeout=60)[-1]
    assert (path, generated) == ("/stream", 100)


@pytest.mark.parametrize("name,most", [("slow", 25), ("naive", 100)])
def test_complete_client_leaving_stops_generation(servers, name, most):
    """The article's server forgot /complete. A client that leaves after ~0.2 s (about 10 tokens
    at 20 ms each) costs a handful of tokens; the naive server generates all 100."""
    port = servers[name].port
    before = len(server_log(port))
    s = connect(port)
    body = json.dumps({"prompt": "Hello", "max_tokens": 100}).encode()
    s.sendall(
        b"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % len(body)
        + body
    )
    time.sleep(0.2)
    s.close()
    path, generated, left = wait_for_log(port, before + 1, timeout=60)[-1]
    assert path == "/complete"
    if name == "naive":
        assert generated == 100
    else:
        assert generated <= most and left is True


def test_ws_stop_after_10_pieces(servers):
    port = servers["slow"].port
    before = len(server_log(port))
    c = WSClient(port)
    c.send_json({"prompt": "Hello", "max_tokens": 100})
    for _ in range(10):
        assert isinstance(c.next(), ws.Message)
    c.send_json({"stop": True})
    messages, code = c.until_close()
    c.close()
    assert messages[-1] == {"done": True} and code == 1000
    path, generated, stopped = wait_for_log(port, before + 1)[-1]
    assert (path, stopped) == ("/ws", True) and generated <= 11


@pytest.mark.parametrize("how", ["close frame", "end of file"])
def test_ws_client_leaving_stops_generation(servers, how):
    port = servers["slow"].port
    before = len(server_log(port))
    c = WSClient(port)
    c.send_json({"prompt": "Hello", "max_tokens": 100})
    for _ in range(10):
        c.next()
    if how == "close frame":
        c.send_close(1001)
        item = c.next()
        while isinstance(item, ws.Message):
            item = c.next()
        assert isinstance(item, Closed) and item.code == 1001  # echoed
        assert c.next() is None  # then the server closes TCP
    c.close()
    path, generated, stopped = wait_for_log(port, before + 1)[-1]
    assert stopped is True and generated <= 12


def test_ws_answers_pings_with_the_same_payload_mid_stream(servers):
    port = servers["slow"].port
    c = WSClient(port)
    c.send_json({"prompt": "Hello", "max_tokens": 20})
    c.send_frame(ws.Frame(ws.PING, b"are you there"))
    seen = []
    while (item := c.next()) is not None:  # the session echoes the close
        seen.append(item)
    c.close()
    assert ws.Frame(ws.PONG, b"are you there") in seen
    assert json.loads(seen[-2].data) == {"done": True}


def test_ws_fragmented_first_message_and_64_bit_length(servers):
    port = servers["plain"].port
    body = json.dumps({"prompt": "Hello " * 11000, "max_tokens": 3}).encode()  # over 65,535 bytes
    assert len(body) > 65535
    c = WSClient(port)
    half = len(body) // 2
    c.send_frame(ws.Frame(ws.TEXT, body[:half], fin=False))
    c.send_frame(ws.Frame(ws.CONT, body[half:]))
    messages, code = c.until_close()
    c.close()
    assert messages[-1] == {"done": True} and code == 1000


def test_sse_keep_alive_pings_during_silence(servers):
    status, _, body = http(servers["quiet"].port, "POST", "/stream", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200
    assert b": ping\n\n" in body
    pieces, done = stream_texts(body)  # the parser ignores the comments
    assert done and pieces


def test_ws_keep_alive_pings_during_silence(servers):
    c = WSClient(servers["quiet"].port)
    c.send_json({"prompt": "Hi", "max_tokens": 2})
    kinds = []
    while (item := c.next()) is not None:  # the session answers the pings and echoes the close
        kinds.append(ws.CLOSE if isinstance(item, Closed) else item.opcode)
    c.close()
    assert ws.PING in kinds and kinds[-1] == ws.CLOSE


def test_failure_mid_stream_is_an_error_event_after_the_200(servers):
    port = servers["failing"].port
    status, _, body = http(port, "POST", "/stream", {"prompt": "Hi", "max_tokens": 50})
    assert status == 200
    from helpers import events

    evs = events(body)
    assert evs[-1].event == "error" and "injected failure" in json.loads(evs[-1].data)["error"]["message"]
    assert all(e.data != "[DONE]" for e in evs)


def test_failure_before_the_response_is_a_500_with_a_json_body(servers):
    status, headers, body = http(servers["failing"].port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 50})
    assert status == 500 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["type"] == "generation_failed"


def test_failure_on_ws_is_an_error_message_and_close_1011(servers):
    messages, code = ws_generate(servers["failing"].port, {"prompt": "Hi", "max_tokens": 50})
    assert "error" in messages[-1] and code == 1011


def test_several_clients_at_once_each_get_their_own_answer(servers):
    import concurrent.futures

    port = servers["exact"].port  # (with the tiny model a batch changes the last bits of the logits)
    requests = [dict(PROMPT, seed=s, max_tokens=20) for s in range(6)]
    alone = [json.loads(http(port, "POST", "/complete", r)[2])["text"] for r in requests]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda r: json.loads(http(port, "POST", "/complete", r)[2])["text"], requests))
    assert together == alone and len(set(alone)) == 6


@pytest.mark.parametrize("version", ["1.1", "1.0"])
def test_expect_100_continue(servers, version):
    """HTTP/1.1: `100 Continue`, then the body, then the answer. HTTP/1.0: the expectation is
    ignored (RFC 9110 §10.1.1: such a client takes the first status line for the final one):
    nothing comes before the body is sent."""
    port = servers["plain"].port
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    host = b"Host: 127.0.0.1\r\n" if version == "1.1" else b""
    with connect(port) as s:
        s.sendall(
            b"POST /complete HTTP/%s\r\n%sContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
            % (version.encode(), host, len(body))
        )
        if version == "1.1":
            assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        else:
            s.settimeout(0.5)
            with pytest.raises(TimeoutError):
                s.recv(100)
            s.settimeout(30)
        s.sendall(body)
        status, _, out = read_response(s)
    assert status == 200 and "text" in json.loads(out)


def test_a_slow_request_gets_408(servers):
    port = servers["failing"].port  # started with --request-timeout 1
    with connect(port) as s:
        s.sendall(
            b"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        status, _, body = read_response(s)
    assert status == 408 and json.loads(body)["error"]["status"] == 408


def test_shutdown_closes_websockets_with_1001_and_stops_generation():
    from helpers import ServerProcess

    s = ServerProcess("--token-delay", "0.05", "--shutdown-grace", "0.5").wait()  # then the rest end
    try:
        c = WSClient(s.port)
        c.send_json({"prompt": "Hello", "max_tokens": 1000})
        for _ in range(3):
            c.next()
        s.proc.send_signal(__import__("signal").SIGTERM)
        messages, code = c.until_close()
        c.close()
        assert code == 1001
        assert s.proc.wait(20) == 0
        assert s.wait_line("shut down")
    finally:
        s.stop()


def test_a_client_that_stops_reading_is_dropped_after_the_write_timeout():
    """--write-timeout: a reader that stays connected but reads nothing is dropped, and its
    generation stops long before max_tokens. In process, so that both ends' socket buffers can
    be made small: otherwise loopback buffers absorb megabytes before a write blocks."""
    import asyncio

    import lm
    import server
    from streaming.server.protocol import HttpProtocol
    from streaming.server.serve import build

    # (one event a piece: merged, a short answer's text may fit whole in the buffers it must fill;
    # test_merging.py has the same drop with merging on)
    args = server.parse_args(["--model", "tiny", "--port", "0", "--write-timeout", "0.5", "--stream-merge", "off"])
    lm.model()  # loaded, as serve() loads it before the first answer
    ctx = build(server.config_of(args), lm.handle())
    protocol = HttpProtocol(ctx)

    async def handle(reader, writer):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer.transport.set_write_buffer_limits(high=4096)
        await protocol.handle(reader, writer)

    async def main():
        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.setblocking(False)
        await asyncio.get_running_loop().sock_connect(c, ("127.0.0.1", port))
        body = json.dumps({"prompt": "Hi", "max_tokens": 4096}).encode()
        c.send(
            b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
        )
        for _ in range(1200):  # at most 60 s
            if ctx.answers.log:
                break
            await asyncio.sleep(0.05)
        c.close()
        listener.close()
        await listener.wait_closed()
        return ctx.answers.log

    log = asyncio.run(main())
    assert log and log[0][0] == "/stream" and log[0][2] is True
    assert log[0][1] < 4096
