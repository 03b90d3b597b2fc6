"""Start a real nginx (Debian's package) in front of the server, as a child process.

    with Nginx(upstream_port=8765, extra=["proxy_read_timeout 2s;"]) as n:
        ...  # http://127.0.0.1:{n.port}/
    with Nginx(upstream_port=[8765, 8766]) as n:  # two replicas, round robin
    with Nginx(upstream_port=8765, tls=True) as n:
        ...  # also https://127.0.0.1:{n.tls_port}/, HTTP/2, a self-signed certificate (n.cert)

It runs nginx/streaming.conf as written, with these changes: the upstreams' ports, a free
listening port, and any `extra` directives where the file marks them (for both servers); the TLS
and HTTP/2 server is left out, unless `tls=True`, which gives it a free port of its own and a
self-signed certificate for 127.0.0.1 made with `openssl req` (`certificate()`) in the prefix,
valid one day. Everything lives in a temporary prefix (config, pid, temp folders, certificate,
error log), on the loopback, in the foreground, so several can run side by side without root.
Leaves out: installing nginx (`apt-get install nginx`; `available()` says whether it is there) and
openssl (`openssl_available()`).
"""

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from streaming.launch import ROOT, Process, free_port

CONF = ROOT / "nginx" / "streaming.conf"
MARK = "# experiments: more directives here"
TLS_START = "    # TLS and HTTP/2, for browsers."  # the comment that opens the TLS server block
TLS_LISTEN = "listen 127.0.0.1:8443 ssl http2;"
CERT_DIR = "/tmp/streaming-nginx/"  # where the file as written looks for cert.pem and key.pem
START_TIMEOUT = 10.0  # seconds for nginx to accept connections


def binary():
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def available():
    return binary() is not None


def openssl_available():
    return shutil.which("openssl") is not None


def certificate(folder):
    """A self-signed certificate for 127.0.0.1 (as an IP subjectAltName, which browsers check),
    valid one day: folder/cert.pem and folder/key.pem (an unencrypted RSA key). Returns the
    certificate's path."""
    folder = Path(folder)
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-days", "1",
         "-keyout", str(folder / "key.pem"), "-out", str(folder / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    return folder / "cert.pem"


REPLICAS = re.compile(r"(?:^ *server 127\.0\.0\.1:\d+([^;]*);.*\n)+", re.M)  # the upstream block's servers


def config(upstream_port, port, extra=(), tls_port=None, cert_dir=None):
    """nginx/streaming.conf for these upstream ports and this port; with `tls_port`, its TLS
    server on that port with cert_dir's cert.pem and key.pem, else without that server."""
    ports = [upstream_port] if isinstance(upstream_port, int) else list(upstream_port)
    text = CONF.read_text()
    found = REPLICAS.search(text)
    if found is None:
        raise ValueError(f"{CONF} no longer has an upstream block of `server 127.0.0.1:PORT;` lines")
    lines = "".join(f"        server 127.0.0.1:{p}{found[1]};\n" for p in ports)  # each with the first's parameters
    text = text[: found.start()] + lines + text[found.end() :]
    for d in extra:  # a directive the file sets already is replaced (nginx refuses one set twice)
        line = re.compile(rf"^( *){re.escape(d.split()[0])} [^;]*;", re.M)
        text, n = line.subn(lambda m: m[1] + d, text, count=1)  # noqa: B023 - used at once, in this round
        if not n:
            if MARK not in text:
                raise ValueError(f"{CONF} no longer contains {MARK!r}")
            text = text.replace(MARK, MARK + f"\n    {d}")
    changes = [("listen 127.0.0.1:8080;", f"listen 127.0.0.1:{port};")]
    if tls_port is None:
        text = without_tls(text)
    else:
        changes += [(TLS_LISTEN, TLS_LISTEN.replace("8443", str(tls_port))),
                    (f" {CERT_DIR}cert.pem;", f" {Path(cert_dir) / 'cert.pem'};"),
                    (f" {CERT_DIR}key.pem;", f" {Path(cert_dir) / 'key.pem'};")]  # fmt: skip
    for old, new in changes:
        if old not in text:
            raise ValueError(f"{CONF} no longer contains {old!r}")
        text = text.replace(old, new)
    return text


def without_tls(text):
    """The configuration without its TLS server: from the comment that opens it to its `}`."""
    if TLS_START not in text or TLS_LISTEN not in text:
        raise ValueError(f"{CONF} no longer has a TLS server opening with {TLS_START.strip()!r}")
    start = text.index("\n" + TLS_START)  # the blank line before it goes too
    end = text.index("\n    }\n", text.index(TLS_LISTEN)) + len("\n    }\n")
    return text[:start] + text[end:]


class Nginx:
    def __init__(self, upstream_port, extra=(), port=None, tls=False):
        if not available():
            raise FileNotFoundError("nginx is not installed (apt-get install nginx)")
        if tls and not openssl_available():
            raise FileNotFoundError("openssl is not installed (apt-get install openssl)")
        self.port = port or free_port()
        self.tls_port = None
        while tls and self.tls_port in (None, self.port):
            self.tls_port = free_port()
        self.prefix = Path(tempfile.mkdtemp(prefix="streaming-nginx-"))
        self.log = self.prefix / "error.log"
        self.proc = None
        try:
            self.start(upstream_port, extra)
        except RuntimeError:
            errors = self.errors()
            self.stop()
            raise RuntimeError(f"nginx did not start:\n{errors}") from None
        except BaseException:  # a bad configuration, no certificate: no folder left behind either
            self.stop()
            raise

    def start(self, upstream_port, extra):
        self.prefix.chmod(0o755)  # nginx's workers drop root to `nobody` and must reach tmp/
        (self.prefix / "tmp").mkdir()
        self.cert = certificate(self.prefix) if self.tls_port else None  # read by nginx's master, before it drops root
        text = config(upstream_port, self.port, extra, self.tls_port, self.prefix)
        (self.prefix / "nginx.conf").write_text(text)
        argv = [binary(), "-p", f"{self.prefix}/", "-c", "nginx.conf", "-e", str(self.log), "-g", "daemon off;"]
        self.proc = Process("nginx", argv, port=self.port, quiet=True)  # free_port(): nginx can't report one
        self.proc.wait(START_TIMEOUT)  # nginx opens all its ports before it accepts on any

    def errors(self):
        return self.log.read_text() if self.log.exists() else ""

    def stop(self):
        if self.proc is not None:
            self.proc.stop(10)  # SIGTERM: nginx's fast shutdown
        shutil.rmtree(self.prefix, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
