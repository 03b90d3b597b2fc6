"""Every incremental parser of the wire layer, fuzzed (hypothesis): on any bytes, the only
exception is the parser's own ProtocolError, with a 4xx/5xx status or a close code; the same
bytes fed whole, byte by byte or in random splits give the same results; nothing grows past its
stated limit. Inputs mix the format's own pieces with random bytes, and stay small, so the suite
stays fast (a few hundred examples each)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streaming.wire import websocket as ws
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import END, ChunkedDecoder, RequestParser, ResponseReader
from streaming.wire.openai import read_chunk
from streaming.wire.session import Closed, Session
from streaming.wire.sse import EventParser
from streaming.wire.stops import StopMatcher

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def stream_of(pieces):
    """Bytes made of the format's own pieces and random bytes, in any order."""
    return st.lists(st.one_of(st.sampled_from(pieces), st.binary(max_size=12)), max_size=14).map(b"".join)


@st.composite
def split(draw, data_strategy):
    """(data, its chunks): whole, byte by byte, or cut at random places."""
    data = draw(data_strategy)
    how = draw(st.sampled_from(["whole", "bytes", "random"]))
    if how == "whole" or not data:
        return data, [data]
    if how == "bytes":
        return data, [data[i : i + 1] for i in range(len(data))]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8))))
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def is_ours(e):
    return isinstance(e, ProtocolError) and (400 <= e.status < 600) and 1000 <= e.close_code < 5000


# --- HTTP requests ------------------------------------------------------------------------------

REQUEST_PIECES = [
    b"GET / HTTP/1.1\r\n",
    b"POST /stream HTTP/1.1\r\n",
    b"GET /x?a=1 HTTP/1.0\r\n",
    b"Host: x\r\n",
    b"Content-Length: 3\r\n",
    b"Content-Length: 3, 3\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b" folded\r\n",
    b"Expect: 100-continue\r\n",
    b"\r\n",
    b"\n",
    b"\r",
    b"abc",
    b":",
]


def requests_of(chunks, max_head=256, max_body=64):
    """What a server reads from these chunks, as the server reads: a request, then a new parser
    fed what followed it; ('error', status) ends it."""
    out, parser = [], RequestParser(max_head, max_body)
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while (r := parser.next_request()) is not None:
                out.append((r.method, r.target, r.version, tuple(sorted(r.headers.items())), r.body))
                rest, parser = parser.trailing, RequestParser(max_head, max_body)
                parser.feed(rest)
            assert len(parser.buffer) <= max_head + 4 + max_body + max(map(len, chunks))
    except ProtocolError as e:
        assert is_ours(e), e
        out.append(("error", e.status))
    return out


@FUZZ
@given(split(stream_of(REQUEST_PIECES)))
def test_the_request_parser_on_any_bytes_in_any_split(case):
    data, chunks = case
    assert requests_of(chunks) == requests_of([data])


# --- HTTP responses (the client side: the upstream relay, client.py) ------------------------------

RESPONSE_PIECES = [
    b"HTTP/1.1 200 OK\r\n",
    b"HTTP/1.1 204 No Content\r\n",
    b"HTTP/1.1 \xb2\xb2\xb2 Bad\r\n",
    b"Content-Length: 4\r\n",
    b"Transfer-Encoding: chunked\r\n",
    b"\r\n",
    b"4\r\n",
    b"0\r\n",
    b"Wiki",
    b"x;ext=1\r\n",
]


def response_of(chunks, eof=True):
    reader, head, body, ended = ResponseReader(), None, b"", False
    try:
        for chunk in [*chunks, None]:
            if chunk is None:
                if eof:
                    reader.feed_eof()
            else:
                reader.feed(chunk)
            while (event := reader.next_event()) is not None:
                if event is END:
                    ended = True
                elif isinstance(event, bytes):
                    body += event
                else:
                    head = (event.status, tuple(sorted(event.headers.items())))
        return head, body, ended, reader.trailing if ended else None
    except ProtocolError as e:
        assert is_ours(e), e
        return head, "error"


@FUZZ
@given(split(stream_of(RESPONSE_PIECES)), st.booleans())
def test_the_response_reader_on_any_bytes_in_any_split(case, eof):
    data, chunks = case
    whole = response_of([data], eof)
    parts = response_of(chunks, eof)
    if whole[1] == "error" or parts[1] == "error":  # an error may come before or after the head, never else
        assert whole[1] == parts[1] == "error"
    else:
        assert parts == whole


CHUNK_PIECES = [b"4\r\n", b"Wiki\r\n", b"0\r\n", b"\r\n", b"a;x=y\r\n", b"0123456789", b"\n", b"Trailer: 1\r\n"]


def chunked_of(chunks):
    d, out = ChunkedDecoder(), b""
    try:
        for chunk in chunks:
            out += d.feed(chunk)
            assert len(d.buffer) <= 4096 + max(map(len, chunks))  # MAX_CHUNK_LINE, or a chunk's data
        return out, d.done, d.trailing
    except ProtocolError as e:
        assert is_ours(e) and e.status == 400, e
        return "error"


@FUZZ
@given(split(stream_of(CHUNK_PIECES)))
def test_the_chunked_decoder_on_any_bytes_in_any_split(case):
    data, chunks = case
    assert chunked_of(chunks) == chunked_of([data])


# --- server-sent events (our clients, and the relay's reader of an upstream) ----------------------

SSE_PIECES = [b"data: x\n", b"data:y\r\n", b"\n", b"\r\n", b"\r", b": ping\n", b"event: e\n", b"id: 1\n", b"retry: 2\n"]
SSE_PIECES += [b"retry: \xc2\xb2\n", b"id: a\x00b\n", b"\xef\xbb\xbf", b"\xe2\x82", b"\xac", b"data"]


def events_of(chunks, max_event=1024 * 1024):
    p, out = EventParser(max_event=max_event), []
    try:
        for chunk in chunks:
            out += [(e.event, e.data, e.id, e.retry) for e in p.feed(chunk)]
            assert p.pending_size <= max_event and p.data_size <= max_event + 1
        return out
    except ProtocolError as e:
        assert is_ours(e) and e.status == 502, e
        return out + ["error"]


@FUZZ
@given(split(stream_of(SSE_PIECES)))
def test_the_event_parser_on_any_bytes_in_any_split(case):
    data, chunks = case
    assert events_of(chunks) == events_of([data])


@FUZZ
@given(split(stream_of([b"data: " + b"x" * 20 + b"\n", b"y" * 30, b"\n\n", b": " + b"z" * 40 + b"\n"])))
def test_the_event_parser_holds_no_line_or_event_past_its_limit(case):
    _, chunks = case
    events_of(chunks, max_event=64)  # the asserts inside: never more held than the limit


@FUZZ
@given(st.text(max_size=80) | st.sampled_from(['{"choices": "x"}', '{"choices": [{"delta": "x"}]}', "[1]", "{}"]))
def test_reading_an_openai_chunk_raises_only_its_own_error(data):
    try:
        chunk = read_chunk(data)
    except ProtocolError as e:
        assert is_ours(e) and e.status == 502
    else:
        assert isinstance(chunk.text, str)


# --- WebSocket frames and the session --------------------------------------------------------------

MASK = b"\x01\x02\x03\x04"
FRAME_PIECES = [
    ws.serialize(ws.Frame(ws.TEXT, b"hello"), MASK),
    ws.serialize(ws.Frame(ws.TEXT, b"hel", fin=False), MASK),
    ws.serialize(ws.Frame(ws.CONT, b"lo"), MASK),
    ws.serialize(ws.Frame(ws.PING, b"p"), MASK),
    ws.serialize(ws.Frame(ws.PONG, b""), MASK),
    ws.serialize(ws.Frame(ws.BINARY, b"\x00\xff"), MASK),
    ws.serialize(ws.Frame(ws.TEXT, "é".encode()[:1]), MASK),
    ws.close_frame(1000, "bye", MASK),
    ws.serialize(ws.Frame(ws.TEXT, b"unmasked")),
    b"\x81\xfe\xff\xff",  # a 64 KiB masked text frame's header, its payload never sent
]


def frames_of(chunks, max_message=256):
    parser, out = ws.Parser(mask_required=True, max_message=max_message), []
    try:
        for chunk in chunks:
            parser.feed(chunk)
            while (item := parser.next()) is not None:
                out.append((type(item).__name__, item.opcode, item.data))
            assert len(parser.fragments) <= max_message
        return out
    except ProtocolError as e:
        assert is_ours(e) and e.close_code in (1002, 1007, 1009), e
        return out + [("error", e.close_code)]


@FUZZ
@given(split(stream_of(FRAME_PIECES)))
def test_the_frame_parser_on_any_bytes_in_any_split(case):
    data, chunks = case
    assert frames_of(chunks) == frames_of([data])


def session_of(chunks):
    s, out, sent = Session(client=False), [], b""
    try:
        for chunk in chunks:
            s.receive_data(chunk)
            while (event := s.next_event()) is not None:
                out.append(event if isinstance(event, Closed) else (type(event).__name__, event.opcode, event.data))
            sent += s.data_to_send()
        s.receive_eof()
        while (event := s.next_event()) is not None:
            out.append(event)
        return out, sent
    except ProtocolError as e:
        assert is_ours(e) and e.close_code in (1002, 1007, 1009), e
        return out + [("error", e.close_code)], sent + s.data_to_send()


@FUZZ
@given(split(stream_of(FRAME_PIECES)))
def test_the_session_answers_the_same_whatever_the_split(case):
    data, chunks = case
    (events, sent), (events_whole, sent_whole) = session_of(chunks), session_of([data])
    assert events == events_whole and sent == sent_whole  # the same pongs and close echoes


@pytest.mark.parametrize("n", [1, 2, 64, 1000])
def test_a_huge_line_is_scanned_once(n):
    """A 30 MB line with no newline cost 14.7 s of CPU before (each feed re-scanned all that was
    pending); now each byte is looked at once, and the limit ends it at 1 MiB."""
    p = EventParser()
    with pytest.raises(ProtocolError):
        for _ in range(2 * 1024 * 1024 // (64 * 1024) * n):
            p.feed(b"x" * (64 * 1024 // n))
    assert p.pending_size <= 1024 * 1024


# --- stop strings -------------------------------------------------------------------------------


def reference_stops(stops, pieces):
    """What StopMatcher must send, found the plain way: each stop string's every length tried at
    every piece (the matcher's code before its automaton); a None among the pieces is a flush
    (before a tool call, mid-answer), after which the text starts anew."""
    held, out = "", []
    for piece in pieces:
        if piece is None:
            out.append(held)
            held = ""
            continue
        text = held + piece
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            at, matched = min(hits)
            return out + [text[:at]], matched
        keep = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        held = text[len(text) - keep :] if keep else ""
        out.append(text[: len(text) - keep])
    return out + [held], None


ALPHABET = st.text(alphabet="abc", min_size=1, max_size=6)  # few letters: stop strings overlap and repeat
PIECES = st.lists(st.one_of(st.text(alphabet="abcd", max_size=5), st.none()), max_size=12)


@FUZZ
@given(st.lists(ALPHABET, min_size=1, max_size=4), PIECES)
def test_stop_strings_are_held_and_matched_as_the_plain_way_does(stops, pieces):
    m = StopMatcher(stops)
    got = [m.flush() if p is None else m.push(p) for p in pieces]
    got.append(m.flush())
    want, matched = reference_stops(stops, pieces)
    assert m.matched == matched
    assert "".join(got) == "".join(want) and got[: len(want) - 1] == want[:-1]
