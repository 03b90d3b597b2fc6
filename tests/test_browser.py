"""The page at GET / in a real browser (Debian's Chromium, driven by playwright): each transport
shows the server's text, Stop stops generation, the WebSocket closes cleanly, and EventSource
resumes by itself after the server drops it."""

import json
import os
import shutil

import pytest
from helpers import http, metrics, server_log, wait_for_log

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
REQUIRED = os.environ.get("REQUIRE_BROWSER") == "1"  # .ci/run: a missing browser is a failure, not a skip
TRANSPORTS = ["fetch", "eventsource", "websocket"]
PROMPT = "Write a short note about lighthouses."

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover
    sync_playwright = None

if not REQUIRED and (sync_playwright is None or not os.path.exists(CHROMIUM)):
    pytest.skip("needs playwright and Debian's chromium (apt-get install chromium)", allow_module_level=True)


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"],
        )
        yield b
        b.close()


def start(browser, port, transport, max_tokens, seed=7):
    page = browser.new_page()
    page.goto(f"http://127.0.0.1:{port}/")
    page.fill("#prompt", PROMPT)
    page.fill("#max_tokens", str(max_tokens))
    page.fill("#seed", str(seed))
    page.select_option("#transport", transport)
    page.click("#start")
    return page


def finish(page, timeout=60_000):
    page.wait_for_function("window.run && ['done', 'stopped', 'error'].includes(window.run.status)", timeout=timeout)
    return page.evaluate(
        "({status: run.status, error: run.error || null, text: run.text, shown: document.getElementById('out').textContent,"
        " pieces: run.pieces, reconnects: run.reconnects, close: run.close})"
    )


def complete(port, max_tokens, seed=7):
    status, _, body = http(port, "POST", "/complete", {"prompt": PROMPT, "max_tokens": max_tokens, "seed": seed})
    assert status == 200
    return json.loads(body)["text"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_shows_the_text_of_complete(servers, browser, transport):
    port = servers["slow"].port
    page = start(browser, port, transport, 30)
    run = finish(page)
    page.close()
    assert run["status"] == "done", run
    assert run["text"] == run["shown"] == complete(port, 30)
    assert run["pieces"] > 1  # it arrived in pieces, not at once
    if transport == "websocket":
        assert run["close"] == {"code": 1000, "wasClean": True, "reason": ""}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stop_leaves_at_most_one_token_after_the_stop(servers, browser, transport):
    port = servers["slow"].port
    before, m0 = len(server_log(port)), metrics(port)
    page = start(browser, port, transport, 3000)
    page.wait_for_function("window.run.pieces >= 8", timeout=60_000)
    page.click("#stop")
    run = finish(page)
    page.close()
    assert run["status"] == "stopped", run
    path, produced, left = wait_for_log(port, before + 1)[before]
    assert path == "/ws" if transport == "websocket" else path == "/stream"
    assert left and produced < 3000
    m1 = metrics(port)
    assert m1["requests_stopped"] - m0["requests_stopped"] == 1
    assert m1["tokens_after_stop"] - m0["tokens_after_stop"] <= 1, (m0, m1)


def test_eventsource_reconnects_after_the_server_drops_it_and_ends_with_the_whole_text(servers, browser):
    port = servers["dropping"].port  # --drop-after 8: the connection breaks every 8 events
    before = len(server_log(port))
    page = start(browser, port, "eventsource", 30)
    run = finish(page)
    page.close()
    assert run["status"] == "done", run
    assert run["reconnects"] >= 2
    log = wait_for_log(port, before + 1)[before:]
    assert len(log) == 1 and log[0][0] == "/stream" and not log[0][2]  # one generation, not stopped
    assert run["text"] == complete(port, 30)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_transport_through_nginx_with_the_pages_origin(servers, browser, transport):
    """The page served through nginx on another port: its Origin (http://127.0.0.1:NGINX) must
    match the Host the server sees, which nginx passes on with the port ($http_host)."""
    from streaming import nginxctl

    if not nginxctl.available():
        if os.environ.get("REQUIRE_NGINX") == "1":
            pytest.fail("nginx is not installed")
        pytest.skip("needs nginx (apt-get install nginx)")
    port = servers["slow"].port
    with nginxctl.Nginx(port) as n:
        page = start(browser, n.port, transport, 30)
        run = finish(page)
        page.close()
    assert run["status"] == "done", run
    assert run["text"] == run["shown"] == complete(port, 30)
