"""Clients nobody here wrote are the judges: the websockets library, httpx, httpx-sse, http.client."""

import http.client
import json

import httpx
import httpx_sse
import pytest
from helpers import ServerProcess, events, server_log, stream_texts, wait_for_log
from websockets.sync.client import connect as ws_connect

from streaming.launch import REPEATS_EXACTLY

REQUEST = {"prompt": "Tides are usually explained", "max_tokens": 40, "seed": 2}


@pytest.fixture(scope="module")
def port(servers):
    return servers["slow"].port  # 20 ms a token: the library's pings land mid-stream


def reference(port):
    return json.loads(httpx.post(f"http://127.0.0.1:{port}/complete", json=REQUEST, timeout=60).text)["text"]


def test_websockets_library_streams_a_whole_answer_with_pings_and_closes_1000(port):
    with ws_connect(f"ws://127.0.0.1:{port}/ws", ping_interval=0.05, ping_timeout=5) as c:
        c.send(json.dumps(REQUEST))
        messages = [json.loads(m) for m in c]  # iterates until the server's close
    assert messages[-1] == {"done": True}
    assert "".join(m["text"] for m in messages[:-1]) == reference(port)
    assert c.protocol.close_rcvd.code == 1000 and c.protocol.close_sent.code == 1000  # a clean close both ways


def test_websockets_library_stop_message(port):
    before = len(server_log(port))
    with ws_connect(f"ws://127.0.0.1:{port}/ws") as c:
        c.send(json.dumps(dict(REQUEST, max_tokens=100)))
        for _ in range(10):
            c.recv()
        c.send(json.dumps({"stop": True}))
        rest = [json.loads(m) for m in c]
    assert rest[-1] == {"done": True} and c.protocol.close_rcvd.code == 1000
    path, generated, stopped = wait_for_log(port, before + 1)[-1]
    assert stopped and generated <= 11


def test_websockets_library_closing_mid_stream_stops_generation(port):
    before = len(server_log(port))
    with ws_connect(f"ws://127.0.0.1:{port}/ws") as c:
        c.send(json.dumps(dict(REQUEST, max_tokens=100)))
        for _ in range(10):
            c.recv()
    # leaving the block sent a close frame (1000); the server echoed it
    assert c.protocol.close_rcvd.code == 1000
    path, generated, stopped = wait_for_log(port, before + 1)[-1]
    assert stopped and generated <= 12


def test_httpx_reads_complete_and_stream(port):
    text = reference(port)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        with client.stream("POST", "/stream", json=REQUEST) as r:
            assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
            body = b"".join(r.iter_bytes())
        r = client.post("/complete", json={"prompt": 3})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request"
    pieces, done = stream_texts(body)
    assert done and "".join(pieces) == text


def test_httpx_sse_reads_a_resumable_stream_as_events_with_data(servers):
    """The usual `json.loads(sse.data)` loop over a resumable GET /stream: no empty event first
    (the `retry:` field rides in event 0's block)."""
    port = servers["resuming"].port
    with httpx.Client(timeout=60) as client:
        query = {"prompt": REQUEST["prompt"], "max_tokens": 20, "seed": 2}
        with httpx_sse.connect_sse(client, "GET", f"http://127.0.0.1:{port}/stream", params=query) as source:
            evs = list(source.iter_sse())
    assert evs[0].event == "stream" and evs[0].retry == 1000 and evs[-1].data == "[DONE]"
    texts = [json.loads(e.data)["text"] for e in evs[1:-1]]  # every event in between: JSON with text
    want = httpx.post(f"http://127.0.0.1:{port}/complete", json=query, timeout=60).json()["text"]
    assert "".join(texts) == want


def test_http_client_reads_complete_and_stream(port):
    text = reference(port)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/complete", json.dumps(REQUEST), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["text"] == text
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/stream", json.dumps(REQUEST), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("X-Accel-Buffering") == "no"
    body = r.read()  # no length, no chunks: read until the server closes
    conn.close()
    evs = events(body)
    assert evs[-1].data == "[DONE]"
    assert "".join(json.loads(e.data)["text"] for e in evs[:-1]) == text


@pytest.mark.bundled
def test_the_bundled_model_end_to_end():
    """The real model through the real server: sensible text, the same all three ways.

    The three requests must get the same arithmetic (REPEATS_EXACTLY). Here that matters: after
    " Washington D" the bundled model's two best tokens are ".C" 20.625 and "." 20.5, one unit of
    bfloat16's last place apart (measured with transformers' forward), and with the defaults one
    request ended "D." where another ended "D.C" in two runs of five."""
    s = ServerProcess(*REPEATS_EXACTLY, model="bundled").wait()
    try:
        request = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
        complete = httpx.post(f"http://127.0.0.1:{s.port}/complete", json=request, timeout=300).json()["text"]
        assert "Paris" in complete
        r = httpx.post(f"http://127.0.0.1:{s.port}/stream", json=request, timeout=300)
        pieces, done = stream_texts(r.content)
        assert done and "".join(pieces) == complete
        with ws_connect(f"ws://127.0.0.1:{s.port}/ws") as c:
            c.send(json.dumps(request))
            messages = [json.loads(m) for m in c]
        assert "".join(m.get("text", "") for m in messages) == complete
    finally:
        s.stop()
