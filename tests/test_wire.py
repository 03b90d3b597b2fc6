"""The wire layer without sockets: it imports neither torch nor asyncio; the response reader and
the WebSocket session, each fed whole, byte by byte, and with trailing data."""

import subprocess
import sys

import pytest
from helpers import ROOT

from streaming.wire import websocket as ws
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import END, Response, ResponseReader
from streaming.wire.session import ABNORMAL, Closed, Session


def test_importing_the_wire_layer_imports_no_torch_and_no_asyncio():
    modules = "http11, sse, websocket, session, params, apis, openai, anthropic, stops, errors"
    code = f"import sys; from streaming.wire import {modules}; print('torch' in sys.modules, 'asyncio' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


# --- ResponseReader ----------------------------------------------------------------------------


def read(raw, step=None, eof=True):
    """Feed `raw` whole or `step` bytes at a time; return (head, body, trailing)."""
    r, head, body = ResponseReader(), None, b""
    pieces = [raw] if step is None else [raw[i : i + step] for i in range(0, len(raw), step)]
    ended = False
    for k, piece in enumerate(pieces + [None]):
        if piece is None:
            if not eof:
                break
            r.feed_eof()
        else:
            r.feed(piece)
        while (event := r.next_event()) is not None:
            if isinstance(event, Response):
                head = event
            elif event is END:
                ended = True
                break
            else:
                body += event
        if ended and k < len(pieces):
            for rest in pieces[k + 1 :]:
                r.feed(rest)
            break
    return head, body if ended else None, r.trailing


LENGTH = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 13\r\n\r\n" + b'{"text":"hi"}'
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWiki\r\n5\r\npedia\r\n0\r\n\r\n"
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: a\n\ndata: b\n\n"


@pytest.mark.parametrize("step", [None, 1, 7])
@pytest.mark.parametrize(
    "raw,body",
    [(LENGTH, b'{"text":"hi"}'), (CHUNKED, b"Wikipedia"), (UNTIL_CLOSE, b"data: a\n\ndata: b\n\n")],
    ids=["content-length", "chunked", "until-close"],
)
def test_response_reader_whole_and_byte_by_byte(raw, body, step):
    head, got, trailing = read(raw, step)
    assert head.status == 200 and got == body and trailing == b""


@pytest.mark.parametrize("raw", [LENGTH, CHUNKED], ids=["content-length", "chunked"])
def test_response_reader_keeps_trailing_data_and_ends_without_eof(raw):
    head, body, trailing = read(raw + b"NEXT", eof=False)
    assert head.status == 200 and body is not None and trailing == b"NEXT"
    head, body, trailing = read(raw + b"NEXT", step=1, eof=False)
    assert body is not None and trailing == b"NEXT"


def test_response_reader_101_has_no_body_and_the_frames_follow():
    raw = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    head, body, trailing = read(raw + b"\x81\x02hi", eof=False)
    assert head.status == 101 and head.headers["upgrade"] == "websocket" and body == b"" and trailing == b"\x81\x02hi"


def test_response_reader_joins_repeated_headers_and_accepts_bare_lf():
    head, body, _ = read(b"HTTP/1.1 204 No Content\nA: 1\nA: 2\n\n")
    assert head.status == 204 and head.headers["a"] == "1, 2" and body == b""


@pytest.mark.parametrize(
    "raw",
    [b"", b"HTTP/1.1 200 OK\r\n", b"garbage\r\n\r\n", b"HTTP/1.1 2x0 OK\r\n\r\n", LENGTH[:-3], CHUNKED[:-7]],
    ids=["nothing", "head cut", "no status line", "bad status", "body cut", "chunks cut"],
)
def test_response_reader_malformed_or_cut_short(raw):
    with pytest.raises(ProtocolError):
        read(raw)


# --- Session -----------------------------------------------------------------------------------

MASK = b"\x01\x02\x03\x04"


def client_frames(*frames):
    return b"".join(ws.serialize(f, MASK) for f in frames)


def events_of(session, data, step=None):
    pieces = [data] if step is None else [data[i : i + step] for i in range(0, len(data), step)]
    out = []
    for piece in pieces:
        session.receive_data(piece)
        while (event := session.next_event()) is not None:
            out.append(event)
    return out


@pytest.mark.parametrize("step", [None, 1, 5])
def test_session_answers_pings_echoes_the_close_and_reassembles(step):
    data = client_frames(
        ws.Frame(ws.TEXT, b'{"prompt": ', fin=False),
        ws.Frame(ws.PING, b"are you there"),
        ws.Frame(ws.CONT, b'"hi"}'),
        ws.Frame(ws.CLOSE, ws.close_payload(1001, "bye")),
        ws.Frame(ws.TEXT, b"after the close"),
    )
    s = Session(client=False)
    events = events_of(s, data, step)
    assert events[0] == ws.Frame(ws.PING, b"are you there")
    assert events[1] == ws.Message(ws.TEXT, b'{"prompt": "hi"}')
    assert events[2] == Closed(1001, "bye") and len(events) == 3  # nothing after the close
    out = ws.Parser(mask_required=False)
    out.feed(s.data_to_send())
    assert out.next() == ws.Frame(ws.PONG, b"are you there")  # §5.5.3: the same payload
    assert out.next() == ws.Frame(ws.CLOSE, ws.close_payload(1001))  # §5.5.1: the code echoed
    assert out.next() is None and s.data_to_send() == b""
    assert not s.send_text("too late")  # our close is sent: nothing after it


def test_session_after_our_close_neither_echoes_nor_answers_a_ping_and_eof_is_abnormal():
    s = Session(client=False)
    s.close(1000)
    ours = s.data_to_send()
    assert ours == ws.close_frame(1000)
    pinged = client_frames(ws.Frame(ws.PING, b"late"), ws.Frame(ws.CLOSE, ws.close_payload(1000)))
    assert events_of(s, pinged) == [ws.Frame(ws.PING, b"late"), Closed(1000, "")]
    assert s.data_to_send() == b""  # no pong after our close (it sent one), and no second close
    t = Session(client=False)
    t.receive_eof()
    assert t.next_event() == Closed(ABNORMAL) and t.next_event() is None


def test_a_client_session_masks_every_frame_with_a_fresh_key_and_refuses_masked_ones():
    c = Session(client=True)
    c.send_text("hello")
    c.send_ping(b"x")
    server = Session(client=False)  # requires masks: parses what the client sent
    server.receive_data(c.data_to_send())
    assert server.next_event() == ws.Message(ws.TEXT, b"hello")
    assert server.next_event() == ws.Frame(ws.PING, b"x")
    c.receive_data(client_frames(ws.Frame(ws.TEXT, b"masked")))
    with pytest.raises(ProtocolError) as e:
        c.next_event()
    assert e.value.close_code == 1002


def test_session_a_close_without_a_code_is_echoed_empty():
    s = Session(client=False)
    assert events_of(s, client_frames(ws.Frame(ws.CLOSE))) == [Closed(1005, "")]
    assert s.data_to_send() == ws.serialize(ws.Frame(ws.CLOSE))
