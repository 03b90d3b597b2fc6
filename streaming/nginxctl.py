"""Start a real nginx (Debian's package) in front of the server, as a child process.

    with Nginx(upstream_port=8765, extra=["proxy_read_timeout 2s;"]) as n:
        ...  # http://127.0.0.1:{n.port}/
    with Nginx(upstream_port=[8765, 8766]) as n:  # two replicas, round robin

It runs nginx/streaming.conf as written, with three changes: the upstreams' ports, a free
listening port, and any `extra` directives where the file marks them. Everything lives in a
temporary prefix (config, pid, temp folders, error log), on the loopback, in the foreground, so
several can run side by side without root. Leaves out: installing nginx (`apt-get install nginx`;
`available()` says whether it is there).
"""

import re
import shutil
import tempfile
from pathlib import Path

from streaming.launch import ROOT, Process, free_port

CONF = ROOT / "nginx" / "streaming.conf"
MARK = "# experiments: more directives here"
START_TIMEOUT = 10.0  # seconds for nginx to accept connections


def binary():
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def available():
    return binary() is not None


REPLICAS = re.compile(r"(?:^ *server 127\.0\.0\.1:\d+([^;]*);.*\n)+", re.M)  # the upstream block's servers


def config(upstream_port, port, extra=()):
    ports = [upstream_port] if isinstance(upstream_port, int) else list(upstream_port)
    text = CONF.read_text()
    found = REPLICAS.search(text)
    if found is None:
        raise ValueError(f"{CONF} no longer has an upstream block of `server 127.0.0.1:PORT;` lines")
    lines = "".join(f"        server 127.0.0.1:{p}{found[1]};\n" for p in ports)  # each with the first's parameters
    text = text[: found.start()] + lines + text[found.end() :]
    for old, new in (("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};"),
                     (MARK, MARK + "".join(f"\n            {d}" for d in extra))):  # fmt: skip
        if old not in text:
            raise ValueError(f"{CONF} no longer contains {old!r}")
        text = text.replace(old, new)
    return text


class Nginx:
    def __init__(self, upstream_port, extra=(), port=None):
        if not available():
            raise FileNotFoundError("nginx is not installed (apt-get install nginx)")
        self.port = port or free_port()
        self.prefix = Path(tempfile.mkdtemp(prefix="streaming-nginx-"))
        self.prefix.chmod(0o755)  # nginx's workers drop root to `nobody` and must reach tmp/
        (self.prefix / "tmp").mkdir()
        (self.prefix / "nginx.conf").write_text(config(upstream_port, self.port, extra))
        self.log = self.prefix / "error.log"
        argv = [binary(), "-p", f"{self.prefix}/", "-c", "nginx.conf", "-e", str(self.log), "-g", "daemon off;"]
        self.proc = Process("nginx", argv, port=self.port, quiet=True)  # free_port(): nginx can't report one
        try:
            self.proc.wait(START_TIMEOUT)
        except RuntimeError:
            errors = self.errors()
            self.stop()
            raise RuntimeError(f"nginx did not start:\n{errors}") from None

    def errors(self):
        return self.log.read_text() if self.log.exists() else ""

    def stop(self):
        self.proc.stop(10)  # SIGTERM: nginx's fast shutdown
        shutil.rmtree(self.prefix, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
