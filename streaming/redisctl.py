"""Start a real Redis (Debian's redis-server) as a child process, for the tests and experiments.

    with Redis() as r:
        ...  # python server.py --store {r.url}

On the loopback, on a free port, with nothing saved to disk (--save '' --appendonly no) and its
working folder in a temporary directory, so several can run side by side without root. `stop()`
and a new `Redis(port=r.port)` are Redis going away and coming back. Leaves out: installing it
(`apt-get install redis-server`; `available()` says whether it is there).
"""

import shutil
import tempfile
from pathlib import Path

from streaming.launch import Process, free_port

START_TIMEOUT = 10.0  # seconds for redis-server to accept connections


def binary():
    return shutil.which("redis-server") or next((p for p in ("/usr/bin/redis-server",) if Path(p).exists()), None)


def available():
    return binary() is not None


class Redis:
    def __init__(self, port=None):
        if not available():
            raise FileNotFoundError("redis-server is not installed (apt-get install redis-server)")
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="streaming-redis-")
        argv = [binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"]
        try:
            self.proc = Process("redis-server", argv, port=self.port, quiet=True)
            self.proc.wait(START_TIMEOUT)  # stops it if it does not start
        except BaseException:  # no working folder left behind by a start that failed
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self):
        self.proc.stop(10)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
