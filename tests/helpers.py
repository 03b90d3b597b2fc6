"""Test helpers: server processes on free ports, and tiny raw-socket clients.

The clients here are deliberately dumb (blocking sockets, read to end-of-file) so that they show
exactly what went over the wire; real third-party clients are used in test_interop.py.
"""

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import ws
from sse import EventParser

ROOT = Path(__file__).resolve().parent.parent


class ServerProcess:
    """`python server.py --port 0 ...` as a child; its stdout lines are collected in `lines`."""

    def __init__(self, *args, model="tiny"):
        env = dict(os.environ, PYTHONASYNCIODEBUG="1", PYTHONUNBUFFERED="1")
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, "server.py", "--model", model, "--port", "0", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines, self.port = [], None
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self.read, daemon=True)
        self.reader.start()

    def read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("listening on http://"):
                self.port = int(line.split(":")[2].split()[0])
                self.ready.set()
        self.ready.set()

    def wait(self, timeout=600):
        self.ready.wait(timeout)
        if self.port is None:
            raise RuntimeError("server did not start:\n" + "\n".join(self.lines))
        return self

    def stop(self, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.reader.join(5)
        self.proc.stdout.close()
        return self.proc.returncode

    def wait_line(self, line, timeout=10):
        deadline = time.monotonic() + timeout
        while line not in self.lines and time.monotonic() < deadline:
            time.sleep(0.02)
        return line in self.lines


def connect(port, timeout=30):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return s


def read_all(s):
    chunks = []
    while True:
        try:
            data = s.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def split_response(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body


def raw_request(port, data, timeout=30):
    with connect(port, timeout) as s:
        s.sendall(data)
        return split_response(read_all(s))


def http(port, method, path, body=None, headers=()):
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    if body is not None:
        head += f"Content-Length: {len(data)}\r\n"
    return raw_request(port, head.encode() + b"\r\n" + data)


def events(body):
    p = EventParser()
    return p.feed(body)


def stream_texts(body):
    """The text pieces of an SSE body, and whether it ended with [DONE]."""
    evs = events(body)
    texts = [json.loads(e.data)["text"] for e in evs if e.event == "message" and e.data != "[DONE]"]
    return texts, bool(evs) and evs[-1].data == "[DONE]"


def server_log(port):
    return json.loads(http(port, "GET", "/log")[2])


def metrics(port):
    return json.loads(http(port, "GET", "/metrics")[2])


def wait_for_log(port, n, timeout=30):
    """The server's log once it has n entries (a request is logged when its thread has ended)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = server_log(port)
        if len(log) >= n:
            return log
        time.sleep(0.05)
    raise AssertionError(f"log stayed at {log}")


def wait_idle(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = metrics(port)
        if m["generation_threads"] == 0 and m["active_generations"] == 0:
            return m
        time.sleep(0.05)
    raise AssertionError(f"generation still running: {m}")


class WSClient:
    """A raw WebSocket client: masks its frames, hands back what the server sent."""

    def __init__(self, port, extra_headers=(), timeout=30):
        self.sock = connect(port, timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        head = (
            f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        )
        head += "".join(f"{k}: {v}\r\n" for k, v in extra_headers)
        self.sock.sendall(head.encode() + b"\r\n")
        buf = b""
        while b"\r\n\r\n" not in buf:
            data = self.sock.recv(65536)
            if not data:
                break
            buf += data
        head, _, rest = buf.partition(b"\r\n\r\n")
        self.status = int(head.split()[1]) if head else None
        self.head = head
        self.parser = ws.Parser(mask_required=False)
        self.parser.feed(rest)
        assert self.status != 101 or ws.accept_key(key).encode() in head

    def send_frame(self, frame, mask=b"\x01\x02\x03\x04"):
        self.sock.sendall(ws.serialize(frame, mask))

    def send_raw(self, data):
        self.sock.sendall(data)

    def send_json(self, value):
        self.send_frame(ws.Frame(ws.TEXT, json.dumps(value).encode()))

    def next(self):
        """The next Message or control Frame; None at end-of-file."""
        while (item := self.parser.next()) is None:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            self.parser.feed(data)
        return item

    def until_close(self, answer=True):
        """Messages (decoded JSON) until the server's close frame; returns (messages, close code)."""
        messages = []
        while (item := self.next()) is not None:
            if isinstance(item, ws.Message):
                messages.append(json.loads(item.data))
            elif item.opcode == ws.CLOSE:
                code, _ = ws.parse_close(item.data)
                if answer:
                    try:
                        self.send_frame(ws.Frame(ws.CLOSE, item.data[:2]))
                    except OSError:
                        pass
                return messages, code
        return messages, None

    def close(self):
        self.sock.close()
