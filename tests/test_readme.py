"""The README, run as written: its shell blocks line by line and its Python examples, with the
tiny model (LM_MODEL=tiny), on the ports the README names (8765 the server, 8766 the proxy, 8080
nginx). A line that cannot run here is skipped by rule, each rule saying why (SKIP). Servers and
proxies run in the background, waited for until they answer, and are stopped at the end."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ROOT

from streaming.launch import ready

README = (ROOT / "README.md").read_text()
PORTS = (8765, 8766, 8080)
SKIP = {  # a pattern of the command line: why it does not run here
    r"^make ": "the suite and the reproduction themselves (CI runs them)",
    r"^\. \.venv/bin/activate$": "the tests already run in the environment",
    r"^python server\.py --naive$": "a second server on the same port (the first is running)",
    r"^python scripts/bench\.py load$": "the full benchmark takes an hour (the quick form runs)",
    r"^python scripts/bench\.py qoe$": "the full QoE benchmark takes most of an hour (the quick form runs)",
    r"^python scripts/bench\.py guidellm": "installs guidellm into a venv of its own and runs it against the peer",
    r"Last-Event-ID: S\.12": "its id is a placeholder for one you noted",
}
BACKGROUND = {"python server.py": 8765, "python proxy.py": 8766}  # long-running: started, waited for


def blocks(lang):
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def free(port):
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def skipped(command):
    return next((why for pattern, why in SKIP.items() if re.search(pattern, command)), None)


@pytest.fixture
def shell():
    if not all(free(p) for p in PORTS):
        pytest.skip(f"the README's ports {PORTS} are in use here")
    env = dict(os.environ, LM_MODEL="tiny", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    running = {}
    yield env, running
    for p, log in running.values():  # each in its own session: the shell and what it started
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()


def run_line(command, env, running, tmp):
    if (why := skipped(command)) is not None:
        return f"skipped ({why}): {command}"
    # `a & b & c`: a and b in the background (an & inside a quoted URL is not a separator)
    *started, last = [p.strip() for p in re.split(r"\s&(?=\s|$)", command)]
    for part in started:
        background(part, env, running, tmp)
    if not last:
        return f"background: {command}"
    if last.split()[0] == "curl" and not shutil.which("curl"):
        return f"skipped (no curl here): {command}"
    if last in BACKGROUND:
        background(last, env, running, tmp)
        return f"background: {last}"
    # Output to a file, not a pipe: a daemon (nginx) keeps its copy of a pipe open, and a read
    # to its end would wait for it.
    with open(tmp / "out.log", "w+") as out:
        code = subprocess.run(last, shell=True, cwd=ROOT, env=env, stdout=out, stderr=out, timeout=600).returncode
        out.seek(0)
        assert code == 0, f"{last}\n{out.read()[-3000:]}"
    return f"ran: {last}"


def background(part, env, running, tmp):
    if part in running:
        return  # already running (the README starts the server in several sections)
    log = open(tmp / f"{len(running)}.log", "w")  # noqa: SIM115 - the child writes it until the end
    proc = subprocess.Popen(
        part, shell=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    running[part] = proc, log
    port = BACKGROUND.get(part)
    deadline = time.monotonic() + 120
    while port and not (ready(port) if port == 8765 else not free(port)):
        assert proc.poll() is None and time.monotonic() < deadline, Path(log.name).read_text()
        time.sleep(0.2)


def test_every_shell_line_and_python_example_in_the_readme_runs_as_written(shell, tmp_path):
    env, running = shell
    done = []
    for block in blocks("sh"):
        for line in block.splitlines():
            command = line.split("  #")[0].split(" #")[0].strip()
            if command:
                done.append(run_line(command, env, running, tmp_path))
    assert ready(8765), "the README's server is not running"
    for code in blocks("python"):
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
        done.append(f"python example: {out.stdout.strip().splitlines()[-1][:60]}")
    print("\n".join(done))
    assert sum(d.startswith("ran:") for d in done) >= 6
