"""HTTP/2 in front, for the browser's six connections to a host: one page in Chromium opens ten
EventSources at once to GET /stream. Straight to the server (HTTP/1.1) at most six stream at once
and the others' first text waits for earlier streams to end; through nginx's TLS server
(nginx/streaming.conf, HTTP/2: one connection) all ten stream at once, each whole. Both print
what they measured (`pytest -s`)."""

import json
import os
import shutil
import subprocess
from urllib.parse import quote

import pytest
from helpers import ServerProcess, http

from streaming import nginxctl

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
NGINX_REQUIRED = os.environ.get("REQUIRE_NGINX") == "1"  # .ci/run: missing is a failure, not a skip
BROWSER_REQUIRED = os.environ.get("REQUIRE_BROWSER") == "1"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover
    sync_playwright = None

MISSING = [
    what
    for what, there, required in (
        ("nginx (apt-get install nginx)", nginxctl.available(), NGINX_REQUIRED),
        ("openssl (apt-get install openssl)", nginxctl.openssl_available(), NGINX_REQUIRED),
        (
            "playwright and Debian's chromium (apt-get install chromium)",
            sync_playwright is not None and os.path.exists(CHROMIUM),
            BROWSER_REQUIRED,
        ),
    )  # fmt: skip
    if not there and not required
]
if MISSING:
    pytest.skip(f"needs {', '.join(MISSING)}", allow_module_level=True)

N = 10  # EventSources on the page: more than a browser's six connections to one host
BROWSER_LIMIT = 6  # Chromium's connections per host over HTTP/1.1 (and Firefox's, by default)
TOKENS, DELAY = 20, 0.04  # each stream lasts at least 0.8 s: long enough to see who waits
PROMPT, SEED = "Write a short note about lighthouses.", 7
FIRST_S = 3.0  # over HTTP/2, every first text within this of the page's start (about 0.2 s here)

# Opens `n` EventSources at once; per source the seconds (from the start) of its open, its first
# text and its end ([DONE], or an error), and its text. Each is closed at its end: an EventSource
# left open would reconnect by itself.
OPEN_ALL = """async ({path, n}) => {
  const t0 = performance.now(), at = () => (performance.now() - t0) / 1000;
  const one = () => new Promise(resolve => {
    const r = {opened: null, first: null, end: null, text: "", pieces: 0, done: false, error: null};
    const es = new EventSource(path);
    const finish = () => { r.end = at(); es.close(); resolve(r); };
    es.onopen = () => { r.opened = at(); };
    es.onmessage = e => {
      if (e.data === "[DONE]") { r.done = true; finish(); return; }
      const text = JSON.parse(e.data).text;
      if (!text) return;
      if (r.first === null) r.first = at();
      r.text += text; r.pieces += 1;
    };
    es.onerror = e => { r.error = e.data || "connection error"; finish(); };
  });
  return Promise.all(Array.from({length: n}, one));
}"""


@pytest.fixture(scope="module")
def server():
    # the exact model: equal texts across a batch are a real assertion (tests/conftest.py)
    with ServerProcess("--token-delay", str(DELAY), model="exact") as s:
        yield s.wait()


@pytest.fixture(scope="module")
def nginx(server):
    with nginxctl.Nginx(server.port, tls=True) as n:
        yield n


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"],
        )
        yield b
        b.close()


@pytest.fixture(scope="module")
def expected(server):
    status, _, body = http(server.port, "POST", "/complete", {"prompt": PROMPT, "max_tokens": TOKENS, "seed": SEED})
    assert status == 200
    return json.loads(body)["text"]


def ten_streams(browser, origin):
    """The page at origin's /health opening N EventSources to /stream: (their records, the page's
    protocol, each /stream response's protocol as Chromium's network log has it)."""
    context = browser.new_context(ignore_https_errors=True)  # the certificate is self-signed
    page = context.new_page()
    cdp = context.new_cdp_session(page)
    cdp.send("Network.enable")
    protocols = []
    cdp.on(
        "Network.responseReceived",
        lambda e: protocols.append(e["response"].get("protocol")) if "/stream?" in e["response"]["url"] else None,
    )
    try:
        page.goto(f"{origin}/health")
        path = f"/stream?prompt={quote(PROMPT)}&max_tokens={TOKENS}&seed={SEED}"
        runs = page.evaluate(OPEN_ALL, {"path": path, "n": N})
        page_protocol = page.evaluate("performance.getEntriesByType('navigation')[0].nextHopProtocol")
    finally:
        context.close()
    return runs, page_protocol, protocols


def at_once(runs):
    """The most streams between their first text and their end at any one time."""
    return max(sum(r["first"] <= s["first"] < r["end"] for r in runs) for s in runs)


def report(name, runs, protocol):
    firsts, ends = sorted(r["first"] for r in runs), sorted(r["end"] for r in runs)
    print(
        f"\n{name} ({protocol}): {N} EventSources, {at_once(runs)} streaming at once; "
        f"first texts at {' '.join(f'{t:.2f}' for t in firsts)} s; ends at {' '.join(f'{t:.2f}' for t in ends)} s"
    )


def whole(runs, expected):
    for r in runs:
        assert r["done"] and r["error"] is None and r["first"] is not None, r
        assert r["text"] == expected


def test_over_http1_at_most_six_stream_at_once_and_the_rest_wait_for_an_end(server, browser, expected):
    runs, protocol, protocols = ten_streams(browser, f"http://127.0.0.1:{server.port}")
    report("straight to the server", runs, protocol)
    assert protocol == "http/1.1" and protocols == ["http/1.1"] * N
    whole(runs, expected)
    assert at_once(runs) <= BROWSER_LIMIT
    # The 7th source to get text had to wait for one of the six connections to be free: for the
    # first end. The 8th for the second, and so on.
    firsts, ends = sorted(r["first"] for r in runs), sorted(r["end"] for r in runs)
    for k in range(BROWSER_LIMIT, N):
        assert firsts[k] >= ends[k - BROWSER_LIMIT], (k, firsts, ends)


def test_over_http2_through_nginx_all_ten_stream_at_once(nginx, browser, expected):
    runs, protocol, protocols = ten_streams(browser, f"https://127.0.0.1:{nginx.tls_port}")
    report("through nginx's TLS server", runs, protocol)
    assert protocol == "h2" and protocols == ["h2"] * N
    whole(runs, expected)
    firsts, ends = sorted(r["first"] for r in runs), sorted(r["end"] for r in runs)
    assert firsts[-1] < ends[0], (firsts, ends)  # every source has text before any ends
    assert firsts[-1] <= FIRST_S and at_once(runs) == N


def test_a_websocket_from_the_http2_page_goes_through_the_same_server(nginx, browser, expected):
    """Chromium asks for a WebSocket over HTTP/1.1 on a TLS connection of its own (nginx 1.22
    offers no WebSocket over HTTP/2); the server checks the page's https Origin against the Host."""
    context = browser.new_context(ignore_https_errors=True)
    page = context.new_page()
    try:
        page.goto(f"https://127.0.0.1:{nginx.tls_port}/health")
        got = page.evaluate(
            """request => new Promise(resolve => {
                 const ws = new WebSocket(`wss://${location.host}/ws`), texts = [];
                 ws.onopen = () => ws.send(JSON.stringify(request));
                 ws.onmessage = e => { const m = JSON.parse(e.data); if (m.text) texts.push(m.text); };
                 ws.onclose = e => resolve({text: texts.join(""), code: e.code});
               })""",
            {"prompt": PROMPT, "max_tokens": TOKENS, "seed": SEED},
        )
    finally:
        context.close()
    assert got == {"text": expected, "code": 1000}


def test_curl_speaks_http2_to_nginx_and_http1_to_the_plain_port(nginx):
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    tls = subprocess.run(
        ["curl", "--http2", "-sv", "--cacert", str(nginx.cert), f"https://127.0.0.1:{nginx.tls_port}/health"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert tls.returncode == 0 and "ALPN: server accepted h2" in tls.stderr and "< HTTP/2 200" in tls.stderr, tls.stderr
    plain = subprocess.run(
        ["curl", "--http2", "-sv", f"http://127.0.0.1:{nginx.port}/health"], capture_output=True, text=True, timeout=30
    )
    assert plain.returncode == 0 and "< HTTP/1.1 200" in plain.stderr, plain.stderr  # no h2c upgrade there
