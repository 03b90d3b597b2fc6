"""Test helpers: server processes on free ports, and tiny raw-socket clients.

The clients here are deliberately dumb (blocking sockets, read to end-of-file) so that they show
exactly what went over the wire; real third-party clients are used in test_interop.py.
"""

import json
import socket
import time

import torch

import lm
from streaming.launch import ROOT as ROOT
from streaming.launch import Server
from streaming.model.choice import Choice
from streaming.model.loading import Model
from streaming.wire import websocket as ws
from streaming.wire.http11 import END, ResponseReader
from streaming.wire.session import ABNORMAL, Closed, Session
from streaming.wire.sse import EventParser

# Two passes of the same rows in passes of different shapes (batched against alone, blocks against
# one block, a prompt joining in the decode's pass): their logits agree within this share of the
# largest logit's magnitude, by dtype (a row's logits in a batch against alone, tiny model, logits of
# magnitude ~20, measured on an AVX-512 BF16 EPYC: float32 differed by 9e-5, bfloat16 by 0.25, two
# units in its last place)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}


class ServerProcess(Server):
    """`python server.py --port 0 ...` as a child, ready when /ready says so; its output lines
    (stderr too) in `lines`."""

    def __init__(self, *args, model="tiny"):
        super().__init__("server", "--model", model, "--port", "0", *args, env={"PYTHONASYNCIODEBUG": "1"}, stderr=True)
        self.args = args


async def job_text(job):
    """A job's whole text from its queue, in process (an error it puts is raised)."""
    out = []
    while (x := await job.get()) is not None:
        if isinstance(x, BaseException):
            raise x
        out.append(x)
    return "".join(out)


def model_of(net):
    """A network of a test's own, as the engines receive a model (with the process's tokenizer)."""
    return Model(Choice(device="cpu"), net=net, tokenizer=lm.load_tokenizer())


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
    """(status, headers, body) of a whole response as received, through the project's
    ResponseReader (a stream's body ends with the connection); what follows it, in the body."""
    (status, headers, body), rest = one_response(raw)
    return status, headers, body + rest


def split_responses(raw):
    """Every response in the bytes of a connection, in order: [(status, headers, body)]."""
    out = []
    while raw:
        response, raw = one_response(raw)
        out.append(response)
    return out


def one_response(raw):
    reader = ResponseReader()
    reader.feed(raw)
    reader.feed_eof()
    head, body = reader.next_event(), b""
    while (event := reader.next_event()) is not END:
        body += event
    return (head.status, head.headers, body), reader.trailing


def read_response(s):
    """(status, headers, body) of the next response on a socket: read as far as its end (its
    length, its last chunk, or the connection closing), not further: keep-alive connections stay
    open."""
    reader, head, body = ResponseReader(), None, b""
    while True:
        event = reader.next_event()
        if event is None:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                data = b""
            if data:
                reader.feed(data)
            else:
                reader.feed_eof()
        elif event is END:
            return head.status, head.headers, body
        elif head is None:
            head = event
        else:
            body += event


def raw_request(port, data, timeout=30):
    with connect(port, timeout) as s:
        s.sendall(data)
        return read_response(s)


def http(port, method, path, body=None, headers=()):
    data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    if body is not None:
        if not any(k.lower() == "content-type" for k, _ in headers):
            head += "Content-Type: application/json\r\n"
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
    return json.loads(http(port, "GET", "/metrics.json")[2])


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
    """A raw WebSocket client over the project's sans-I/O Session (masks its frames, answers
    pings, echoes the close); `send_frame` and `send_raw` put any bytes on the wire."""

    def __init__(self, port, extra_headers=(), timeout=30, path="/ws"):
        self.sock = connect(port, timeout)
        key = ws.new_key()
        host = next((v for k, v in extra_headers if k.lower() == "host"), f"127.0.0.1:{port}")
        extra = [(k, v) for k, v in extra_headers if k.lower() != "host"]
        self.sock.sendall(ws.client_handshake(host, key, path, extra))
        reader = ResponseReader()
        while (head := reader.next_event()) is None:
            data = self.sock.recv(65536)
            if data:
                reader.feed(data)
            else:
                reader.feed_eof()
        self.status, self.headers = head.status, head.headers
        self.session = Session(client=True)
        self.answer = True  # send what the session has to send (pongs, the echo of a close)
        if self.status == 101:
            assert head.headers.get("sec-websocket-accept") == ws.accept_key(key)
            reader.next_event()  # a 101 has no body: what follows it is the first frames
            self.session.receive_data(reader.trailing)

    def send_frame(self, frame, mask=b"\x01\x02\x03\x04"):
        self.sock.sendall(ws.serialize(frame, mask))

    def send_raw(self, data):
        self.sock.sendall(data)

    def send_json(self, value):
        self.session.send_text(json.dumps(value))
        self.sock.sendall(self.session.data_to_send())

    def send_close(self, code=1000):
        self.session.close(code)
        self.sock.sendall(self.session.data_to_send())

    def next(self):
        """The next Message, ping or pong Frame, or Closed; None after it, at end-of-file."""
        while (item := self.session.next_event()) is None:
            if self.session.closed is not None:
                data = self.recv()
                return None if not data else self.next()
            data = self.recv()
            if data:
                self.session.receive_data(data)
            else:
                self.session.receive_eof()
        if self.answer and (out := self.session.data_to_send()):
            try:
                self.sock.sendall(out)
            except OSError:
                pass
        return item

    def recv(self):
        try:
            return self.sock.recv(65536)
        except ConnectionResetError:
            return b""

    def until_close(self, answer=True):
        """Messages (decoded JSON) until the server's close frame; returns (messages, close code),
        the code None if the connection ended without one."""
        self.answer = answer
        messages = []
        while (item := self.next()) is not None:
            if isinstance(item, ws.Message):
                messages.append(json.loads(item.data))
            elif isinstance(item, Closed):
                return messages, None if item.code == ABNORMAL else item.code
        return messages, None

    def close(self):
        self.sock.close()
