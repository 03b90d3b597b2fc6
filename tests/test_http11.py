"""The HTTP/1.1 request parser without sockets: whole, byte by byte, with trailing data, errors."""

import pytest

from streaming.wire.errors import ProtocolError, error_body
from streaming.wire.http11 import (
    END,
    MAX_BODY,
    MAX_HEAD,
    MAX_INTERIM,
    ChunkedDecoder,
    RequestParser,
    ResponseReader,
    json_response,
    parse_head,
    response,
)

REQUEST = (
    b"POST /stream?x=1&y=two HTTP/1.1\r\nHost: 127.0.0.1:8765\r\nContent-Type: application/json\r\n"
    b"X-Many: a\r\nx-many: b\r\nContent-Length: 13\r\n\r\n"
) + b'{"prompt":"a"}'[:13]


def parse_all(data, step=None):
    p = RequestParser()
    if step is None:
        p.feed(data)
        return p.next_request(), p
    request = None
    for i in range(0, len(data), step):
        assert request is None, "a request came out before all its bytes were fed"
        p.feed(data[i : i + step])
        request = p.next_request()
    return request, p


@pytest.mark.parametrize("step", [None, 1, 2, 7])
def test_whole_and_byte_by_byte(step):
    r, p = parse_all(REQUEST, step)
    assert (r.method, r.path, r.version) == ("POST", "/stream", "HTTP/1.1")
    assert r.query == {"x": "1", "y": "two"}
    assert r.headers["host"] == "127.0.0.1:8765"
    assert r.headers["x-many"] == "a, b"  # repeated fields joined, names case-insensitive
    assert r.body == b'{"prompt":"a"'
    assert p.trailing == b""


def test_trailing_data_is_kept_for_the_next_reader():
    r, p = parse_all(REQUEST + b"\x81\x85extra")
    assert r.body == b'{"prompt":"a"' and p.trailing == b"\x81\x85extra"


def test_need_more_data_until_the_body_is_complete():
    p = RequestParser()
    p.feed(REQUEST[:-1])
    assert p.next_request() is None
    p.feed(REQUEST[-1:])
    assert p.next_request().body == b'{"prompt":"a"'


def test_bare_lf_line_ends_are_accepted():
    r, _ = parse_all(b"GET /log HTTP/1.1\nHost: x\n\n")
    assert r.path == "/log" and r.headers == {"host": "x"}


def test_expect_continue_is_visible_before_the_body():
    p = RequestParser()
    p.feed(b"POST /complete HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert p.next_request() is None and p.expects_continue()


def test_an_http_1_0_clients_expect_continue_is_ignored():
    """RFC 9110 §10.1.1: a server MUST ignore a 100-continue expectation in an HTTP/1.0 request
    (such a client takes any status line for the final one)."""
    p = RequestParser()
    p.feed(b"POST /complete HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert p.next_request() is None and not p.expects_continue()


BAD = [
    (b"HELLO\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTX/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /log HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET http://x/log HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /log HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400),
    (b"GET /log HTTP/1.1\r\nHost : x\r\n\r\n", 400),
    (b"GET /log HTTP/1.1\r\nHost: x\r\nA: b\r\n  folded\r\n\r\n", 400),
    (b"GET /log HTTP/1.1\r\nHost: x\r\nA: b\x01c\r\n\r\n", 400),
    (b"POST /complete HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
    (b"POST /complete HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
    (b"POST /complete HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
    (b"POST /complete HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
    (b"POST /complete HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY + 1), 413),
    (b"GET /log HTTP/1.1\r\nHost: x\r\nX: " + b"a" * MAX_HEAD + b"\r\n\r\n", 431),
]


@pytest.mark.parametrize("data,status", BAD)
def test_bad_requests_carry_their_status(data, status):
    for step in (None, 1):
        with pytest.raises(ProtocolError) as e:
            r, _ = parse_all(data, step)
            assert r is not None
        assert e.value.status == status


def test_an_unfinished_head_over_the_limit_is_431_without_waiting_for_its_end():
    p = RequestParser()
    p.feed(b"GET /log HTTP/1.1\r\nX: " + b"a" * MAX_HEAD)
    with pytest.raises(ProtocolError) as e:
        p.next_request()
    assert e.value.status == 431


def test_json_body_errors():
    r = parse_head(b"POST /complete HTTP/1.1\r\nHost: x")
    for body in (b"{", b"[1]", b"\xff\xfe"):
        r.body = body
        with pytest.raises(ProtocolError) as e:
            r.json()
        assert e.value.status == 400


def test_responses_close_and_errors_are_json():
    assert response(200, b"{}").startswith(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
    )
    err = ProtocolError("no", 405, headers=[("Allow", "GET")])
    out = json_response(err.status, error_body(err), err.headers)  # what Connection.fail writes
    head, body = out.split(b"\r\n\r\n")
    assert b"405 Method Not Allowed" in head and b"Allow: GET" in head and b"Connection: close" in head
    assert body == b'{"error": {"status": 405, "type": "method_not_allowed", "message": "no"}}'


# --- chunked response bodies (what nginx sends an HTTP/1.1 client) ----------------------------

CHUNKED = b"4\r\nWiki\r\n5;ext=1\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\n"
DECODED = b"Wikipedia in\r\n\r\nchunks."


def test_chunked_whole_byte_by_byte_and_with_trailing_data():
    d = ChunkedDecoder()
    assert d.feed(CHUNKED + b"NEXT") == DECODED and d.done and d.trailing == b"NEXT"
    d = ChunkedDecoder()
    out = b"".join(d.feed(CHUNKED[i : i + 1]) for i in range(len(CHUNKED)))
    assert out == DECODED and d.done and d.trailing == b""
    assert d.feed(b"more") == b"" and d.trailing == b"more"


def test_chunked_not_done_until_the_last_chunk_and_bare_lf_accepted():
    d = ChunkedDecoder()
    assert d.feed(b"3\nabc\n") == b"abc" and not d.done
    assert d.feed(b"0\n") == b"" and not d.done
    assert d.feed(b"\n") == b"" and d.done


@pytest.mark.parametrize("bad", [b"zz\r\n", b"-1\r\n", b"\r\n", b"3\r\nabcd\r\n", b"1" * 16 + b"\r\n", b"9" * 5000])
def test_chunked_malformed(bad):
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(bad)


def test_interim_responses_are_read_past_to_the_final_one():
    """RFC 9110 §15.2: a client MUST read past a 1xx it did not expect (100 Continue, 103 Early
    Hints); it was taken for the final response, its body empty, the real head left unread.
    A 101 is final (the WebSocket's); endless 1xx are a hostile peer's."""
    r = ResponseReader()
    r.feed(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n")
    assert r.next_event() is None
    r.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi")
    head = r.next_event()
    assert head.status == 200 and "link" not in head.headers and r.next_event() == b"hi" and r.next_event() is END
    r = ResponseReader()
    r.feed(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\nframes")
    assert r.next_event().status == 101 and r.next_event() is END and r.trailing == b"frames"
    r = ResponseReader()
    r.feed(b"HTTP/1.1 100 Continue\r\n\r\n" * (MAX_INTERIM + 1))
    with pytest.raises(ProtocolError):
        r.next_event()
