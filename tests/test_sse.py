"""SSE: the encoder, and the WHATWG event-stream parser fed whole and byte by byte."""

import pytest

from streaming.wire.sse import Event, EventParser, comment, event


def parse(data, step=None):
    p = EventParser()
    if step is None:
        return p.feed(data)
    out = []
    for i in range(0, len(data), step):
        out += p.feed(data[i : i + step])
    return out


STEPS = [None, 1, 3]


def test_encoder():
    assert event('{"text": "Two"}') == b'data: {"text": "Two"}\n\n'  # the article's 23 bytes
    assert len(event('{"text": "Two"}')) == 23
    assert event("a\nb", event="error", id="7") == b"event: error\nid: 7\ndata: a\ndata: b\n\n"
    assert comment() == b": ping\n\n"


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_line_ends_lf_crlf_cr(step, end):
    data = b"data: one" + end + end + b"data: two" + end + end
    assert [e.data for e in parse(data, step)] == ["one", "two"]


@pytest.mark.parametrize("step", STEPS)
def test_several_data_lines_are_joined_with_newlines(step):
    assert parse(b"data: a\ndata:b\ndata\n\n", step) == [Event("a\nb\n")]


@pytest.mark.parametrize("step", STEPS)
def test_event_id_retry_and_comments(step):
    data = b": ping\n\nevent: error\nid: 42\nretry: 1500\ndata: {}\n\ndata: x\n\n"
    assert parse(data, step) == [Event("{}", "error", "42", 1500), Event("x", "message", "42", 1500)]


@pytest.mark.parametrize("step", STEPS)
def test_fields_without_a_space_unknown_fields_and_empty_events(step):
    data = b"data:no space\nfoo: bar\n\n\n\nevent: only-a-type\n\ndata:  two spaces\n\n"
    assert [(e.data, e.event) for e in parse(data, step)] == [("no space", "message"), (" two spaces", "message")]


@pytest.mark.parametrize("step", STEPS)
def test_a_final_event_without_a_blank_line_is_discarded(step):
    p = EventParser()
    assert [e.data for e in parse(b"data: whole\n\ndata: cut", step)] == ["whole"]
    p.feed(b"data: cut\n")
    p.close()
    assert p.feed(b"\n") == []


@pytest.mark.parametrize("step", STEPS)
def test_utf8_split_across_chunks_and_bom(step):
    data = "\ufeffdata: 🦜 parrot\n\n".encode()
    assert [e.data for e in parse(data, step)] == ["🦜 parrot"]


def test_cr_at_the_end_of_one_chunk_and_lf_at_the_start_of_the_next_is_one_line_end():
    p = EventParser()
    assert p.feed(b"data: a\r") == []
    assert p.feed(b"\n\r\n") == [Event("a")]


def test_a_crlf_split_across_chunks_then_a_blank_line():
    """A chunk that is just the LF of a CRLF, then the blank line: one event, not one merged into
    the next (the LF after a CR was dropped twice before)."""
    p = EventParser()
    got = p.feed(b"data: x\r") + p.feed(b"\n") + p.feed(b"\n") + p.feed(b"data: y\n\n")
    assert [e.data for e in got] == ["x", "y"]
    p = EventParser()
    got = p.feed(b"data: x\r") + p.feed(b"\xe2") + p.feed(b"\x82\xac\n\n")  # an empty decode keeps the CR's state
    assert [e.data for e in got] == ["x"] and p.pending == []
