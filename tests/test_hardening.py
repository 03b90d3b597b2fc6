"""Hostile and careless clients over real sockets (issue 12): every bad input gets its 4xx in the
endpoint's own shape, every limit holds (memory bounded, non-readers dropped), only the hosts and
keys the server is meant for get in, and SIGTERM drains. After each case a normal request still
succeeds."""

import concurrent.futures
import json
import signal
import socket
import subprocess
import time

import pytest
from helpers import ServerProcess, WSClient, connect, http, metrics, raw_request, read_all, read_response

from streaming.wire import websocket as ws

FORBIDDEN = ("Traceback", "Error(", "Exception", "RecursionError", "int_max_str_digits", "\\ud800")


@pytest.fixture(scope="module")
def guarded():
    """A key, the free engine (the model is not the point), short timeouts, small budgets, and
    one event a piece (merged, the free engine's 4,096 pieces are ~20 KB, which the buffers of a
    reader who reads nothing hold whole: test_merging.py has that drop with merging on)."""
    args = ("--engine", "free", "--api-key", "k3y", "--write-timeout", "1", "--max-body-memory", "3000000")
    args += ("--stream-merge", "off")
    s = ServerProcess(*args).wait()
    try:
        yield s
    finally:
        s.stop()


def fine(port, key=None):
    """A normal request succeeds (quickly: a 30 s socket timeout)."""
    headers = [("Authorization", f"Bearer {key}")] if key else []
    status, _, body = http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 3}, headers)
    assert status == 200 and "text" in json.loads(body)


def clean(message):
    assert message and not any(f in message for f in FORBIDDEN), message


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


# --- 2. a 4xx for every bad input, in the endpoint's shape -------------------------------------

DEEP = "[" * 100_000
BIG = "1" * 5000


@pytest.mark.parametrize(
    "path,body,status",
    [
        ("/complete", DEEP.encode(), 400),
        ("/stream", b'{"prompt": "a", "max_tokens": ' + BIG.encode() + b"}", 400),
        ("/complete", json.dumps({"prompt": "\ud800"}).encode(), 422),
        ("/stream", json.dumps({"prompt": "a\udfffb"}).encode(), 422),
    ],
    ids=["deep JSON", "5000-digit integer", "lone surrogate", "lone low surrogate"],
)
def test_bad_json_and_text_get_a_4xx_in_our_shape(servers, path, body, status):
    port = servers["plain"].port
    got, headers, out = http(port, "POST", path, body)
    error = json.loads(out)["error"]
    assert got == status and error["status"] == status and headers["content-type"] == "application/json"
    clean(error["message"])
    fine(port)


def test_a_deep_query_value_is_a_422(servers):
    port = servers["plain"].port
    status, _, out = http(port, "GET", "/stream?prompt=hi&max_tokens=" + "%5B" * 50_000)
    assert status == 431 or status == 422  # 50,000 escapes are past the head limit; shorter ones:
    status, _, out = http(port, "GET", "/stream?prompt=hi&max_tokens=" + "[" * 3000)
    assert status == 422 and "max_tokens" in json.loads(out)["error"]["message"]
    fine(port)


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
@pytest.mark.parametrize("body", [DEEP, '{"a": ' + BIG + "}", "surrogate"], ids=["deep", "digits", "surrogate"])
def test_bad_json_and_text_on_v1_in_the_apis_shape(servers, fmt, body):
    port = servers["plain"].port
    if body == "surrogate":
        body = json.dumps({"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": "\ud800"}]})
    path = "/v1/chat/completions" if fmt == "openai" else "/v1/messages"
    status, _, out = http(port, "POST", path, body.encode())
    value = json.loads(out)
    assert status == 400
    if fmt == "openai":
        assert set(value["error"]) == {"message", "type", "param", "code"}
    else:
        assert value["type"] == "error" and value["error"]["type"] == "invalid_request_error"
    clean(value["error"]["message"])
    fine(port)


@pytest.mark.parametrize("path", ["/complete", "/v1/chat/completions"])
def test_a_temperature_too_small_for_float32_is_greedy_not_a_failed_batch(servers, path):
    """1e-300 is a valid temperature, but logits divided by it (float32's 0) were all NaN: the step
    failed, with it every request in its batch, each told Python's own error text. Below
    GREEDY_BELOW a temperature is greedy: the same text as temperature 0, beside other readers."""
    port = servers["plain"].port
    if path == "/complete":
        body = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
    else:
        body = {"model": "x", "max_tokens": 8, "top_p": 0.5, "messages": [{"role": "user", "content": "Hello"}]}

    def text(temperature):
        status, _, out = http(port, "POST", path, {**body, "temperature": temperature})
        assert status == 200, out
        value = json.loads(out)
        return value["text"] if path == "/complete" else value["choices"][0]["message"]["content"]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        tiny, greedy, other = pool.map(text, [1e-300, 0, 0.7])
    assert tiny == greedy and other
    fine(port)


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
@pytest.mark.parametrize(
    "framing,status", [("Content-Length: 2000000", 413), ("Transfer-Encoding: chunked", 411)], ids=["413", "411"]
)
def test_a_body_refused_while_it_is_read_is_the_apis_error_too(servers, fmt, framing, status):
    """Refused before its body is read (too large, chunked, or the bodies' budget full), a
    request's error came in the server's own shape whatever its path: its head is read by then,
    so /v1/messages says it as Anthropic does and /v1/chat/completions as OpenAI does."""
    port = servers["plain"].port
    path = "/v1/chat/completions" if fmt == "openai" else "/v1/messages"
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{framing}\r\n\r\n"
    got, _, out = raw_request(port, head.encode())
    value = json.loads(out)
    assert got == status
    if fmt == "openai":
        assert set(value["error"]) == {"message", "type", "param", "code"}
    else:
        assert value["type"] == "error" and set(value["error"]) == {"type", "message"}
    fine(port)


@pytest.mark.parametrize(
    "length,status",
    [("1" * 5000, 413), ("²", 400), ("1²", 400), ("٣", 400)],
    ids=["5000 digits", "²", "1²", "Arabic 3"],
)
def test_content_length_of_digits_python_reads_but_http_does_not(servers, length, status):
    port = servers["plain"].port
    head = f"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {length}\r\n\r\n".encode()
    got, _, out = raw_request(port, head)
    assert got == status and json.loads(out)["error"]["status"] == status
    fine(port)


def test_two_host_headers_are_a_400(servers):
    port = servers["plain"].port
    got, _, out = raw_request(port, b"GET /log HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n")
    assert got == 400 and "Host" in json.loads(out)["error"]["message"]
    fine(port)


def test_a_lone_surrogate_over_ws_is_a_1008_with_the_reason(servers):
    c = WSClient(servers["plain"].port)
    c.send_json({"prompt": "\ud800 hi"})
    messages, code = c.until_close()
    c.close()
    assert code == 1008 and messages[0]["error"]["status"] == 422
    clean(messages[0]["error"]["message"])


@pytest.mark.parametrize(
    "origin",
    [
        "http://127.0.0.1:{port}.evil.example",
        "http://h:99999",
        "http://h:abc",
        "http://[::1",
        "http://127.0.0.1:{port}/x",
    ],
)
def test_origins_that_do_not_parse_are_foreign(servers, origin):
    port = servers["plain"].port
    c = WSClient(port, [("Origin", origin.format(port=port))])
    c.close()
    assert c.status == 403
    fine(port)


# --- 4. who may use it ----------------------------------------------------------------------------


def every_request(port, host=None, key_header=(), query=""):
    """(name, status) of one request to every endpoint."""
    hdrs = [*key_header] + ([("Host", host)] if host else [])
    body = {"prompt": "Hi", "max_tokens": 2}
    chat = {"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    out = {}
    for name, method, path, value in [
        ("complete", "POST", "/complete", body),
        ("stream", "POST", "/stream", body),
        ("stream GET", "GET", "/stream?prompt=Hi&max_tokens=2", None),
        ("stop", "POST", "/stop", {"id": "nope"}),
        ("log", "GET", "/log", None),
        ("metrics", "GET", "/metrics", None),
        ("metrics.json", "GET", "/metrics.json", None),
        ("openai", "POST", "/v1/chat/completions", chat),
        ("anthropic", "POST", "/v1/messages", chat),
        ("models", "GET", "/v1/models", None),
        ("page", "GET", "/", None),
    ]:
        path += ("&" if "?" in path else "?") + query if query else ""
        status, _, _ = raw(port, method, path, value, hdrs)
        out[name] = status
    c = WSClient(port, hdrs, path="/ws" + (f"?{query}" if query else ""))
    c.close()
    out["ws"] = c.status
    return out


def raw(port, method, path, value, headers):
    """Like helpers.http, but the Host header is ours to set."""
    data = b"" if value is None else json.dumps(value).encode()
    names = {k.lower() for k, _ in headers}
    head = f"{method} {path} HTTP/1.1\r\n" + ("" if "host" in names else f"Host: 127.0.0.1:{port}\r\n")
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    if value is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
    return raw_request(port, head.encode() + b"\r\n" + data)


def test_dns_rebinding_a_foreign_host_gets_421_everywhere(servers):
    port = servers["plain"].port
    got = every_request(port, host=f"evil.example:{port}")
    assert set(got.values()) == {421}, got
    c = WSClient(port, [("Host", f"evil.example:{port}"), ("Origin", f"http://evil.example:{port}")])
    c.close()
    assert c.status == 421
    for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1", f"LOCALHOST:{port}"):
        assert raw(port, "GET", "/log", None, [("Host", host)])[0] == 200, host
    assert raw(port, "GET", "/log", None, [("Host", "127.0.0.1:8080")])[0] == 200  # a proxy's port
    fine(port)


def test_allow_host_adds_a_name():
    s = ServerProcess("--engine", "free", "--allow-host", "chat.example").wait()
    try:
        assert raw(s.port, "GET", "/log", None, [("Host", f"chat.example:{s.port}")])[0] == 200
        assert raw(s.port, "GET", "/log", None, [("Host", f"evil.example:{s.port}")])[0] == 421
    finally:
        s.stop()


def test_with_a_key_every_endpoint_but_the_page_needs_it(guarded):
    port = guarded.port
    without = every_request(port)
    assert without.pop("page") == 200 and set(without.values()) == {401}, without
    wrong = every_request(port, key_header=[("x-api-key", "nope")])
    assert wrong.pop("page") == 200 and set(wrong.values()) == {401}, wrong
    bearer = every_request(port, key_header=[("Authorization", "Bearer k3y")])
    assert bearer.pop("stop") == 404 and bearer.pop("ws") == 101 and set(bearer.values()) == {200}, bearer
    query = every_request(port, query="api_key=k3y")  # EventSource's and a browser WebSocket's way
    assert query.pop("stop") == 404 and query.pop("ws") == 101 and set(query.values()) == {200}, query
    status, _, out = raw(port, "POST", "/v1/chat/completions", {"model": "x", "messages": []}, [])
    assert status == 401 and json.loads(out)["error"]["code"] == "invalid_api_key"  # OpenAI's shape
    fine(port, "k3y")


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x", None])
@pytest.mark.parametrize("path", ["/complete", "/stream", "/stop", "/v1/chat/completions", "/v1/messages"])
def test_posts_that_a_cross_site_form_can_send_get_415(servers, path, ctype):
    port = servers["plain"].port
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n" + (f"Content-Type: {ctype}\r\n" if ctype else "")
    data = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    status, _, out = raw_request(port, head.encode() + b"Content-Length: %d\r\n\r\n" % len(data) + data)
    value = json.loads(out)
    assert status == 415 and "application/json" in value["error"]["message"]  # each shape has error.message
    fine(port)


# --- 3. limits that hold --------------------------------------------------------------------------


def test_readers_that_read_nothing_are_dropped_and_their_generation_stops(guarded):
    """--write-timeout 1: OpenAI streams of 4,096 tokens (~800 KB each), never read."""
    port = guarded.port
    before = len(server_log_keyed(port))
    body = json.dumps(
        {"model": "x", "max_tokens": 4096, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    )
    socks = []
    for _ in range(5):
        s = connect(port)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k3y\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        s.sendall(head.encode() + body.encode())
        socks.append(s)
    deadline = time.monotonic() + 30
    while len(log := server_log_keyed(port)) < before + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    for s in socks:
        s.close()
    entries = log[before:]
    assert len(entries) == 5 and all(e[2] is True and e[1] < 4096 for e in entries), entries
    fine(port, "k3y")


def server_log_keyed(port):
    return json.loads(raw(port, "GET", "/log", None, [("x-api-key", "k3y")])[2])


def test_abandoned_resumable_streams_are_bounded_and_readers_go_first():
    s = ServerProcess("--resume-orphans", "2", "--resume-grace", "30").wait()
    try:
        for _ in range(40):  # opened and closed at once: no reader, no key kept
            with connect(s.port) as c:
                c.sendall(
                    b"GET /stream?prompt=Hello&max_tokens=4096&ignore_eos=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                )
                c.recv(100)
        deadline = time.monotonic() + 20
        while metrics(s.port)["active_generations"] > 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metrics(s.port)["active_generations"] <= 2  # the oldest orphans stopped at once
        fine(s.port)
    finally:
        s.stop()


def test_a_message_in_a_million_fragments_is_closed_1009_without_the_memory(guarded):
    port = guarded.port
    pid = guarded.proc.pid
    before = rss_kb(pid)
    codes = []
    for _ in range(4):
        c = WSClient(port, [("x-api-key", "k3y")])
        frames = ws.serialize(ws.Frame(ws.TEXT, b"{", fin=False), b"abcd")
        frames += ws.serialize(ws.Frame(ws.CONT, b" ", fin=False), b"abcd") * 2_000  # past the 1,024, in one read
        try:
            c.send_raw(frames)
        except OSError:
            pass  # the server closed while we were still sending
        codes.append(c.until_close(answer=False)[1])
        c.close()
    assert set(codes) == {1009}, codes
    assert rss_kb(pid) - before < 20_000  # KB
    fine(port, "k3y")


def test_a_ping_flood_whose_pongs_are_never_read_is_dropped(guarded):
    port = guarded.port
    pid = guarded.proc.pid
    before = rss_kb(pid)
    c = WSClient(port, [("x-api-key", "k3y")])
    c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    ping = ws.serialize(ws.Frame(ws.PING, b"p" * 125), b"abcd")
    sent = 0
    c.sock.settimeout(5)
    try:
        for _ in range(200):  # up to 26 MB of pings; we never read a pong
            c.sock.sendall(ping * 1000)
            sent += 1
    except OSError:
        pass  # the server stopped reading (its buffer was full), then dropped us
    c.close()
    assert sent < 200  # it did not take them all
    assert rss_kb(pid) - before < 20_000
    fine(port, "k3y")


def test_request_bodies_in_flight_share_one_budget(guarded):
    """--max-body-memory 3000000: three 1 MB bodies may be arriving at once; the fourth gets 503."""
    port = guarded.port
    head = b"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-API-Key: k3y\r\nContent-Length: 1000000\r\n\r\n"
    slow = []
    for _ in range(3):
        s = connect(port)
        s.sendall(head + b"{")
        slow.append(s)
        time.sleep(0.3)
    status, headers, out = raw_request(port, head)
    assert status == 503 and headers["retry-after"] == "1" and json.loads(out)["error"]["status"] == 503
    for s in slow:
        s.close()
    time.sleep(0.3)
    fine(port, "k3y")


@pytest.mark.parametrize(
    "target,fields", [("/complete", ""), ("/nope", "X-API-Key: k3y\r\n"), ("/complete", "X-API-Key: wrong\r\n")]
)
def test_a_head_is_vetted_before_its_body_takes_any_of_the_budget(guarded, target, fields):
    """Without the key (or on no route) a request is refused on its head alone, at once, before
    its body is read: heads of 1 MB bodies never sent, from a stranger, held the bodies' budget
    until their 408 (10 s) and every keyed POST got 503 meanwhile."""
    port = guarded.port
    head = f"POST {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{fields}Content-Length: 1000000\r\n\r\n"
    held = []
    try:
        for _ in range(4):
            s = connect(port, timeout=5)
            s.sendall(head.encode())
            status, _, out = read_response(s)  # at once: the body is not waited for
            assert status == (404 if target == "/nope" else 401), out
            held.append(s)
        fine(port, "k3y")
    finally:
        for s in held:
            s.close()


def test_websocket_messages_in_flight_share_the_bodies_budget(guarded):
    """--max-body-memory 3000000: a WebSocket's message is a request too. Three of 0.9 MB may be
    arriving at once (unfinished: a first fragment each); a fourth gets a close 1013 (each
    connection's megabyte was bounded alone: a thousand connections, a gigabyte). Their share
    comes back when they close."""
    port = guarded.port
    part = ws.serialize(ws.Frame(ws.TEXT, b'{"pad": "' + b"a" * 900_000, fin=False), b"abcd")
    held = []
    for _ in range(3):
        c = WSClient(port, [("x-api-key", "k3y")])
        c.send_raw(part)
        held.append(c)
        time.sleep(0.3)
    c = WSClient(port, [("x-api-key", "k3y")])
    try:
        c.send_raw(part)
    except OSError:
        pass  # the server closed while we were still sending
    assert c.until_close(answer=False)[1] == 1013
    c.close()
    for c in held:
        c.close()
    time.sleep(0.3)
    c = WSClient(port, [("x-api-key", "k3y")])
    c.send_raw(part)
    c.send_frame(ws.Frame(ws.CONT, b'", "prompt": "Hi", "max_tokens": 3}'))
    assert c.until_close()[1] == 1000
    c.close()
    fine(port, "k3y")


def test_bytes_sent_under_a_stream_are_not_kept():
    """What a client sends after its request while the answer streams: under a whole answer the
    next, pipelined request's (kept up to PIPELINED_KEEP, then the connection closes after the
    answer), under a stream nothing (its connection carries no more requests). A megabyte each
    was kept before: 48 readers sending one grew the server by 43 MB here."""
    with ServerProcess("--engine", "free", "--token-delay", "0.05") as s:
        s.wait()
        before = rss_kb(s.proc.pid)
        body = json.dumps({"prompt": "Hi", "max_tokens": 4096}).encode()
        head = (
            b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        )
        readers = []
        for _ in range(48):
            c = connect(s.port)
            c.sendall(head % len(body) + body)
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
            c.sendall(b"x" * (1 << 20))
            readers.append(c)
        grown = rss_kb(s.proc.pid) - before
        assert grown < 16 * 1024, f"grew by {grown / 1024:.0f} MB"
        # a whole answer with more than a pipelined request's worth after it: answered, then closed
        c = connect(s.port)
        body = json.dumps({"prompt": "Hi", "max_tokens": 20}).encode()  # a second: the junk arrives first
        c.sendall((head % len(body)).replace(b"/stream", b"/complete") + body + b"x" * (1 << 20))
        status, headers, out = read_response(c)
        assert status == 200 and json.loads(out)["text"] and headers["connection"] == "close"
        assert read_all(c) == b""
        c.close()
        for c in readers:
            c.close()
        fine(s.port)


def test_the_listen_backlog_is_a_setting():
    s = ServerProcess("--engine", "free", "--backlog", "777").wait()
    try:
        out = subprocess.run(["ss", "-ltnH", f"sport = :{s.port}"], capture_output=True, text=True).stdout
        assert out.split()[2] == "777"  # a listening socket's Send-Q is its backlog
    finally:
        s.stop()


# --- 5. shutdown drains ----------------------------------------------------------------------------


def test_sigterm_drains_then_ends_the_rest_with_an_error_and_logs_everything():
    s = ServerProcess("--token-delay", "0.05", "--shutdown-grace", "1.5").wait()
    try:
        with connect(s.port) as short, connect(s.port) as long_:
            for sock, n in ((short, 10), (long_, 1000)):
                body = json.dumps({"prompt": "Hi", "max_tokens": n, "ignore_eos": True}).encode()
                head = "POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                sock.sendall(head.encode() + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            c = WSClient(s.port)
            c.send_json({"prompt": "Hi", "max_tokens": 1000})
            time.sleep(0.3)
            s.proc.send_signal(signal.SIGTERM)
            finished, cut = read_all(short), read_all(long_)
            messages, code = c.until_close()
            c.close()
        assert finished.rstrip().endswith(b"data: [DONE]")  # it finished within the grace
        assert b"event: error" in cut and b"shutting down" in cut and b"[DONE]" not in cut
        assert code == 1001
        assert s.proc.wait(20) == 0
        assert s.wait_line("shut down")
        logged = [line for line in s.lines if ": generated " in line]
        assert len(logged) == 3, s.lines  # every request is in the log
    finally:
        s.stop()


# --- round 3 (issue 21): keep-alive, whole answers and shutdown under attack ---------------------


def test_a_client_that_pipelines_and_never_reads_is_dropped_by_the_write_timeout(guarded):
    """990 pipelined GET /metrics on a 4 KiB receive buffer, never read: each connection was served
    ~595 answers and then held open (48 s observed) before; now every answer goes out within
    --write-timeout (1 s here), a whole one too, and the connection is dropped."""
    port = guarded.port
    one = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k3y\r\n\r\n"
    socks = []
    for _ in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", port))
        s.sendall(one * 990)
        socks.append(s)
    t0 = time.monotonic()
    assert wait_for(lambda: metrics_of(port)["open_connections"] <= 1, 20), metrics_of(port)
    assert time.monotonic() - t0 < 15
    for s in socks:
        s.close()
    fine(port, "k3y")


def metrics_of(port):
    return json.loads(http(port, "GET", "/metrics.json", headers=[("Authorization", "Bearer k3y")])[2])


def wait_for(condition, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_the_log_keeps_the_latest_answers_only():
    with ServerProcess("--engine", "free", "--log-keep", "5") as s:
        s.wait()
        for i in range(8):
            http(s.port, "POST", "/complete", {"prompt": "Hi", "max_tokens": i + 1})
        log = json.loads(http(s.port, "GET", "/log")[2])
        assert [line[1] for line in log] == [4, 5, 6, 7, 8]  # the last five, in order
        assert metrics_of_plain(s.port)["requests_logged"] == 8  # (counted in all)


def metrics_of_plain(port):
    return json.loads(http(port, "GET", "/metrics.json")[2])


def test_an_empty_line_between_pipelined_requests_is_ignored(guarded):
    """RFC 9112 §2.2: a server SHOULD ignore at least one empty line before a request line (a
    client's CRLF after a body); it got a 400 before."""
    one = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with connect(guarded.port) as s:
        s.sendall(one + b"\r\n" + one + b"\r\n\r\n" + one.replace(b"HTTP/1.1", b"HTTP/1.1", 1) + b"\n")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        raw = read_all(s)
    assert raw.count(b"HTTP/1.1 200 OK") == 4 and b"400" not in raw


def test_every_answer_varies_by_origin_and_errors_carry_cors_too():
    app = "http://app.example:3000"
    with ServerProcess("--engine", "free", "--allow-origin", app) as s:
        s.wait()
        for origin in (app, "http://evil.example", None):
            headers = [("Origin", origin)] if origin else []
            status, h, _ = http(s.port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 2}, headers)
            assert status == 200 and h["vary"] == "Origin"  # a shared cache must not mix them up
            assert ("access-control-allow-origin" in h) == (origin == app)
        status, h, _ = http(s.port, "GET", "/nope", headers=[("Origin", app)])
        assert status == 404 and h["access-control-allow-origin"] == app  # the page can read the error
        head = f"POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: {app}\r\nContent-Length: 2000000\r\n\r\n"
        status, h, _ = raw_request(s.port, head.encode())
        assert status == 413 and h["access-control-allow-origin"] == app  # refused before its body: still its page's
        head = f"GET /health HTTP/1.1\r\nHost: evil.example\r\nOrigin: {app}\r\n\r\n".encode()
        status, h, _ = raw_request(s.port, head)
        assert status == 421 and h["access-control-allow-origin"] == app


def test_a_whole_answer_cut_by_the_shutdown_is_a_503():
    """A /complete still generating when SIGTERM's grace runs out got no response at all before
    (the stop read as "the reader left"); now it is a 503 in our shape, as the README says."""
    s = ServerProcess("--token-delay", "0.05", "--shutdown-grace", "1").wait()
    try:
        with connect(s.port) as c:
            body = json.dumps({"prompt": "Hi", "max_tokens": 300, "ignore_eos": True}).encode()
            c.sendall(
                b"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body
            )
            time.sleep(0.5)
            s.proc.send_signal(signal.SIGTERM)
            raw = read_all(c)
        assert raw.startswith(b"HTTP/1.1 503") and b"shutting_down" in raw, raw[:300]
        assert s.proc.wait(20) == 0
    finally:
        s.stop()


def test_a_crlf_after_a_body_leaves_the_connection_idle_not_a_408():
    with ServerProcess("--engine", "free", "--keepalive-timeout", "1", "--request-timeout", "3") as s:
        s.wait()
        body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
        request = b"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        with connect(s.port) as c:
            c.sendall(request + b"Content-Length: %d\r\n\r\n" % len(body) + body + b"\r\n")
            t0 = time.monotonic()
            raw = read_all(c)  # the answer, then the idle connection closed at the keep-alive timeout
        assert raw.count(b"HTTP/1.1 ") == 1 and raw.startswith(b"HTTP/1.1 200") and time.monotonic() - t0 < 2.5


def test_a_refused_body_still_being_sent_gets_its_status_not_a_reset(guarded):
    """A body past the limit (1 MiB) is refused before it is read: a 413, and the connection
    closes. Closed at once with the body's bytes unread, the kernel answered them with a reset,
    and a client still sending its body never read the 413: its send failed (EPIPE, ECONNRESET).
    The server half-closes and reads what comes for a while (RFC 9112 §9.6): the client sends
    its body, then reads its 413."""
    port = guarded.port
    size = 12 * 1024 * 1024  # past what the kernel's buffers hold on the way (at most ~6 MB each side)
    head = f"POST /complete HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    with connect(port) as s:
        s.sendall(head.encode() + b"x" * size)  # the whole request, then the answer: as HTTP clients do
        status, _, body = read_response(s)
    assert status == 413 and json.loads(body)["error"]["status"] == 413
    fine(port, "k3y")


def test_closing_a_connection_whose_client_reads_nothing_takes_a_bound():
    """A closed writer waits for the bytes it still holds, and a client that reads nothing never
    takes them: the connection (its task, its socket, its buffer) stayed for good. Closing waits
    the write timeout at most, then drops it."""
    import asyncio

    from streaming.server.connection import Connection

    async def run():
        took = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            writer.write(b"x" * (4 * 1024 * 1024))  # far past what the kernel's buffers take
            t0 = time.monotonic()
            await Connection(reader, writer).close(0.5)
            took.set_result(time.monotonic() - t0)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)  # (reads 2 KiB, then stops)
        try:
            return await asyncio.wait_for(took, 10)
        finally:
            writer.transport.abort()
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) < 3


def test_closing_a_connection_its_client_has_reset_is_quiet():
    """A client that gave up (a readiness probe's timeout while the model loads) closes; the answer
    written after that draws the client's reset, which the server, no longer reading past the
    end-of-file, does not see. The half-close then met ENOTCONN, an OSError that is not a
    ConnectionError, and each such connection ended in asyncio's "Unhandled exception in
    client_connected_cb" (seen in a benchmark's log, one for each probe)."""
    import asyncio

    from streaming.server.connection import Connection

    async def run():
        closed = asyncio.get_running_loop().create_future()

        async def handle(reader, writer):
            assert await reader.read(1024) == b""  # the client's end-of-file
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
            await asyncio.sleep(0.2)  # its reset comes back
            try:
                await Connection(reader, writer).close(1)
                closed.set_result(None)
            except Exception as e:  # noqa: BLE001 - the test reports it
                closed.set_result(e)

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        sock = socket.create_connection(server.sockets[0].getsockname())
        sock.close()
        try:
            return await asyncio.wait_for(closed, 10)
        finally:
            server.close()
            await server.wait_closed()

    assert asyncio.run(run()) is None
