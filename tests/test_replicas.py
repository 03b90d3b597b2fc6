"""Streams in Redis across replicas (--store redis://), against a real redis-server and nginx:
resume and follow on the other replica, stop from it, the time to live, Redis going away and
coming back, a replica SIGKILLed mid-answer (with the thread and the batched engine), and a
rolling restart under 16 readers. The `exact` model's logits are exact in any batch and dtype,
so "the same text as an uninterrupted run" is a real assertion here."""

import json
import os
import subprocess
import sys
import threading

import pytest
import redis
from helpers import ServerProcess, http, metrics, server_log
from prometheus_client.parser import text_string_to_metric_families

from streaming import nginxctl, reader, redisctl
from streaming.replicas import Cluster, get_json, in_thread, noting, query, when
from streaming.server.resumable.recordings import Recording
from streaming.server.resumable.store import CONTROL, Gap
from streaming.server.resumable.takeover import fill

REQUIRED = os.environ.get("REQUIRE_REDIS") == "1" or os.environ.get("REQUIRE_NGINX") == "1"  # .ci/run sets them
if not REQUIRED and not (redisctl.available() and nginxctl.available()):
    pytest.skip("needs redis-server and nginx (apt-get install redis-server nginx)", allow_module_level=True)

KEEP = 6  # --resume-keep: seconds an ended stream stays in Redis
ARGS = ("--token-delay", "0.03", "--resume-grace", "3", "--resume-keep", str(KEEP), "--shutdown-grace", "3")
Q = query(60)


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2, ARGS, model="exact") as c:
        yield c


@pytest.fixture(scope="module")
def whole(cluster):
    r = reader.read(cluster.ports[0], Q)
    assert r.ended == "done" and r.numbers == list(range(len(r.events))) and len(r.events) > 30
    return r


def prometheus(port, name):
    text = http(port, "GET", "/metrics")[2].decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def store(c):
    return redis.Redis.from_url(c.redis.url)


def test_a_view_is_filled_from_entries_in_order_and_keeps_their_token_ids():
    rec = Recording("S", None)
    entries = [
        (b"0-1", {b"e": b"id: S.0\n\n", b"t": b""}),
        (b"0-2", {b"e": b"id: S.1\n\n", b"t": b"5 6"}),
        (b"0-2", {b"e": b"id: S.1\n\n", b"t": b"5 6"}),  # a repeat is skipped
        (b"0-3", {b"e": b"id: S.2\n\n", b"t": b"7", b"x": b"1"}),
    ]
    fill(rec, entries)
    assert rec.events == [b"id: S.0\n\n", b"id: S.1\n\n", b"id: S.2\n\n"] and rec.answer == [5, 6, 7]
    assert rec.last and rec.ended
    # a token id no int() takes (past 4,300 digits: a ValueError, a 500 on resume) is a gap, as
    # any entry that is not ours
    with pytest.raises(Gap):
        fill(Recording("T", None), [(b"0-1", {b"e": b"id: T.0\n\n", b"t": b"9" * 5000})])


def test_resume_on_the_other_replica_is_the_whole_text_once(cluster, whole):
    a, b = cluster.ports
    r = reader.read(a, Q, on_event=reader.drop_after(8), resume=b)
    assert r.connections == 2 and r.ended == "done"
    assert r.numbers == list(range(len(whole.events))) and r.text == whole.text
    assert get_json(b, "/metrics.json")["store"]["views_served"] >= 1
    db = store(cluster)
    assert 0 < db.pttl(f"streaming:s:{r.stream}") <= KEEP * 1000  # the time to live is --resume-keep
    meta = db.hgetall(f"streaming:m:{r.stream}")
    assert json.loads(meta[b"params"])["max_tokens"] == 60 and meta[b"ids"].split()
    assert "cache_salt" not in json.loads(meta[b"params"])  # none asked: a replica from before it reads these too
    fields = db.xrange(f"streaming:s:{r.stream}")[-1][1]
    assert fields[b"x"] == b"1" and b"[DONE]" in fields[b"e"]


def test_a_second_reader_follows_the_stream_from_the_other_replica(cluster, whole):
    a, b = cluster.ports
    ids = []
    t, first = in_thread(reader.read, a, Q, on_event=noting(ids))
    assert when(lambda: len(ids) >= 3, 30)
    follower = reader.read(b, "/stream", last=f"{ids[0]}.0")
    t.join(60)
    assert follower.ended == "done" and follower.text == first[0].text == whole.text
    assert follower.numbers == list(range(1, len(whole.events)))


def test_stop_from_the_other_replica_stops_it_within_a_step(cluster):
    """...also after notes that are not ours on every replica's channel (anyone who may PUBLISH
    to Redis can send them: one that did not decode ended the listener, which heard no stop again)."""
    a, b = cluster.ports
    ids = []
    t, got = in_thread(reader.read, a, query(400), on_event=noting(ids))
    assert when(lambda: len(ids) >= 5, 30)
    r = store(cluster)
    channels = r.pubsub_channels(CONTROL + "*")
    assert len(channels) == 2
    for channel in channels:
        for junk in (b"\xff\xfe", b"read " + ids[0].encode() + b" " + b"9" * 5000, b"stop", b""):
            assert r.publish(channel, junk) == 1
    before = get_json(a, "/metrics.json")["tokens_after_stop"]
    status, _, body = http(b, "POST", "/stop", {"id": ids[0]})
    assert status == 200 and json.loads(body) == {"id": ids[0], "stopped": True}
    t.join(30)
    assert got[0].ended == "done" and len(got[0].events) < 100
    assert when(lambda: get_json(a, "/metrics.json")["active_generations"] == 0, 10)
    assert get_json(a, "/metrics.json")["tokens_after_stop"] - before <= 1  # the generator stopped within a step
    status, _, body = http(b, "POST", "/stop", {"id": ids[0]})
    assert status == 200 and json.loads(body)["stopped"] is False  # it has ended
    status, _, body = http(b, "POST", "/stop", {"id": "nope"})
    assert status == 404 and json.loads(body)["error"]["type"] == "not_found"


def test_through_nginx_a_resume_lands_on_the_other_replica_and_a_stop_reaches_the_generator(cluster, whole):
    n = cluster.nginx.port
    before = [get_json(p, "/metrics.json")["store"]["views_served"] for p in cluster.ports]
    r = reader.read(n, Q, on_event=reader.drop_after(8))  # round robin: the resume goes to the other
    served = [
        get_json(p, "/metrics.json")["store"]["views_served"] - v for p, v in zip(cluster.ports, before, strict=True)
    ]
    assert r.ended == "done" and r.numbers == list(range(len(whole.events))) and r.text == whole.text
    assert sorted(served) == [0, 1]
    ids = []
    t, got = in_thread(reader.read, n, query(400), on_event=noting(ids))
    assert when(lambda: len(ids) >= 5, 30)
    gen = cluster.generator_of(ids[0])
    after = get_json(cluster.ports[gen], "/metrics.json")["tokens_after_stop"]
    for _ in range(2):  # one of the two lands on the other replica
        status, _, body = http(n, "POST", "/stop", {"id": ids[0]})
        assert status == 200
    t.join(30)
    assert got[0].ended == "done" and len(got[0].events) < 100
    assert when(lambda: get_json(cluster.ports[gen], "/metrics.json")["active_generations"] == 0, 10)
    assert get_json(cluster.ports[gen], "/metrics.json")["tokens_after_stop"] - after <= 1


def test_an_ended_stream_is_forgotten_after_resume_keep(cluster):
    a, b = cluster.ports
    r = reader.read(a, Q, on_event=reader.drop_after(5), resume=b)
    assert r.ended == "done"
    db = store(cluster)
    assert when(lambda: not db.exists(f"streaming:s:{r.stream}"), KEEP + 5)
    gone = reader.read(b, "/stream", last=f"{r.stream}.3")
    assert gone.ended == "204" and not gone.events


def test_a_rolling_restart_under_16_readers_loses_no_stream_and_no_piece(cluster, whole):
    counts = [0] * 16

    def counter(i):
        return lambda r: bool(counts.__setitem__(i, len(r.events)))

    q = query(400)
    threads = [in_thread(reader.read, cluster.nginx.port, q, on_event=counter(i)) for i in range(16)]
    assert when(lambda: min(counts) >= 5, 60)
    for i in range(2):
        cluster.restart(i)
    for t, _ in threads:
        t.join(120)
    rs = [out[0] for _, out in threads]
    assert [r.ended for r in rs] == ["done"] * 16
    assert all(r.numbers == list(range(len(rs[0].events))) for r in rs)  # no piece lost, none twice
    assert len({r.text for r in rs}) == 1 and rs[0].text.startswith(whole.text)  # exact model: greedy text is fixed
    assert sum(r.connections for r in rs) > 16  # they were moved
    assert any("taken over" in line for i in range(2) for line in cluster.lines(i))


def test_redis_going_away_keeps_live_readers_and_resume_fails_clearly_then_recovers(cluster, whole):
    a, b = cluster.ports
    ids = []
    t, got = in_thread(reader.read, a, Q, on_event=noting(ids))
    assert when(lambda: len(ids) >= 3, 30)
    port = cluster.redis.port
    cluster.redis.stop()
    t.join(60)
    assert got[0].ended == "done" and got[0].text == whole.text and got[0].connections == 1  # not stopped
    status, headers, body = http(b, "GET", "/stream", headers=[("Last-Event-ID", f"{ids[0]}.3")])
    assert status == 503 and json.loads(body)["error"]["type"] == "store_unavailable"
    assert headers["retry-after"] == "2"
    assert prometheus(a, "streaming_store_errors_total") > 0 and metrics(b)["store"]["errors"] > 0
    cluster.redis = redisctl.Redis(port=port)  # back (empty: nothing was saved)
    r = reader.read(a, Q, on_event=reader.drop_after(8), resume=b)  # both replicas reconnect
    assert r.ended == "done" and r.text == whole.text and r.connections == 2
    channel = "streaming:ctl:" + get_json(a, "/metrics.json")["store"]["replica"]
    assert when(lambda: store(cluster).pubsub_numsub(channel)[0][1] == 1, 10)  # a listens again
    test_stop_from_the_other_replica_stops_it_within_a_step(cluster)


def failover(engine, q, extra=()):
    """SIGKILL the replica generating a stream mid-answer, read through nginx: the reading."""
    with Cluster(2, (*ARGS, "--engine", engine, *extra), model="exact") as c:
        uninterrupted = reader.read(c.ports[0], q)
        ids = []
        t, got = in_thread(reader.read, c.nginx.port, q, on_event=noting(ids))
        assert when(lambda: len(ids) >= 15, 30)
        gen = c.generator_of(ids[0])
        c.kill(gen)
        t.join(60)
        survivor = [line for line in c.lines(1 - gen) if f"stream {ids[0]}: taken over" in line]
        return uninterrupted, got[0], survivor


@pytest.mark.parametrize(
    "engine, temperature", [("batched", 0), ("thread", 1)], ids=["batched-greedy", "thread-sampled"]
)
def test_a_stream_survives_its_replica_being_killed(engine, temperature):
    q = query(80).replace("temperature=0", f"temperature={temperature}")
    uninterrupted, r, survivor = failover(engine, q)
    assert r.ended == "done" and r.connections >= 2
    assert r.numbers == list(range(len(uninterrupted.events)))  # no gap, no repeat
    assert r.text == uninterrupted.text  # greedy, and sampled: token i's draw depends on the seed and i only
    assert survivor and "taken over after" in survivor[0]


def test_bad_store_option_is_a_usage_error():
    p = subprocess.run([sys.executable, "server.py", "--store", "mysql://x"], capture_output=True, text=True)
    assert p.returncode == 2 and "give memory or a Redis URL" in p.stderr


def test_nginx_accepts_the_upstream_block_of_two_replicas(tmp_path):
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginxctl.config([8765, 8766], 8080))
    (tmp_path / "tmp").mkdir()
    p = subprocess.run(
        [nginxctl.binary(), "-t", "-p", f"{tmp_path}/", "-c", "nginx.conf", "-e", str(tmp_path / "error.log")],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert "server 127.0.0.1:8766 max_fails=0;" in conf.read_text()


def test_the_reader_counts_gaps_and_repeats():
    r = reader.Reading(events=[(k, None) for k in (0, 1, 3, 3, 4)])
    assert r.lost == 1 and r.repeated == 1
    assert threading.active_count() >= 1


def test_a_stream_relayed_from_an_upstream_survives_its_replica_being_killed():
    """The survivor continues with a new upstream request whose prompt ends with the text so far
    (continue_final_message): the same greedy text, with the exact model behind both."""
    with ServerProcess("--model", "exact", "--token-delay", "0.03") as upstream:
        upstream.wait()
        q = query(80)
        uninterrupted, r, survivor = failover("upstream", q, ("--upstream", f"http://127.0.0.1:{upstream.port}/v1"))
        continued = [e for e in server_log(upstream.port) if e[0] == "/v1/chat/completions"]
    assert r.ended == "done" and r.connections >= 2 and not r.lost and not r.repeated
    assert r.text == uninterrupted.text
    assert survivor and "taken over after" in survivor[0] and len(continued) == 3  # whole, killed, continued


def responses_events(port, method, path, body=None, headers=(), upto=None):
    """A Responses stream's events as JSON, the connection closed after `upto` of them."""
    import httpx

    got = []
    with httpx.stream(method, f"http://127.0.0.1:{port}{path}", json=body, headers=dict(headers), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            if line.startswith("data: "):
                got.append((last, json.loads(line[6:])))
                if upto is not None and len(got) >= upto:
                    break
    return got


def test_a_responses_stream_survives_its_replica_sigkilled_and_resumes_on_the_other():
    """POST /v1/responses on replica 0, 15 events read, replica 0 SIGKILLed; the reader asks
    replica 1 for the rest with Last-Event-ID: it takes the stream over, and the events go on
    numbered from where they were, with the same text as an uninterrupted answer."""
    body = {"input": "Tell me about tides.", "max_output_tokens": 60, "stream": True, "ignore_eos": True}
    with Cluster(2, ARGS, model="exact") as c:
        whole = responses_events(c.ports[1], "POST", "/v1/responses", body)
        first = responses_events(c.ports[0], "POST", "/v1/responses", body, upto=15)
        response_id = first[0][1]["response"]["id"]
        assert when(lambda: c.generator_of(response_id.removeprefix("resp_")) == 0, 10)
        c.kill(0)
        path = f"/v1/responses/{response_id}?stream=true"
        rest = responses_events(c.ports[1], "GET", path, headers=[("Last-Event-ID", first[-1][0])])
        got = [e for _, e in first + rest]
        assert [e["sequence_number"] for e in got] == list(range(len(got)))  # none lost, none twice
        assert got[-1]["type"] == "response.incomplete" and got[-1]["response"]["usage"]["output_tokens"] == 60

        def text(evs):
            return "".join(e.get("delta", "") for e in evs if e["type"] == "response.output_text.delta")

        assert text(got) == text([e for _, e in whole]) == got[-1]["response"]["output"][0]["content"][0]["text"]
        assert any("taken over" in line for line in c.lines(1))
        # and OpenAI's way, starting_after, on the survivor: the rest once more
        again = responses_events(c.ports[1], "GET", f"{path}&starting_after=20")
        assert [e["sequence_number"] for _, e in again] == list(range(21, len(got)))
