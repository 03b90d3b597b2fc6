"""Pieces per event (streaming/server/merging.py): `--stream-interval N` and adaptive merging.

Pure first: the policy driven with pieces and a `behind` flag, and a fake clock and socket (a
reader that drains so many bytes a second) on which adaptive merging never makes a piece wait
for a later one, reaches the reader no later than one event per piece would, and makes far
fewer events for a slow reader; then Answer.relay with a scripted job (the same text, the stop
strings across merged pieces, the same token count); then real servers over real sockets: the
flag and each endpoint's per-request field, their checks, and a reader who stops reading for a
while and gets the same text in far fewer events, the first still alone.
"""

import asyncio
import json
import math
import socket
import time

import pytest
from helpers import WSClient, connect, events, http, read_all, split_response, stream_texts, wait_idle

from streaming.generation.job import Job
from streaming.server.answer import Answer, Answers
from streaming.server.merging import MERGE_CHARS, MERGE_PIECES, Merging
from streaming.server.metrics import Metrics
from streaming.server.state import ServerState
from streaming.wire.params import GenerationParams
from streaming.wire.stops import StopMatcher

# --- the policy alone ----------------------------------------------------------------------------


def run(merging, pieces, behind=lambda _: False):
    """Drive `merging` as Answer.relay does when every piece is already waiting: the events'
    texts. `behind(k)`: whether the reader is behind at the k-th event."""
    queue, out = list(pieces), []
    while queue:
        merging.add(queue.pop(0))
        merging.wait_for_reader(behind(len(out)))  # (nothing more arrives here while it waits)
        while merging.more() and queue:
            merging.add(queue.pop(0))
        if merging.due():
            out.append(merging.take())
            merging.sent()
    if merging.held:
        out.append(merging.take())
    return out


def test_one_piece_an_event_without_merging_however_many_wait():
    assert run(Merging(adaptive=False), ["a", "b", "c", "d"]) == ["a", "b", "c", "d"]


def test_an_interval_sends_the_first_piece_alone_then_n_at_a_time_and_the_rest_at_the_end():
    pieces = [str(i % 10) for i in range(11)]
    assert run(Merging(4, adaptive=False), pieces) == ["0", "1234", "5678", "90"]


def test_adaptive_merging_joins_what_waits_after_the_first_up_to_its_caps():
    many = ["x"] * (2 + 2 * MERGE_PIECES)
    assert [len(e) for e in run(Merging(), many)] == [1, MERGE_PIECES, MERGE_PIECES, 1]
    long = ["y" * 1000] * 10  # a character cap too: an event stops taking once it holds MERGE_CHARS
    assert [len(e) for e in run(Merging(), long)] == [1000, math.ceil(MERGE_CHARS / 1000) * 1000, 4000]
    assert "".join(run(Merging(4), many)) == "".join(many)  # (an interval under the cap: the cap rules)


def test_the_first_event_never_waits_for_the_reader_and_later_ones_only_when_it_is_behind():
    m = Merging()
    m.add("a")
    assert not m.wait_for_reader(True) and not m.more() and m.due()  # the first: alone, at once
    m.take()
    m.sent()
    m.add("b")
    assert m.wait_for_reader(True) and not m.wait_for_reader(False) and m.more()
    assert not Merging(adaptive=False).wait_for_reader(True)
    with pytest.raises(ValueError):
        Merging(0)


def simulate(merging, arrivals, rate, low=4096, overhead=200, cost=0.0):
    """A fake clock and socket: piece i (2 characters) reaches the relay at arrivals[i]; an
    event costs the loop `cost` seconds and is `overhead` + its text's bytes, which the reader
    drains at `rate` bytes a second; `behind` while more than `low` bytes wait. Returns the
    events [(written at, received at, pieces)] and, per piece, when the reader had it."""
    now, done, i, n = 0.0, 0.0, 0, len(arrivals)  # done: when the reader will have every byte sent
    out, got, members = [], [None] * n, []

    def send():
        nonlocal now, done
        text = merging.take()
        done = max(done, now) + (overhead + len(text)) / rate
        out.append((now, done, list(members)))
        for k in members:
            got[k] = done
        members.clear()
        merging.sent()
        now += cost

    while i < n:
        now = max(now, arrivals[i])
        merging.add("ab")
        members.append(i)
        i += 1
        if merging.wait_for_reader((done - now) * rate > low):
            now = max(now, done - low / rate)  # settle: until the socket is back at its low mark
        while merging.more() and i < n and arrivals[i] <= now:
            merging.add("ab")
            members.append(i)
            i += 1
        if merging.due():
            send()
    if merging.held:
        send()
    return out, got


@pytest.mark.parametrize("rate", [1e9, 20_000, 2_000])  # a reader who keeps up; slow; very slow
@pytest.mark.parametrize("cost", [0.0, 0.005])  # a loop that costs nothing an event; a loaded one: 200 a second
def test_adaptive_merging_never_waits_for_text_and_a_slow_reader_gets_it_sooner(rate, cost):
    arrivals = [0.001 * k for k in range(1000)]  # 1,000 tokens a second
    one, got_one = simulate(Merging(adaptive=False), arrivals, rate, cost=cost)
    merged, got = simulate(Merging(), arrivals, rate, cost=cost)
    assert merged[0][2] == [0] and merged[0][0] == 0.0  # the first piece alone, at once
    for written, _, members in merged:  # no event waited for a piece that had not arrived
        assert all(arrivals[k] <= written for k in members)
    for _, _, members in merged:  # no piece later than one event a piece brings it, but for the
        for k in members:  # bytes of the text it travels with (an event is read whole)
            assert got[k] <= got_one[k] + 2 * len(members) / rate + 1e-9
    if rate > 1e6 and cost == 0:
        assert len(merged) == len(arrivals)  # a reader who keeps up: one event a piece, as before
    if rate <= 20_000 or cost:  # behind (the socket, or the loop): far fewer events, the text much sooner
        assert len(merged) < len(arrivals) / 4 and got[-1] < got_one[-1] / 2


# --- Answer.relay with a scripted job ------------------------------------------------------------


class QueuedJob(Job):
    """A real Job whose producing side puts `pieces` on its queue, `every` seconds apart (0: all
    at once, as an engine far ahead of its reader), honouring its stop flag."""

    def __init__(self, pieces, every=0.0):
        super().__init__([1, 2, 3], GenerationParams(max_tokens=len(pieces)))
        self.script, self.every = list(pieces), every

    def start(self):
        super().start()
        self.loop.create_task(self.run())
        return self

    async def run(self):
        self.reason = "length"
        for piece in self.script:
            if self.every:
                await asyncio.sleep(self.every)
            if self.stop.is_set():
                self.reason = "stopped"
                break
            self.produced += 1
            self.out.put_nowait(piece)
        self.out.put_nowait(None)
        self.ended.set()
        self.finish(self.produced)


class Outlet:
    """A reader's socket as adaptive merging sees it: behind while `lag` says so; settle() waits."""

    def __init__(self, behind_from=1, wait=0.05):
        self.events, self.behind_from, self.wait, self.settled = 0, behind_from, wait, 0

    @property
    def behind(self):
        return self.events >= self.behind_from

    async def settle(self):
        self.settled += 1
        await asyncio.sleep(self.wait)
        return True


def relay(pieces, merging, every=0.0, stops=None, outlet=None, ping=15.0):
    """Answer.relay's events; with `stops`, found in the delivery as the APIs' streams find them
    (v1.stream): matched() ends the answer, and what the matcher held back goes at the end."""

    async def go():
        a = Answers(Metrics(lambda: 0, lambda: 0, lambda: 0), ServerState(), ping, False)
        job, got, matcher = QueuedJob(pieces, every).start(), [], StopMatcher(stops or [])

        async def deliver(text):
            if stops:
                if matcher.matched is not None:
                    return True  # (the pieces that still come go nowhere)
                text = matcher.push(text)
                if matcher.matched is not None:
                    answer.matched()
            if text:
                got.append(text)
            if outlet is not None:
                outlet.events += 1
            return True

        async def keep_alive():
            got.append(None)  # a ping
            return True

        async with Answer(a, job, "/stream") as answer:
            await answer.relay(deliver, keep_alive, merging, outlet)
            if stops and matcher.matched is None and (rest := matcher.flush()):
                got.append(rest)
        return got, matcher.matched if stops else None, answer

    return asyncio.run(go())


def test_the_relay_merges_what_waits_with_the_same_text_and_the_same_token_count():
    pieces = [f" w{i}" for i in range(200)]
    got, _, answer = relay(pieces, Merging())
    assert "".join(got) == "".join(pieces) and got[0] == " w0"
    assert len(got) <= 1 + math.ceil(199 / MERGE_PIECES) + 1
    assert answer.produced == 200 and len(answer.arrivals) == 200  # usage and metrics count pieces


def test_a_stop_string_across_merged_pieces_still_ends_the_answer_before_it():
    got, matched, _ = relay(["Hel", "lo", " wor", "ld", " and on"], Merging(), stops=["o wo"])
    assert "".join(got) == "Hell" and matched == "o wo"
    got, matched, _ = relay(["Hel", "lo", " wor", "ld", " and on"], Merging(3, adaptive=False), stops=["ld!"])
    assert "".join(got) == "Hello world and on" and matched is None  # held back "ld", then given


def test_a_reader_who_is_behind_gets_the_pieces_that_came_meanwhile_in_one_event():
    outlet = Outlet(behind_from=1, wait=0.1)
    got, _, _ = relay(["x"] * 40, Merging(), every=0.01, outlet=outlet)
    assert "".join(got) == "x" * 40 and got[0] == "x" and outlet.settled
    assert len(got) < 20  # ~0.1 s of pieces an event, not one each
    steady = Outlet(behind_from=10**6)
    got, _, _ = relay(["x"] * 20, Merging(), every=0.01, outlet=steady)
    assert got == ["x"] * 20 and not steady.settled  # a reader who keeps up: one a piece, no wait


def test_text_held_for_an_interval_goes_at_a_keep_alives_time_instead_of_a_ping():
    got, _, _ = relay(["a", "b", "c"], Merging(4, adaptive=False), every=0.2, ping=0.05)
    assert None in got  # pings while nothing is held; and "b" waited for no "c", "d", "e": it went
    assert [t for t in got if t] == ["a", "b", "c"]  # at the next keep-alive's time, instead of a ping


# --- real servers over real sockets --------------------------------------------------------------

TOKENS = 101  # (the first piece alone, then 100: 25 events of 4)


@pytest.fixture(scope="module")
def merging_servers():
    from helpers import ServerProcess

    started = {
        "interval": ServerProcess("--engine", "free", "--stream-interval", "4", "--stream-merge", "off"),
        "paced": ServerProcess("--engine", "free", "--token-delay", "0.001"),  # adaptive, as by default
    }
    try:
        yield {name: s.wait() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()


def chat(extra=None, n=TOKENS, stream_options=None):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": n, "stream": True}
    if stream_options is not None:
        body["stream_options"] = stream_options
    return {**body, **(extra or {})}


def chat_texts(body):
    """The content of each chat.completion.chunk event (the role chunk's empty one left out), and the usage."""
    texts, use = [], None
    for e in events(body):
        if e.data == "[DONE]":
            continue
        value = json.loads(e.data)
        use = value.get("usage") or use
        for choice in value["choices"]:
            if text := choice.get("delta", {}).get("content", choice.get("text")):
                texts.append(text)
    return texts, use


def test_stream_interval_4_is_the_same_text_in_a_quarter_of_the_events(merging_servers):
    port, quarter = merging_servers["interval"].port, 1 + math.ceil((TOKENS - 1) / 4)
    base = {"prompt": "x", "max_tokens": TOKENS}
    four, done = stream_texts(http(port, "POST", "/stream", base)[2])
    one, _ = stream_texts(http(port, "POST", "/stream", {**base, "stream_interval": 1})[2])
    assert done and "".join(four) == "".join(one) == " x" * TOKENS
    assert len(one) == TOKENS and len(four) == quarter and four[0] == " x" and four[1] == " x" * 4

    texts, use = chat_texts(http(port, "POST", "/v1/chat/completions", chat(stream_options={"include_usage": True}))[2])
    assert len(texts) == quarter and texts[0] == " x" and use["completion_tokens"] == TOKENS
    texts, use = chat_texts(
        http(port, "POST", "/v1/chat/completions", chat(stream_options={"stream_interval": 1, "include_usage": True}))[
            2
        ]
    )
    assert len(texts) == TOKENS and use["completion_tokens"] == TOKENS  # the same count, merged or not
    completion = {"prompt": "x", "max_tokens": TOKENS, "stream": True, "stream_options": {"stream_interval": 10}}
    texts, _ = chat_texts(http(port, "POST", "/v1/completions", completion)[2])
    assert "".join(texts) == " x" * TOKENS and len(texts) == 1 + 10

    c = WSClient(port)
    c.send_json({**base, "stream_interval": 8})
    messages, code = c.until_close()
    c.close()
    texts = [m["text"] for m in messages if "text" in m]
    assert code == 1000 and "".join(texts) == " x" * TOKENS and len(texts) == 1 + math.ceil(100 / 8)


@pytest.mark.parametrize("bad", [0, 65, "4", 2.5, True])
def test_a_bad_stream_interval_is_refused_in_each_endpoints_shape(merging_servers, bad):
    port = merging_servers["interval"].port
    status, _, body = http(port, "POST", "/stream", {"prompt": "x", "stream_interval": bad})
    assert status == 422 and "stream_interval must be an integer from 1 to 64" in json.loads(body)["error"]["message"]
    for path, request in [
        ("/v1/chat/completions", chat(stream_options={"stream_interval": bad})),
        ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"stream_interval": bad}}),
    ]:
        status, _, body = http(port, "POST", path, request)
        assert status == 400 and json.loads(body)["error"]["param"] == "stream_options.stream_interval"
    c = WSClient(port)
    c.send_json({"prompt": "x", "stream_interval": bad})
    messages, code = c.until_close()
    c.close()
    assert code == 1008 and "stream_interval" in messages[0]["error"]["message"]


def test_a_reader_who_stops_reading_a_while_gets_the_same_text_in_far_fewer_events(merging_servers):
    port, n = merging_servers["paced"].port, 1000
    request = json.dumps(chat(n=n, extra={"ignore_eos": True})).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    data = (head + f"Content-Length: {len(request)}\r\n\r\n").encode() + request

    fast, _ = chat_texts(split_response(raw(port, data))[2])  # reads as it comes: one event a piece
    assert "".join(fast) == " x" * n and len(fast) > 0.9 * n

    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window it offers)
    slow.settimeout(30)
    slow.connect(("127.0.0.1", port))
    with slow:
        slow.sendall(data)
        time.sleep(0.5)  # reads nothing until the answer is over: the kernels' buffers fill, then
        wait_idle(port)  # the server's transport; what comes meanwhile waits for the reader
        texts, use = chat_texts(split_response(read_all(slow))[2])
    assert "".join(texts) == " x" * n and texts[0] == " x"  # the same text; the first piece alone
    assert len(texts) < n / 2, f"{len(texts)} events for {n} pieces"
    assert use is None  # (no include_usage asked)


def raw(port, data):
    with connect(port) as s:
        s.sendall(data)
        return read_all(s)


def test_a_reader_who_reads_nothing_is_still_dropped_after_the_write_timeout_while_merging():
    """Adaptive merging waits for a reader who is behind (Connection.settle) no longer than
    --write-timeout, as a write does: then the reader is dropped and its generation stops. In
    process, with small buffers at both ends (test_server.py's way), the free engine paced."""
    import lm
    import server
    from streaming.server.protocol import HttpProtocol
    from streaming.server.serve import build

    args = server.parse_args(["--engine", "free", "--token-delay", "0.001", "--port", "0", "--write-timeout", "0.5"])
    lm.model()  # (the free engine reads the prompt with the tiny model's tokenizer)
    ctx = build(server.config_of(args), lm.handle())
    protocol = HttpProtocol(ctx)

    async def handle(reader, writer):
        writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        writer.transport.set_write_buffer_limits(high=4096)
        await protocol.handle(reader, writer)

    async def main():
        listener = await asyncio.start_server(handle, "127.0.0.1", 0)
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.setblocking(False)
        await asyncio.get_running_loop().sock_connect(c, ("127.0.0.1", listener.sockets[0].getsockname()[1]))
        body = json.dumps(chat(n=4096)).encode()
        c.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body
        )
        for _ in range(400):  # at most 20 s
            if ctx.answers.log:
                break
            await asyncio.sleep(0.05)
        c.close()
        listener.close()
        await listener.wait_closed()
        return list(ctx.answers.log)

    log = asyncio.run(main())
    assert log and log[0][0] == "/v1/chat/completions" and log[0][2] is True and log[0][1] < 4096
