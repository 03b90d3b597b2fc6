"""`python experiments.py nginx` with the tiny model, through Debian's nginx: each case asserted."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from streaming import nginxctl

REQUIRED = os.environ.get("REQUIRE_NGINX") == "1"  # .ci/run: a missing nginx is a failure, not a skip

if not REQUIRED and not nginxctl.available():
    pytest.skip("needs nginx (apt-get install nginx)", allow_module_level=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nginx")
    p = subprocess.run(
        # The tiny model makes a token in ~5 ms, less than a client's close takes to travel through
        # nginx to the server on a busy 2-core machine (CI once counted 13 tokens for the leave
        # case's 11); a real model's takes 50 ms or more. Paced to 20 ms a token (as conftest's
        # "slow" server), the leave and stop cases measure the chain, not a race.
        [sys.executable, "experiments.py", "nginx", "--model", "tiny", "--token-delay", "0.02", "--results", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, json.loads((out / "nginx.json").read_text())


def test_the_config_is_valid_for_nginx(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginxctl.config(8765, 8080))
    (tmp_path / "tmp").mkdir()
    p = subprocess.run(
        [nginxctl.binary(), "-t", "-p", f"{tmp_path}/", "-c", "nginx.conf", "-e", str(tmp_path / "error.log")],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0 and "syntax is ok" in p.stderr, p.stderr


def test_a_honored_x_accel_buffering_streams(run):
    a = run[1]["honored"]
    assert a["first_s"] <= 0.5 * a["total_s"] and a["pieces"] > 10  # first text well before the end


def test_b_ignored_x_accel_buffering_buffers_to_the_end(run):
    b = run[1]["ignored"]
    assert b["total_s"] - b["first_s"] <= 0.05 * b["total_s"]


def test_c_a_reader_leaving_through_nginx_stops_generation(run):
    assert run[1]["leave"] <= 11


def test_d_an_idle_stream_dies_without_pings_and_survives_with_them(run):
    idle = run[1]["idle"]
    assert not idle["without pings"]["survived"] and idle["without pings"]["seconds"] < 4
    assert idle["with --ping 1"]["survived"] and idle["with --ping 1"]["pieces"] > 0


def test_e_a_websocket_stop_through_nginx(run):
    assert run[1]["ws_stop"] <= 11


def test_it_prints_one_line_per_case_and_all_hold(run):
    out = run[0]
    for start in ("through nginx, X-Accel-Buffering: no honored", "through nginx told to ignore it",
                  "through nginx: SSE client left after 10 pieces", "through nginx: WebSocket client said stop",
                  "through nginx with proxy_read_timeout 2s"):  # fmt: skip
        assert start in out
    assert "through nginx, on our numbers: 6 of 6 hold" in out


def test_nginx_reuses_its_connections_to_the_server(servers):
    """`keepalive 16` in the upstream block, and no `Connection: close` passed on: five requests
    from five clients travel on one upstream connection (the server keeps it open)."""
    from helpers import http

    port = servers["plain"].port
    accepted = lambda: json.loads(http(port, "GET", "/metrics.json")[2])["connections_accepted"]  # noqa: E731
    with nginxctl.Nginx(port) as n:
        before = accepted()
        for i in range(5):
            status, _, body = http(n.port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 2, "seed": i})
            assert status == 200 and json.loads(body)["text"]
        after = accepted()
    assert after - before <= 2  # nginx's one upstream connection, and this count's own request


def test_a_start_that_fails_leaves_no_folder_behind(tmp_path, monkeypatch):
    """nginx refusing its configuration, or a configuration that cannot be built, used to leave its
    temporary folder (and, for the second, a half-written one) behind."""
    monkeypatch.setattr(nginxctl.tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="nginx did not start"):
        nginxctl.Nginx(8765, extra=["no_such_directive on;"])

    def unbuildable(*_):
        raise ValueError("no upstream block")

    monkeypatch.setattr(nginxctl, "config", unbuildable)
    with pytest.raises(ValueError, match="no upstream block"):
        nginxctl.Nginx(8765)
    assert list(tmp_path.iterdir()) == []
