"""The honest queue (issue 22 §5): a request that waits for a place in the batch is told its place
in its keep-alive comments, and past --max-waiting a new one is refused before any header, 503
with Retry-After in the endpoint's own shape (OpenAI's error, ours, a WebSocket close 1013), while
the requests already in keep going. A real server with the `exact` model."""

from __future__ import annotations

import json
import time

import pytest
from helpers import ServerProcess, WSClient, connect, http

from streaming.generation.waiting import LANDING_MOST, LANDING_QUIET, WaitingRoom


def test_the_waiting_room_refuses_only_past_its_bound_counting_the_places_still_free():
    class Row:
        def __init__(self):
            self.job, self.not_before = object(), 0.0

    room = WaitingRoom(max_waiting=0)
    assert room.refusal(free=4) is None  # an idle server: a place is free
    assert room.refusal(free=0) is not None  # the batch is full: 0 may wait
    room = WaitingRoom(max_waiting=2)
    for _ in range(3):
        room.append(Row())
    assert room.refusal(free=2) is None  # two of the three take the free places at the next step
    assert room.refusal(free=1) is not None  # one does: two still wait, the bound
    waiting, seconds = room.refusal(free=0)
    assert waiting == 3 and seconds == 5  # no ends seen yet: the default estimate
    room.left(10.0)
    room.left(14.0, rows=2)
    assert room.refusal(free=0)[1] == 2  # ends 2 s apart on average: Retry-After 2


def test_an_idle_engine_waits_for_a_burst_to_land_and_no_longer():
    class Row:
        def __init__(self, created):
            self.job, self.not_before, self.created = object(), 0.0, created

    room = WaitingRoom()
    assert room.landing(5.0) == 0.0  # nobody waits: nothing to wait for
    room.append(Row(10.0))
    assert room.landing(10.0) == pytest.approx(LANDING_QUIET)  # a lone request pays the quiet once
    assert room.landing(10.0 + LANDING_QUIET) == 0.0
    for i in range(1, 10):  # a burst arriving 8 ms apart keeps the door open...
        room.append(Row(10.0 + 0.008 * i))
    assert room.landing(10.045) == pytest.approx(LANDING_MOST - 0.045)  # ...up to the most after the first
    assert room.landing(10.0 + LANDING_MOST) == 0.0


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--max-batch", "1", "--max-waiting", "1", "--token-delay", "0.05", "--ping", "0.2", model="exact")
    s.wait()
    yield s
    s.stop()


def open_stream(port, max_tokens):
    s = connect(port)
    body = json.dumps({"prompt": "Hello", "max_tokens": max_tokens}).encode()
    s.sendall(
        f"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def read_until(s, marker, timeout=10):
    got, deadline = b"", time.monotonic() + timeout
    while marker not in got and time.monotonic() < deadline:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = s.recv(65536)
        if not data:
            break
        got += data
    return got


def test_a_waiting_reader_is_told_its_place_and_past_the_bound_a_new_one_gets_503_retry_after(server):
    port = server.port
    running = open_stream(port, 400)  # the batch's one place
    assert b'"text"' in read_until(running, b'"text"')
    waiting = open_stream(port, 5)  # the one place in the queue
    assert b": waiting for a place in the batch, 0 ahead" in read_until(waiting, b"ahead")

    status, headers, body = http(port, "POST", "/stream", {"prompt": "Hi", "max_tokens": 3})
    error = json.loads(body)["error"]
    assert status == 503 and error["type"] == "overloaded" and "--max-waiting" in error["message"]
    assert 1 <= int(headers.get("retry-after")) <= 60

    status, headers, body = http(
        port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True}
    )
    assert status == 503 and headers.get("retry-after")
    assert "message" in json.loads(body)["error"]  # OpenAI's error shape

    c = WSClient(port)
    c.send_json({"prompt": "Hi", "max_tokens": 3})
    messages, code = c.until_close()
    c.close()
    assert code == 1013 and messages and messages[0]["error"]["status"] == 503

    running.close()  # the running reader leaves: the waiting one gets the place and its whole answer
    rest = read_until(waiting, b"[DONE]", timeout=30)
    waiting.close()
    assert b"[DONE]" in rest and rest.count(b'"text"') >= 1
    status, _, _ = http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 3})
    assert status == 200  # room again
