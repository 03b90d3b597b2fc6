"""A table of bad inputs over real sockets, each getting its status or close code; after all of
them a normal request still succeeds and no generation thread is left running."""

import json

import pytest
from helpers import WSClient, http, metrics, raw_request, wait_idle

from streaming.wire import websocket as ws

H = b"Host: 127.0.0.1\r\n"
WS_FIELDS = b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"


def post(path, body, extra=b""):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = b"POST %s HTTP/1.1\r\n" % path + H + b"Content-Type: application/json\r\n" + extra
    return head + b"Content-Length: %d\r\n\r\n" % len(data) + data


HTTP_CASES = [
    ("garbage request line", b"HELLO\r\n\r\n", 400),
    ("HTTP/2.0", b"GET /log HTTP/2.0\r\n" + H + b"\r\n", 505),
    ("no Host", b"GET /log HTTP/1.1\r\n\r\n", 400),
    ("absolute-form target", b"GET http://x/log HTTP/1.1\r\n" + H + b"\r\n", 400),
    ("header without a colon", b"GET /log HTTP/1.1\r\n" + H + b"Oops\r\n\r\n", 400),
    ("space before the colon", b"GET /log HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    ("obsolete line folding", b"GET /log HTTP/1.1\r\n" + H + b"A: b\r\n c\r\n\r\n", 400),
    ("head over 16 KiB", b"GET /log HTTP/1.1\r\n" + H + b"X: " + b"a" * 17000 + b"\r\n\r\n", 431),
    ("body over 1 MiB", b"POST /complete HTTP/1.1\r\n" + H + b"Content-Length: 2000000\r\n\r\n", 413),
    ("chunked body", b"POST /complete HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    ("chunked and a length", post(b"/complete", b"{}", b"Transfer-Encoding: chunked\r\n"), 400),
    ("bad Content-Length", b"POST /complete HTTP/1.1\r\n" + H + b"Content-Length: -1\r\n\r\n", 400),
    ("unknown path", b"GET /nope HTTP/1.1\r\n" + H + b"\r\n", 404),
    ("GET /complete", b"GET /complete HTTP/1.1\r\n" + H + b"\r\n", 405),
    ("POST /log", post(b"/log", {}), 405),
    ("body not JSON", post(b"/complete", b"{prompt"), 400),
    ("body not UTF-8", post(b"/stream", b"\xff\xfe{}"), 400),
    ("body a JSON list", post(b"/stream", [1, 2]), 400),
    ("no prompt", post(b"/complete", {"max_tokens": 5}), 400),
    ("prompt a number", post(b"/complete", {"prompt": 5}), 422),
    ("empty prompt", post(b"/stream", {"prompt": ""}), 422),
    ("max_tokens 0", post(b"/complete", {"prompt": "a", "max_tokens": 0}), 422),
    ("max_tokens 4097", post(b"/stream", {"prompt": "a", "max_tokens": 4097}), 422),
    ("max_tokens a string", post(b"/complete", {"prompt": "a", "max_tokens": "10"}), 422),
    ("max_tokens true", post(b"/complete", {"prompt": "a", "max_tokens": True}), 422),
    ("max_tokens 1.5", post(b"/complete", {"prompt": "a", "max_tokens": 1.5}), 422),
    ("temperature -1", post(b"/complete", {"prompt": "a", "temperature": -1}), 422),
    ("top_p 0", post(b"/stream", {"prompt": "a", "top_p": 0}), 422),
    ("seed -1", post(b"/complete", {"prompt": "a", "seed": -1}), 422),
    ("ignore_eos not a boolean", post(b"/complete", {"prompt": "a", "ignore_eos": "yes"}), 422),
    ("prompt past the context", post(b"/complete", {"prompt": " a" * 30000, "max_tokens": 4096}), 422),
    ("ws without Upgrade", b"GET /ws HTTP/1.1\r\n" + H + b"\r\n", 426),
    ("POST /ws", post(b"/ws", {}), 405),
    ("ws over HTTP/1.0", b"GET /ws HTTP/1.0\r\n" + H + WS_FIELDS + b"\r\n", 400),
]
WS_HANDSHAKE_CASES = [
    ("ws version 8", [("Sec-WebSocket-Version", "8")], 426),
    ("ws bad key", [("Sec-WebSocket-Key", "c2hvcnQ=")], 400),
    ("ws foreign Origin", [("Origin", "http://evil.example")], 403),
]
MASK = b"\x0a\x0b\x0c\x0d"
FIRST = ws.serialize(ws.Frame(ws.TEXT, json.dumps({"prompt": "Hi", "max_tokens": 200}).encode()), MASK)
WS_FRAME_CASES = [
    ("unmasked frame", ws.serialize(ws.Frame(ws.TEXT, b"{}")), 1002),
    ("reserved bit", bytes([0xC1, 0x80]) + MASK, 1002),
    ("reserved opcode", bytes([0x83, 0x80]) + MASK, 1002),
    ("ping over 125 bytes", bytes([0x89, 0xFE, 0, 126]) + MASK + bytes(126), 1002),
    ("fragmented ping", bytes([0x09, 0x80]) + MASK, 1002),
    ("continuation with nothing to continue", bytes([0x80, 0x80]) + MASK, 1002),
    ("invalid UTF-8", ws.serialize(ws.Frame(ws.TEXT, b"\xc3\x28"), MASK), 1007),
    ("message over 1 MiB", bytes([0x81, 0xFF]) + (2 << 20).to_bytes(8, "big") + MASK, 1009),
    ("binary message", ws.serialize(ws.Frame(ws.BINARY, b"{}"), MASK), 1003),
    ("first message not JSON", ws.serialize(ws.Frame(ws.TEXT, b"hello"), MASK), 1008),
    ("first message without prompt", ws.serialize(ws.Frame(ws.TEXT, b'{"max_tokens": 5}'), MASK), 1008),
    ("max_tokens 0 over ws", ws.serialize(ws.Frame(ws.TEXT, b'{"prompt": "a", "max_tokens": 0}'), MASK), 1008),
    ("close with 1 byte", bytes([0x88, 0x81]) + MASK + b"\x00", 1002),
    ("close code 999", ws.close_frame(999, mask=MASK), 1002),
    ("a later message not JSON", FIRST + ws.serialize(ws.Frame(ws.TEXT, b"stop!"), MASK), 1008),
    ("unmasked frame mid-stream", FIRST + ws.serialize(ws.Frame(ws.TEXT, b"{}")), 1002),
]


@pytest.fixture(scope="module")
def port(servers):
    return servers["plain"].port


@pytest.mark.parametrize("data,status", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http(port, data, status):
    got, headers, body = raw_request(port, data)
    error = json.loads(body)["error"]
    assert got == status and error["status"] == got and error["message"]
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    if got == 405:
        assert headers["allow"] in ("GET", "POST")


@pytest.mark.parametrize("headers,status", [c[1:] for c in WS_HANDSHAKE_CASES], ids=[c[0] for c in WS_HANDSHAKE_CASES])
def test_ws_handshake(port, headers, status):
    c = WSClient(port, headers)
    c.close()
    assert c.status == status
    if status == 426:
        assert c.headers.get("sec-websocket-version") == "13"


@pytest.mark.parametrize("data,code", [c[1:] for c in WS_FRAME_CASES], ids=[c[0] for c in WS_FRAME_CASES])
def test_ws_frames(port, data, code):
    c = WSClient(port)
    assert c.status == 101
    c.send_raw(data)
    messages, got = c.until_close(answer=False)
    c.close()
    assert got == code


def test_the_server_still_serves_and_no_generation_is_left_running(port):
    assert len(HTTP_CASES) + len(WS_HANDSHAKE_CASES) + len(WS_FRAME_CASES) >= 25
    status, _, body = http(port, "POST", "/complete", {"prompt": "Still there?", "max_tokens": 5})
    assert status == 200 and json.loads(body)["text"]
    m = wait_idle(port)
    assert m["generation_threads"] == 0 and metrics(port)["active_generations"] == 0
