"""The Redis store under faults, over real processes: Redis paused (SIGSTOP) mid-stream and
resumed, restarted empty, and a stream's entries trimmed under it; and inputs that reach the store
or int() (a stream id that is not one of ours, an event number in other digits). Each case ends
with the streams whole, or with an error the reader is told, and the server using no CPU for a
stream it cannot serve."""

import contextlib
import json
import os
import signal
import socket
import time

import pytest
import redis
from helpers import ServerProcess, http, raw_request

from streaming import reader, redisctl
from streaming.replicas import in_thread, noting, query, when
from streaming.server.resumable.recordings import Recording
from streaming.server.resumable.store import Gap
from streaming.server.resumable.takeover import fill

REQUIRED = os.environ.get("REQUIRE_REDIS") == "1"  # .ci/run sets it
if not REQUIRED and not redisctl.available():
    pytest.skip("needs redis-server (apt-get install redis-server)", allow_module_level=True)

ARGS = ("--token-delay", "0.03", "--resume-grace", "3")


@contextlib.contextmanager
def a_stream_on_a(max_tokens):
    """Redis, replicas a and b on it, and a reader of a stream on a, 12 events in: (the Redis,
    a, b, the stream's id, the reader's thread)."""
    with (
        redisctl.Redis() as r,
        ServerProcess("--store", r.url, *ARGS) as a,
        ServerProcess("--store", r.url, *ARGS) as b,
    ):
        a.wait(), b.wait()
        ids = []
        t, _ = in_thread(reader.read, a.port, query(max_tokens), on_event=noting(ids))
        assert when(lambda: len(ids) >= 12, 30)
        yield r, a, b, ids[0], t


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_gap_in_the_entries_is_an_error_not_a_hole():
    rec = Recording("S", None)
    with pytest.raises(Gap):
        fill(rec, [(b"0-1", {b"e": b"id: S.0\n\n"}), (b"0-3", {b"e": b"id: S.2\n\n"})])
    assert rec.events == [b"id: S.0\n\n"]
    with pytest.raises(Gap):  # not an id of ours
        fill(Recording("S", None), [(b"1700000000000-0", {b"e": b"x"})])
    with pytest.raises(Gap):  # token ids that are not ids
        fill(Recording("S", None), [(b"0-1", {b"e": b"x", b"t": "١".encode()})])


def test_a_redis_paused_mid_stream_ends_no_live_stream():
    """SIGSTOP Redis under 8 readers, SIGCONT 4 s later (past a command's 2 s timeout and a 3 s
    lease): every stream ends with [DONE], whole, and
    the replica never takes its own late writes for a rival's (before: 0 of 8 got [DONE])."""
    with redisctl.Redis() as r, ServerProcess("--store", r.url, *ARGS) as s:
        s.wait()
        readers = [in_thread(reader.read, s.port, query(120, seed=i)) for i in range(8)]
        time.sleep(1.5)
        r.proc.proc.send_signal(signal.SIGSTOP)
        time.sleep(4)
        r.proc.proc.send_signal(signal.SIGCONT)
        for t, _ in readers:
            t.join(90)
        got = [out[0] for _, out in readers]
        assert [g.ended for g in got] == ["done"] * 8, [g.ended for g in got]
        assert all(g.numbers == list(range(len(g.events))) and g.lost == g.repeated == 0 for g in got)
        assert not any("took it over" in line or "went to another replica" in line for line in s.lines), s.lines
        db = redis.Redis.from_url(r.url)
        for g in got:  # and Redis holds each whole, with its end (the mirror may still be catching up)
            assert when(lambda g=g: len(db.xrange(f"streaming:s:{g.stream}")) == len(g.events), 10)
            assert b"x" in db.xrange(f"streaming:s:{g.stream}")[-1][1]


def test_a_redis_restarted_empty_mid_stream_gets_the_stream_again():
    with redisctl.Redis() as first, ServerProcess("--store", first.url, *ARGS) as s:
        s.wait()
        ids = []
        t, out = in_thread(reader.read, s.port, query(200), on_event=noting(ids))
        assert when(lambda: len(ids) >= 20, 30)
        port = first.port
        first.stop()
        with redisctl.Redis(port=port) as second:  # the same address, nothing in it
            t.join(60)
            got = out[0]
            assert got.ended == "done" and got.numbers == list(range(len(got.events)))
            db = redis.Redis.from_url(second.url)
            assert when(lambda: len(db.xrange(f"streaming:s:{got.stream}")) == len(got.events), 10)


def test_a_stream_trimmed_under_a_resume_is_a_503_and_no_busy_loop():
    """Redis lost a stream's first entries (XTRIM): a resume on another replica said 200, sent
    nothing, never ended, and ran a core at 95% before; now it is told (503 store_unavailable)."""
    with a_stream_on_a(200) as (r, _, b, stream, t):
        redis.Redis.from_url(r.url).xtrim(f"streaming:s:{stream}", minid="0-6", approximate=False)
        before = cpu_seconds(b.proc.pid)
        head = f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: {stream}.8\r\n\r\n".encode()
        status, headers, body = raw_request(b.port, head)
        assert (
            status == 503 and json.loads(body)["error"]["type"] == "store_unavailable" and "lost part" in body.decode()
        )
        time.sleep(2)
        assert cpu_seconds(b.proc.pid) - before < 0.5  # nothing spins
        t.join(60)


def test_a_reader_following_another_replicas_stream_is_let_go_when_redis_stays_away():
    """A resume on replica b of a stream generated on a makes a view that follows Redis. With
    Redis stopped, the view had nothing to send and kept the reader with pings for as long as
    the outage lasted; now its connection ends after takeover.OUTAGE (10 s) without an end, so
    the reader comes back with its last id (to a clear 503 while Redis is away)."""
    with a_stream_on_a(2000) as (r, a, b, stream, t):
        head = f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: {stream}.5\r\n\r\n".encode()
        with socket.create_connection(("127.0.0.1", b.port), timeout=45) as s:
            s.sendall(head)
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
            r.proc.proc.send_signal(signal.SIGSTOP)
            try:
                stopped, deadline = time.monotonic(), time.monotonic() + 40
                while time.monotonic() < deadline and s.recv(65536):  # events it had, then pings
                    pass
                ended = time.monotonic() - stopped
            finally:
                r.proc.proc.send_signal(signal.SIGCONT)
        assert ended < 25, ended
        assert http(a.port, "POST", "/stop", {"id": stream})[0] == 200  # (its reader there ends now)
        t.join(60)


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_ids_that_are_not_ours_are_unknown_never_a_500(store):
    with redisctl.Redis() as r, ServerProcess("--store", "memory" if store == "memory" else r.url) as s:
        s.wait()
        for last in ("x.\u00b2", "S.1\u00b9", "\ud800.1", "a" * 200 + ".1"):
            head = f"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nLast-Event-ID: {last}\r\n\r\n".encode(
                "utf-8", "surrogatepass"
            )
            status, _, _ = raw_request(s.port, head)
            assert status == 204, (last, status)
        status, _, _ = raw_request(s.port, b"GET /stream?last_event_id=x.%C2%B2 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 204
        for bad in ("\ud800", "x" * 500, "a b", ""):
            body = json.dumps({"id": bad}).encode()
            status, _, raw = http(s.port, "POST", "/stop", body)
            assert status == 404 and json.loads(raw)["error"]["type"] == "not_found", (bad, raw)
        assert not any("internal error" in line for line in s.lines)


def test_a_redis_that_refuses_writes_for_a_while_ends_no_live_stream():
    """Redis out of memory (maxmemory, noeviction) refuses every write with an OOM error for 2 s:
    not a rival replica's entry, so the stream goes on and ends whole once writes pass again."""
    with redisctl.Redis() as r, ServerProcess("--store", r.url, *ARGS) as s:
        s.wait()
        db = redis.Redis.from_url(r.url)
        ids = []
        t, out = in_thread(reader.read, s.port, query(120), on_event=noting(ids))
        assert when(lambda: len(ids) >= 10, 30)
        db.config_set("maxmemory-policy", "noeviction")
        db.config_set("maxmemory", 1)
        time.sleep(2)
        db.config_set("maxmemory", 0)
        t.join(60)
        got = out[0]
        assert got.ended == "done" and got.numbers == list(range(len(got.events)))
        assert not any("took it over" in line for line in s.lines)
        assert any("failed: OutOfMemoryError" in line for line in s.lines)  # (the refusals were seen, and counted)
        assert when(lambda: len(db.xrange(f"streaming:s:{got.stream}")) == len(got.events), 10)


def test_two_resumes_racing_for_one_view_both_wait_for_its_events():
    """Two readers come back at once with an id past what Redis holds (the generator died before
    writing what they saw, and the taker makes it again): the first makes the view and waits for
    those events; the second, whose read of Redis ended after that, got None, a 204 (EventSource
    then stops for good: the rest of a live stream lost). Both get the view."""
    import asyncio

    from streaming.server.resumable.recordings import Recordings
    from streaming.server.resumable.takeover import Takeover

    class Store:
        async def entries(self, _stream_id, _start=0):
            await asyncio.sleep(0.01)
            return [(b"0-1", {b"e": b'{"text": "a"}', b"t": b"5"})]

        def spawn(self, coro, **_):
            coro.close()  # (no watch: nothing more comes)

    async def run():
        takeover = Takeover(Store(), Recordings(), None, None, None, None)  # type: ignore[arg-type]
        return await asyncio.gather(takeover.find("S.3"), takeover.find("S.3"))

    first, second = asyncio.run(run())
    assert first is not None and second is not None
    assert first[0] is second[0] and first[1] == second[1] == 3 and len(first[0].events) == 1


def test_a_redis_that_fails_to_start_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A port already taken (bound, not listening, so nothing answers on it): redis-server exits,
    and its working folder went with it only on a stop(), which a failed start never reached."""
    monkeypatch.setattr(redisctl.tempfile, "tempdir", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        with pytest.raises(RuntimeError, match="redis-server did not start"):
            redisctl.Redis(port=taken.getsockname()[1])
    assert list(tmp_path.iterdir()) == []
