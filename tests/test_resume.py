"""Resumable streams: GET /stream, event ids, Last-Event-ID, the grace period, POST /stop, 204."""

import json
import time

import pytest
from helpers import connect, events, http, metrics, raw_request, read_all, server_log, split_response, wait_for_log

from streaming.server.resumable.recordings import Recordings, parse_event_id

PROMPT = "The lighthouse keeper wrote in his log"
QUERY = "/stream?prompt=The%20lighthouse%20keeper%20wrote%20in%20his%20log&max_tokens=40&seed=3&ignore_eos=true"


def get(port, target, headers=()):
    head = f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers)
    return raw_request(port, head.encode() + b"\r\n")


def complete_text(port, n=40, seed=3):
    status, _, body = http(
        port, "POST", "/complete", {"prompt": PROMPT, "max_tokens": n, "seed": seed, "ignore_eos": True}
    )
    assert status == 200
    return json.loads(body)["text"]


def read_events(sock, n):
    """Read from a socket until n events have arrived; return them (and the raw bytes)."""
    raw = b""
    while len(events(raw.partition(b"\r\n\r\n")[2])) < n:
        data = sock.recv(65536)
        assert data, "the stream ended early"
        raw += data
    return events(raw.partition(b"\r\n\r\n")[2]), raw


def texts(evs):
    return "".join(json.loads(e.data)["text"] for e in evs if e.event == "message" and e.data != "[DONE]")


def test_event_ids_parse_and_store_bounds():
    assert parse_event_id("abc.12") == ("abc", 12)
    assert parse_event_id("a.b.3") == ("a.b", 3)
    for bad in ("", "abc", ".3", "abc.", "abc.x", "abc.-1", "abc.1234567890"):
        assert parse_event_id(bad) is None

    class FakeJob:
        stop = None

    async def run():
        store = Recordings(count=2, seconds=10)
        recs = [store.create(FakeJob()) for _ in range(4)]
        for rec in recs:
            rec.add('{"text": "a"}')
            rec.add("[DONE]")
        recs[0].end(), recs[1].end(), recs[2].end()
        assert store.find(f"{recs[3].id}.0") == (recs[3], 0)  # live: kept whatever the count
        assert store.find(f"{recs[3].id}.2") is None  # an id never issued
        assert store.find(f"{recs[0].id}.0") is None  # the oldest ended one went past the count
        assert store.find(f"{recs[2].id}.0") == (recs[2], 0)
        assert store.find(f"{recs[2].id}.1") is None  # its last event: nothing follows
        store.purge(now=time.monotonic() + 11)
        assert store.find(f"{recs[2].id}.0") is None and recs[3].id in store  # expired

    import asyncio

    asyncio.run(run())


def test_a_view_taken_over_after_its_last_reader_left_stops_after_the_grace():
    """The reader of a view can leave while the view is being taken over (Redis round trips, an
    upstream opened): detach() then found no job to stop. adopt() starts the grace period itself,
    so that generation stops as if the reader had left the stream it generates; a reader still
    there, or a background stream, keeps it going."""
    import asyncio
    import threading

    from streaming.server.resumable.recordings import Recording

    class FakeJob:
        def __init__(self):
            self.stop, self.orphaned = threading.Event(), False

    async def run(readers, background=False):
        rec = Recording("s", None)
        rec.readers, rec.background = readers, background
        job = FakeJob()
        rec.adopt(job, 0.05)
        await asyncio.sleep(0.2)
        return job.orphaned, job.stop.is_set()

    assert asyncio.run(run(0)) == (True, True)
    assert asyncio.run(run(1)) == (False, False)
    assert asyncio.run(run(0, background=True)) == (True, False)


def test_ended_streams_are_kept_within_a_size_too():
    """Ended streams are kept by count and age, and by the bytes their events hold (256 answers of
    4,096 tokens, kept 300 s, were ~350 MB): past `size`, the oldest ended ones go first; a live
    one stays whatever it holds."""
    import asyncio

    from streaming.server.resumable.recordings import EVENT_OVERHEAD

    class FakeJob:
        stop = None

    async def run():
        store = Recordings(count=10, seconds=100, size=3 * (1000 + EVENT_OVERHEAD))
        recs = [store.create(FakeJob()) for _ in range(5)]
        for rec in recs:
            rec.append(b"x" * 1000)
        for rec in recs[:4]:
            rec.end()
        store.purge()
        return [rec.id in store for rec in recs]

    assert asyncio.run(run()) == [False, True, True, True, True]


def test_abandoned_streams_past_the_bound_stop_oldest_first_but_never_a_background_one():
    """Past `orphans` live streams that nobody reads, the oldest stop now; a background response
    (OpenAI's background mode) is not among them: it goes on to its end, read or not (16 dropped
    EventSource readers of anyone's cancelled it before)."""
    import threading

    class FakeJob:
        def __init__(self):
            self.stop, self.orphaned = threading.Event(), False

    store = Recordings(orphans=2)
    recs = [store.create(FakeJob()) for _ in range(4)]
    recs[0].background = True
    store.limit_orphans()
    assert [r.job.stop.is_set() for r in recs] == [False, True, False, False]


def test_get_stream_is_the_same_answer_with_ids_and_a_retry(servers):
    port = servers["resuming"].port
    status, headers, body = get(port, QUERY)
    assert status == 200 and headers["content-type"] == "text/event-stream"
    assert body.startswith(b"retry: 1000\nevent: stream\n")  # in event 0's block: no empty event before it
    evs = events(body)
    assert evs[0].retry == 1000
    assert evs[0].event == "stream" and json.loads(evs[0].data)["id"] == evs[0].id.split(".")[0]
    stream = evs[0].id.split(".")[0]
    assert [e.id for e in evs] == [f"{stream}.{k}" for k in range(len(evs))]  # every event carries its number
    assert evs[-1].data == "[DONE]"
    assert texts(evs) == complete_text(port)


def test_post_stream_stays_the_articles_without_ids(servers):
    status, _, body = http(servers["resuming"].port, "POST", "/stream", {"prompt": PROMPT, "max_tokens": 5})
    assert status == 200 and b"id:" not in body and b"retry:" not in body and body.startswith(b"data: ")


def test_a_reader_who_drops_resumes_with_last_event_id_and_nothing_is_generated_twice(servers):
    drop_and_resume(servers["resuming"].port)


def drop_and_resume(port):
    """A reader drops after 10 pieces and resumes: the rest follows, one generation in all (also
    with --engine process: test_process.py)."""
    before = len(server_log(port))
    s = connect(port)
    s.sendall(f"GET {QUERY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    first, _ = read_events(s, 11)  # the stream's name and 10 pieces
    s.close()  # the network blinks
    time.sleep(0.3)
    last = first[10].id
    status, _, body = get(port, "/stream?prompt=ignored", [("Last-Event-ID", last)])
    rest = events(body)
    assert status == 200 and rest[0].id == f"{last.split('.')[0]}.11" and rest[-1].data == "[DONE]"
    log = wait_for_log(port, before + 1)[before:]
    assert texts(first[:11]) + texts(rest) == complete_text(port)
    assert log[0] == ["/stream", 40, False]  # one generation, all 40 tokens, not stopped


def test_resume_with_the_query_parameter_and_with_post(servers):
    port = servers["resuming"].port
    _, _, body = get(port, QUERY)
    evs = events(body)
    k = evs[5].id
    _, _, again = get(port, f"/stream?last_event_id={k}")
    assert texts(events(again)) == texts(evs[6:])
    status, _, posted = http(port, "POST", "/stream", {"prompt": "x"}, headers=[("Last-Event-ID", k)])
    assert status == 200 and texts(events(posted)) == texts(evs[6:])


@pytest.mark.parametrize("last", ["nope.3", "garbage", "", "AAAAAAAAAAAA.0"])
def test_an_unknown_id_gets_204_and_starts_nothing(servers, last):
    port = servers["resuming"].port
    before = len(server_log(port))
    status, headers, body = get(port, QUERY, [("Last-Event-ID", last)])
    assert status == 204 and body == b"" and "content-length" not in headers
    time.sleep(0.2)
    assert len(server_log(port)) == before and metrics(port)["active_generations"] == 0


def test_a_finished_or_expired_stream_gets_204(servers):
    port = servers["resuming"].port
    _, _, body = get(port, QUERY)
    evs = events(body)
    assert get(port, QUERY, [("Last-Event-ID", evs[-1].id)])[0] == 204  # it had everything
    assert get(port, QUERY, [("Last-Event-ID", evs[-2].id)])[0] == 200
    time.sleep(2.5)  # --resume-keep 2
    assert get(port, QUERY, [("Last-Event-ID", evs[3].id)])[0] == 204


def test_nobody_coming_back_stops_generation_after_the_grace_period(servers):
    port = servers["resuming"].port
    before = len(server_log(port))
    s = connect(port)
    s.sendall(b"GET /stream?prompt=Hello&max_tokens=4000&ignore_eos=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    read_events(s, 6)
    s.close()
    t0 = time.monotonic()
    path, produced, left = wait_for_log(port, before + 1)[before]
    waited = time.monotonic() - t0
    assert path == "/stream" and left and produced < 4000
    assert 0.8 <= waited < 5, waited  # --resume-grace 1: it went on a second for a reader to come back


def test_post_stop_stops_a_resumable_stream_at_once(servers):
    port = servers["resuming"].port
    before, m0 = len(server_log(port)), metrics(port)
    s = connect(port)
    s.sendall(b"GET /stream?prompt=Hello&max_tokens=4000&ignore_eos=true HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    evs, _ = read_events(s, 6)
    stream = json.loads(evs[0].data)["id"]
    status, _, body = http(port, "POST", "/stop", {"id": stream})
    assert status == 200 and json.loads(body) == {"id": stream, "stopped": True}
    rest = read_all(s)
    s.close()
    assert rest.rstrip().endswith(b"data: [DONE]")
    path, produced, left = wait_for_log(port, before + 1)[before]
    assert left and produced < 200
    m1 = metrics(port)
    assert m1["requests_stopped"] - m0["requests_stopped"] == 1
    assert m1["tokens_after_stop"] - m0["tokens_after_stop"] <= 1  # at most the token being computed
    assert http(port, "POST", "/stop", {"id": "nope"})[0] == 404
    assert http(port, "POST", "/stop", {"id": 3})[0] == 404


def test_two_readers_of_one_stream_both_get_it_all(servers):
    port = servers["resuming"].port
    s = connect(port)
    s.sendall(f"GET {QUERY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    evs, _ = read_events(s, 3)
    _, _, other = get(port, "/stream", [("Last-Event-ID", evs[0].id)])
    mine = events(split_response(b"HTTP/1.1 200 OK\r\n\r\n" + read_all(s))[2])
    s.close()
    assert texts(events(other)) == complete_text(port)
    assert mine or evs


def test_the_page_is_served_whole_with_nothing_from_elsewhere(servers):
    status, headers, body = get(servers["plain"].port, "/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b"EventSource" in body and b"AbortController" in body and b"new WebSocket" in body
    assert b"<script src" not in body and b"<link" not in body and b"https://" not in body  # no CDN


@pytest.mark.parametrize(
    "target, status",
    [("/stream", 400), ("/stream?prompt=", 422), ("/stream?prompt=a&max_tokens=abc", 422),
     ("/stream?prompt=a&max_tokens=5000", 422), ("/stream?prompt=a&ignore_eos=maybe", 422)],
)  # fmt: skip
def test_get_stream_checks_its_query_like_a_body(servers, target, status):
    got, _, body = get(servers["plain"].port, target)
    assert got == status and json.loads(body)["error"]["status"] == status


def test_405_names_both_methods_of_stream(servers):
    status, headers, _ = http(servers["plain"].port, "PUT", "/stream", {})
    assert status == 405 and headers["allow"] == "POST, GET"
