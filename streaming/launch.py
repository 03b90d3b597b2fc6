"""Child processes for the experiments, the benchmarks and the tests: start, wait, stop.

`Process` starts a command (a server, a proxy, nginx, a peer) and collects its output lines; it
is ready when it prints `listening on http://HOST:PORT` (our server and proxy, started on port 0:
the line gives the port) or, for a program told its port, when that port accepts connections or a
`check(port)` says it answers; `Server` (server.py) is ready when GET /ready says 200, once its
model is loaded. `stop()` sends SIGTERM, then SIGKILL after a timeout. `free_port()`
is a port nobody listens on now, for programs that cannot report the one they picked.
Leaves out: restarting a child, and anything but the loopback.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from streaming.wire.http11 import request_head

ROOT = Path(__file__).resolve().parent.parent
READY = "listening on http://"
START_TIMEOUT = 900.0  # seconds: a first start converts the bundled model (minutes on a slow CPU)
# A server whose seeded answers repeat to the bit: guessed tokens (--speculate) and a retained
# prompt (--retain-memory) change a pass's shape, and bfloat16 rounds differently then, which parts
# two nearly tied tokens (README, `seed`). For checks that compare one request's text made twice.
REPEATS_EXACTLY = ("--speculate", "0", "--retain-memory", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def ready(port: int) -> bool:
    """Whether a server of ours on `port` says GET /ready 200 (its model is loaded)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(request_head("GET", "/ready", "127.0.0.1", [("Connection", "close")]))
            return s.recv(12).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def python(script: str, *args: str) -> list[str]:
    """The argv of one of this project's scripts under the running interpreter."""
    return [sys.executable, script, *args]


class Process:
    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int | None = None,
        env: dict[str, str] | None = None,
        quiet: bool = False,
        stderr: bool = False,
    ) -> None:
        """Start `argv` in the project's folder. `port`: the port it was told to listen on (else
        it reports one). `quiet`: discard its output; `stderr`: collect stderr with stdout."""
        self.name, self.port = name, port
        self.lines: list[str] = []
        self.ready = threading.Event()
        out = subprocess.DEVNULL if quiet else subprocess.PIPE
        err = subprocess.STDOUT if stderr and not quiet else (subprocess.DEVNULL if quiet else None)
        self.proc = subprocess.Popen(
            list(argv),
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
            stdout=out,
            stderr=err,
            text=True,
        )
        self.reader = None
        if not quiet:
            self.reader = threading.Thread(target=self.read, daemon=True)
            self.reader.start()

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if READY in line and self.port is None:
                self.port = int(line.split(READY)[1].split(":")[1].split()[0].rstrip(",/"))
                self.ready.set()
        self.ready.set()

    def wait(self, timeout: float = START_TIMEOUT, check: Callable[[int], bool] | None = None) -> Process:
        """Until it is ready: its `listening on` line, or its port answering `check` (default:
        accepting connections). Raises RuntimeError with its output if it exits or times out."""
        deadline = time.monotonic() + timeout
        if self.port is None:
            self.ready.wait(timeout)
        if self.port is not None:
            while not (check or accepts)(self.port):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.port = None
                    break
                time.sleep(0.1)
        if self.port is None:
            self.stop()
            output = "\n".join(self.lines)
            raise RuntimeError(f"{self.name} did not start (exit {self.proc.poll()}):\n{output}")
        return self

    def wait_line(self, line: str, timeout: float = 10) -> bool:
        deadline = time.monotonic() + timeout
        while line not in self.lines and time.monotonic() < deadline:
            time.sleep(0.02)
        return line in self.lines

    def stop(self, timeout: float = 20) -> int:
        """SIGTERM, then SIGKILL after `timeout` s; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.reader is not None:
            self.reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __enter__(self) -> Process:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Server(Process):
    """`python server.py ARGS` on a port it reports, ready once GET /ready says 200. It loads
    without transformers' progress bars: several loading at once share one terminal, and their
    bars would run into one unreadable line; `loaded` is its one line about the model instead."""

    def __init__(self, name: str, *args: str, env: dict[str, str] | None = None, stderr: bool = False) -> None:
        quiet = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}  # (transformers' bars go by this too)
        super().__init__(name, python("server.py", *args), env=quiet, stderr=stderr)

    def wait(self, timeout: float = START_TIMEOUT, check: Callable[[int], bool] | None = None) -> Server:
        super().wait(timeout, check or ready)
        return self

    @property
    def loaded(self) -> str:
        """Its line saying which model it loaded and how fast ('model ... ready in 2.2 s; ...')."""
        return next((line for line in self.lines if " ready in " in line), "")
