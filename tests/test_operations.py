"""What operators expect (issue 13): Prometheus' text at /metrics that prometheus_client parses,
with values that match what was served; /health and /ready through loading, serving and
draining; and command-line mistakes ending in one line and a non-zero exit."""

import importlib
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import ROOT, ServerProcess, http, read_all, split_responses
from prometheus_client.parser import text_string_to_metric_families

from streaming.launch import Process, python


def scrape(port):
    status, headers, body = http(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_prometheus_text_matches_what_was_served():
    s = ServerProcess("--engine", "free").wait()
    try:
        port = s.port
        sizes = [3, 5, 8]
        for n in sizes:
            assert http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": n})[0] == 200
        status, _, body = http(port, "POST", "/stream", {"prompt": "Hi", "max_tokens": 4})
        assert status == 200 and body.rstrip().endswith(b"[DONE]")
        assert http(port, "POST", "/complete", {"prompt": 5})[0] == 422  # never generated: not counted
        m = scrape(port)
        finished = value(m, "streaming_requests_total", endpoint="/complete", outcome="finished")
        assert finished == 3 and value(m, "streaming_requests_total", endpoint="/stream", outcome="finished") == 1
        assert value(m, "streaming_answer_tokens_count") == 4
        assert value(m, "streaming_answer_tokens_sum") == sum(sizes) + 4
        assert value(m, "streaming_time_to_first_text_seconds_count", endpoint="/complete") == 3
        assert value(m, "streaming_gap_seconds_count") == sum(n - 1 for n in sizes) + 3  # one less than pieces
        assert value(m, "streaming_connections_open") == 1  # this scrape's own
        # the server's QoE estimate: the free engine's pieces come at once, so every reader keeps up
        assert value(m, "streaming_qoe_count", endpoint="/complete") == 3
        assert value(m, "streaming_qoe_sum", endpoint="/stream") == pytest.approx(1.0)
        assert value(m, "streaming_requests_active") == 0 and value(m, "streaming_requests_waiting") == 0
        assert json.loads(http(port, "GET", "/metrics.json")[2])["requests_logged"] == 4  # the JSON stays
    finally:
        s.stop()


def test_a_reader_leaving_is_counted_with_the_tokens_after_its_stop(servers):
    port = servers["slow"].port
    before = scrape(port)
    with socket.create_connection(("127.0.0.1", port)) as c:
        body = json.dumps({"prompt": "Hi", "max_tokens": 200}).encode()
        head = "POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        c.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        c.recv(4096)
    deadline = time.monotonic() + 20
    key = dict(endpoint="/stream", outcome="reader_left")
    while value(scrape(port), "streaming_requests_total", **key) == value(before, "streaming_requests_total", **key):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = scrape(port)
    extra = value(after, "streaming_tokens_after_stop_total") - value(before, "streaming_tokens_after_stop_total")
    assert 0 <= extra <= 1


def test_ready_is_503_while_the_model_loads_and_while_draining():
    """Listening comes first: /health and /ready answer while the model loads."""
    p = Process("server", python("server.py", "--model", "tiny", "--port", "0", "--token-delay", "0.05"), stderr=True)
    try:
        p.ready.wait(60)
        seen, generating = set(), set()
        deadline = time.monotonic() + 120
        while "ready" not in seen and time.monotonic() < deadline:
            status, _, body = http(p.port, "GET", "/ready")
            seen.add((status, json.loads(body)["status"]))
            assert http(p.port, "GET", "/health")[0] == 200
            generating.add(http(p.port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 2})[0])
            seen.add("ready" if status == 200 else "")
        assert {(503, "loading"), (200, "ready")} <= seen
        assert 503 in generating  # the model was loading: 503 with Retry-After, not a hang
        with socket.create_connection(("127.0.0.1", p.port)) as c:  # a long answer keeps it draining
            body = json.dumps({"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}).encode()
            head = "POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            c.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            c.recv(100)
            p.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # the listener is closed: a new connection is refused (a balancer takes the replica out)
            with pytest.raises(OSError):
                http(p.port, "GET", "/ready")
    finally:
        p.stop()


@pytest.mark.parametrize(
    "argv,says",
    [
        (["server.py", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["server.py", "--model", "/nowhere/x.gguf"], "no such .gguf file"),
        (["server.py", "--model", "tiny", "--device", "cuda"], "--device cuda"),
        (["client.py", "measure", "--port", "9", "--prompts", "1"], "no server ready at 127.0.0.1:9"),
        # a folder that holds no model: one line, whichever process loads it (loading.load_and_say)
        (["server.py", "--model", "tests"], "could not load the model tests: "),
        (["server.py", "--model", "tests", "--engine", "process"], "could not load the model tests: "),
    ],
    ids=[
        "unknown model",
        "missing gguf",
        "cuda on cpu",
        "measure without a server",
        "not a model folder",
        "not a model folder, engine process",
    ],
)
def test_a_command_line_mistake_is_one_line_and_a_nonzero_exit(argv, says):
    env = {"PATH": "/usr/bin:/bin"}
    if argv[0] == "client.py":
        env["STREAMING_READY_WAIT"] = "1"
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in out.stderr.splitlines() if not line.startswith("waiting for")]
    assert out.returncode != 0 and len(lines) == 1 and says in lines[0], out.stderr


BAD_OPTIONS = [
    ("--request-timeout", "0"),  # (fired at once: every connection closed unanswered)
    ("--write-timeout", "-1"),  # (every WebSocket answer aborted at its first message)
    ("--ping", "nan"),  # (keep-alives at every turn of the loop)
    ("--token-delay", "-1"),  # (the engine's thread died at its first step: never ready)
    ("--token-delay", "inf"),
    ("--port", "70000"),  # (Python's OverflowError)
    ("--backlog", "99999999999"),
    ("--queue", "-1"),  # (every request a 500)
    ("--max-body-memory", "1000"),  # (under one whole body: a 503 "try again" for good)
    ("--keepalive-timeout", "0"),
    ("--resume-grace", "-2"),
    ("--upstream-silence", "0"),
    ("--fail-after", "-5"),
    ("--max-batch", "0"),
    ("--kv-memory", "inf"),
    ("--speculate", "99"),
    ("--stream-interval", "0"),
]
# The other scripts' options take the same types (streaming/options.py): each said its own words, or none
SCRIPT_OPTIONS = [
    ("proxy", ["--block", "0"]),
    ("proxy", ["--upstream-port", "0"]),
    ("proxy", ["--read-timeout", "nan"]),
    ("client", ["measure", "--port", "70000"]),
    ("client", ["measure", "--prompts", "0"]),
    ("experiments", ["leave", "--token-delay", "61"]),
    ("experiments", ["all", "--naive-port", "-1"]),
]


def parse(script, argv):
    module = importlib.import_module(script)
    return (module.parse_args if hasattr(module, "parse_args") else module.main)(argv)


@pytest.mark.parametrize("script,argv", [("server", list(o)) for o in BAD_OPTIONS] + SCRIPT_OPTIONS)
def test_an_option_out_of_its_range_is_a_usage_error_that_says_the_range(script, argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(script, argv)
    said = capsys.readouterr().err
    option, value = argv[-2:]
    assert e.value.code == 2 and f"argument {option}: {value!r}: must be" in said, said


@pytest.mark.parametrize("script", ["server.py", "proxy.py"])
def test_a_port_taken_is_one_line_and_a_nonzero_exit(script):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--engine", "free"] if script == "server.py" else []
        out = subprocess.run(
            [sys.executable, script, *argv, "--port", str(port)], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    assert out.stderr.strip().splitlines()[-1] == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


# --- CORS --------------------------------------------------------------------------------------

APP = "http://app.example:3000"


@pytest.fixture(scope="module")
def cors_server():
    s = ServerProcess("--engine", "free", "--allow-origin", APP).wait()
    try:
        yield s
    finally:
        s.stop()


@pytest.mark.parametrize("path,method", [("/stream", "POST"), ("/v1/chat/completions", "POST"), ("/log", "GET")])
def test_a_preflight_from_an_allowed_origin(cors_server, path, method):
    asked = [("Origin", APP), ("Access-Control-Request-Method", method)]
    asked += [("Access-Control-Request-Headers", "content-type,authorization,x-stainless-lang")]
    status, headers, body = http(cors_server.port, "OPTIONS", path, headers=asked)
    assert status == 204 and body == b""
    assert headers["access-control-allow-origin"] == APP and headers["vary"] == "Origin"
    assert method in headers["access-control-allow-methods"].split(", ")
    assert headers["access-control-allow-headers"] == "content-type,authorization,x-stainless-lang"
    assert int(headers["access-control-max-age"]) > 0


def test_the_actual_requests_carry_cors_headers_errors_too(cors_server):
    port = cors_server.port
    status, headers, body = http(port, "POST", "/stream", {"prompt": "Hi", "max_tokens": 3}, [("Origin", APP)])
    assert status == 200 and headers["access-control-allow-origin"] == APP and body.rstrip().endswith(b"[DONE]")
    assert "X-Accel-Buffering" in headers["access-control-expose-headers"]
    status, headers, _ = http(port, "POST", "/complete", {"prompt": 5}, [("Origin", APP)])
    assert status == 422 and headers["access-control-allow-origin"] == APP  # the page can read the error


def test_nothing_for_an_origin_not_allowed(cors_server):
    port = cors_server.port
    evil = [("Origin", "http://evil.example"), ("Access-Control-Request-Method", "POST")]
    status, headers, _ = http(port, "OPTIONS", "/stream", headers=evil)
    assert status == 403 and "access-control-allow-origin" not in headers
    status, headers, _ = http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 2}, evil[:1])
    assert status == 200 and "access-control-allow-origin" not in headers  # the browser keeps it from the page
    status, headers, _ = http(port, "OPTIONS", "/nope", headers=evil)
    assert status == 404


# --- keep-alive ----------------------------------------------------------------------------------


def exchange(port, data, timeout=30):
    """Send `data` at once; read until the server closes: [(status, Connection header, body)]."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        raw = read_all(s)
    return [(status, headers.get("connection"), body) for status, headers, body in split_responses(raw)]


def post_bytes(path, value, extra=""):
    body = json.dumps(value).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{extra}"
    return head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_pipelined_requests_are_answered_in_order_on_one_connection(servers):
    port = servers["plain"].port
    data = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    data += post_bytes("/complete", {"prompt": "Hi", "max_tokens": 3})
    data += post_bytes(
        "/v1/chat/completions", {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    )
    data += b"GET /log HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    got = exchange(port, data)
    assert [(status, conn) for status, conn, _ in got] == [(200, "keep-alive")] * 3 + [(200, "close")]
    assert json.loads(got[1][2])["text"] and json.loads(got[2][2])["object"] == "chat.completion"


def test_a_stream_an_error_and_http_1_0_close_the_connection(servers):
    port = servers["plain"].port
    got = exchange(port, post_bytes("/stream", {"prompt": "Hi", "max_tokens": 2}) + b"GET /log HTTP/1.1\r\n\r\n")
    assert len(got) == 1 and got[0][1] == "close" and got[0][2].rstrip().endswith(b"[DONE]")  # until close
    got = exchange(port, post_bytes("/complete", {"prompt": 5}) + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert [(s, c) for s, c, _ in got] == [(422, "close")]
    got = exchange(port, b"GET /health HTTP/1.0\r\n\r\nGET /health HTTP/1.0\r\n\r\n")
    assert [(s, c) for s, c, _ in got] == [(200, "close")]


def test_httpx_pools_one_connection_for_many_requests(servers):
    import httpx

    port = servers["plain"].port
    before = json.loads(http(port, "GET", "/metrics.json")[2])["connections_accepted"]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        for i in range(3):
            assert c.post("/complete", json={"prompt": "Hi", "max_tokens": 2, "seed": i}).status_code == 200
            assert c.get("/log").status_code == 200
    after = json.loads(http(port, "GET", "/metrics.json")[2])["connections_accepted"]
    assert after - before == 2  # httpx's one connection, and this request's own


def test_idle_and_per_connection_limits():
    s = ServerProcess("--engine", "free", "--keepalive-timeout", "0.5", "--keepalive-requests", "2").wait()
    try:
        health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        got = exchange(s.port, health * 3)
        assert [(st, c) for st, c, _ in got] == [(200, "keep-alive"), (200, "close")]  # the second is the last
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as c:
            c.sendall(health)
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.monotonic()
            assert c.recv(4096) == b""  # closed for idling
            assert time.monotonic() - t0 < 5
    finally:
        s.stop()


def test_a_malformed_request_after_a_kept_alive_one_still_gets_its_400(servers):
    port = servers["plain"].port
    got = exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGARBAGE\r\n\r\n")
    assert [(status, conn) for status, conn, _ in got] == [(200, "keep-alive"), (400, "close")]


@pytest.mark.parametrize(
    "engine", [["--engine", "free"], ["--engine", "process", "--model", "exact"]], ids=["free", "process"]
)
def test_a_server_outlives_the_reader_of_its_log(engine):
    """Its stdout is a pipe whose reader goes away (a killed benchmark, a restarted supervisor): the
    next request's log line, and the exit's "shut down", are dropped, not a BrokenPipeError in the
    handler or a traceback at the exit (streaming/lossy.py). With --engine process the lines are
    the server's own: its engine process writes nothing after it has started."""
    argv = python("server.py", *engine, "--port", "0")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://"), line
        port = int(line.split(":")[-1].split()[0])
        deadline = time.monotonic() + 60
        while http(port, "GET", "/ready")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.stdout.close()  # the log's reader is gone
        for _ in range(3):  # each request logs a line ("generated N tokens")
            status, _, body = http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 5})
            assert status == 200 and json.loads(body)["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "BrokenPipe" not in err, err
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()


def test_lossy_drops_after_a_closed_pipe_but_not_a_line_its_encoding_cannot_say():
    """The pure part of streaming/lossy.py: a closed pipe is lost for good (and the descriptor
    points at /dev/null, so the exit's flush is quiet); an encoding error is the writer's, raised,
    and the stream stays (its reader is still there)."""
    import io
    import os

    from streaming.lossy import Lossy

    read, write = os.pipe()
    stream = Lossy(io.TextIOWrapper(io.FileIO(write, "w"), encoding="ascii", write_through=True))
    stream.write("one\n")
    assert os.read(read, 100) == b"one\n"
    with pytest.raises(UnicodeEncodeError):
        stream.write("caf\u00e9\n")
    assert not stream.gone
    os.close(read)
    stream.writelines(["two\n", "three\n"])  # the pipe's reader is gone: dropped, no error
    stream.flush()
    assert stream.gone and stream.write("four\n") == 5
    stream.stream.close()  # (its descriptor now points at /dev/null: closing is quiet)
