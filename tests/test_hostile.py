"""A buggy or hostile upstream costs the server a bounded amount and its reader a clear error.

`Hostile` is a small asyncio server in the test process, speaking just enough HTTP/1.1 and
streaming Chat Completions to be an upstream, whose answer is chosen by the prompt: it floods
text past max_tokens, sends data lines with no end, one huge line, only comments, a head then
nothing, nothing at all, text then silence, usage counts that are not counts, or a normal
answer. This server runs in front of it (`--engine upstream`) with 2-second text deadlines;
every case ends with a normal request that must succeed and the server's memory within a bound.
"""

import asyncio
import base64
import json
import socket
import threading
import time

import pytest
from helpers import ServerProcess, events, http, metrics

FIRST_TEXT = SILENCE = 2.0  # the server's --upstream-first-text and --upstream-silence here
RSS_BOUND = 150 * 1024 * 1024  # bytes the server may grow by in one hostile case (it held 507 MB-6 GB before)


def chunk(text=None, finish=None, usage=None):
    value = {"id": "x", "object": "chat.completion.chunk", "choices": []}
    if text is not None or finish is not None:
        delta = {"content": text} if text is not None else {}
        value["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        value["usage"] = usage
    return b"data: " + json.dumps(value).encode() + b"\n\n"


class Hostile:
    """An upstream that misbehaves as its request's last message says (see the module's docstring)."""

    def __init__(self, trickle_models=False, refuse=None):
        self.trickle_models = trickle_models  # GET /models: a head, then a byte every 2 s
        self.refuse = refuse  # bytes: the whole answer to every request (a redirect, a 401, a 404)
        self.heads = []  # every request's head, as it came
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        self.ready.wait(10)

    def run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self.handle, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        async def shut():
            self.server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    async def handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            body = json.loads(await reader.readexactly(length)) if length else {}
            self.heads.append(head)
            if self.refuse:
                writer.write(self.refuse)
                await writer.drain()
                return
            if head.startswith(b"GET") and self.trickle_models:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\nConnection: close\r\n\r\n")
                for _ in range(1000):
                    await writer.drain()
                    await asyncio.sleep(2)
                    writer.write(b" ")
                return
            if head.startswith(b"GET"):
                data = json.dumps({"object": "list", "data": [{"id": "hostile"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(data) + data)
                await writer.drain()
                return
            await getattr(self, body["messages"][-1]["content"])(writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def stream_head(self, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()

    async def normal(self, writer):
        await self.stream_head(writer)
        writer.write(chunk("Hello") + chunk(" there") + chunk(finish="stop") + chunk(usage=USAGE) + b"data: [DONE]\n\n")
        await writer.drain()

    async def flood(self, writer):  # text forever, whatever max_tokens said
        await self.stream_head(writer)
        while True:
            writer.write(chunk(" x") * 100)
            await writer.drain()

    async def lines(self, writer):  # data lines forever, never the blank line that ends an event
        await self.stream_head(writer)
        while True:
            writer.write(b"data: x\n" * 1000)
            await writer.drain()

    async def huge(self, writer):  # one line of 30 MB, never ended
        await self.stream_head(writer)
        for _ in range(30 * 16):
            writer.write(b"x" * 65536)
            await writer.drain()
        await asyncio.sleep(30)

    async def comments(self, writer):  # pings only: never any text
        await self.stream_head(writer)
        while True:
            writer.write(b":\n\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    async def stall(self, writer):  # the head, then nothing
        await self.stream_head(writer)
        await asyncio.sleep(60)

    async def silent(self, _writer):  # not even a head
        await asyncio.sleep(60)

    async def midsilence(self, writer):  # some text, then pings only
        await self.stream_head(writer)
        writer.write(chunk("Hello"))
        await self.comments(writer)

    async def badusage(self, writer):  # usage counts that are not counts
        await self.usage_of(writer, {"prompt_tokens": -3, "completion_tokens": "lots", "total_tokens": None})

    async def hugeusage(self, writer):  # counts of 400 digits (a float sum's overflow)
        await self.usage_of(writer, {"prompt_tokens": 10**400, "completion_tokens": 10**400, "total_tokens": 1})

    async def liarusage(self, writer):  # a count no answer of max_tokens 20 could have
        await self.usage_of(writer, {"prompt_tokens": 7, "completion_tokens": 2**31 - 1, "total_tokens": 2**31 + 6})

    async def nested(self, writer):  # an event nested past Python's recursion limit
        await self.stream_head(writer)
        writer.write(chunk("Hello") + b"data: " + b"[" * 5000 + b"\n\n")
        await writer.drain()

    async def dicterror(self, writer):  # an error event whose message is an object
        await self.stream_head(writer)
        writer.write(chunk("Hello") + b'data: {"error": {"message": {"detail": "the GPU fell over"}}}\n\n')
        await writer.drain()

    async def usage_of(self, writer, usage):
        await self.stream_head(writer)
        writer.write(chunk("Hello") + chunk(" there") + chunk(finish="stop") + chunk(usage=usage) + b"data: [DONE]\n\n")
        await writer.drain()

    async def reasoning(self, writer):  # signs of life forever, never any text
        await self.stream_head(writer)
        call = {"tool_calls": [{"index": 0, "function": {"arguments": ""}}]}
        while True:
            for delta in ({"reasoning_content": "hmm"}, call):
                value = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
                writer.write(b"data: " + json.dumps(value).encode() + b"\n\n")
            await writer.drain()
            await asyncio.sleep(0.001)


USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


@pytest.fixture(scope="module")
def hostile():
    h = Hostile()
    yield h
    h.close()


@pytest.fixture(scope="module")
def front(hostile):
    args = ["--engine", "upstream", "--upstream", f"http://127.0.0.1:{hostile.port}/v1", "--write-timeout", "5"]
    args += ["--upstream-first-text", str(FIRST_TEXT), "--upstream-silence", str(SILENCE)]
    with ServerProcess(*args) as s:
        yield s.wait()


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def chat(front, mode, max_tokens=20, stream=True):
    body = {"model": "x", "messages": [{"role": "user", "content": mode}], "max_tokens": max_tokens, "stream": stream}
    t0 = time.monotonic()
    status, headers, raw = http(front.port, "POST", "/v1/chat/completions", body)
    return status, raw, time.monotonic() - t0


def still_serves(front, before):
    """A normal answer still comes, and the server did not grow past the bound."""
    status, raw, _ = chat(front, "normal")
    evs = [json.loads(e.data) for e in events(raw) if e.data != "[DONE]"]
    assert (
        status == 200
        and "".join(c["choices"][0]["delta"].get("content", "") for c in evs if c["choices"]) == "Hello there"
    )
    grown = rss(front.proc.pid) - before
    assert grown < RSS_BOUND, f"the server grew by {grown / 2**20:.0f} MB"
    return grown


def texts_of(raw):
    out, error = [], None
    for e in events(raw):
        if e.data == "[DONE]":
            continue
        value = json.loads(e.data)
        if "error" in value:
            error = value["error"]
            continue
        for c in value.get("choices") or []:
            if c["delta"].get("content"):
                out.append(c["delta"]["content"])
            if c.get("finish_reason"):
                out.append(("finish", c["finish_reason"]))
    return out, error


def test_an_upstream_that_floods_past_max_tokens_is_cut_at_max_tokens(front):
    before = rss(front.proc.pid)
    status, raw, took = chat(front, "flood", max_tokens=5)
    texts, error = texts_of(raw)
    assert status == 200 and error is None and texts[-1] == ("finish", "length")
    assert "".join(texts[:-1]) == " x" * 5  # (in 1 to 5 events: a flood's pieces wait together, and merge)
    status, body, _ = chat(front, "flood", max_tokens=5, stream=False)
    answer = json.loads(body)
    assert answer["choices"][0]["message"]["content"] == " x" * 5 and answer["choices"][0]["finish_reason"] == "length"
    still_serves(front, before)


@pytest.mark.parametrize("mode", ["lines", "huge"])
def test_an_event_that_never_ends_is_a_clear_error_within_a_bound(front, mode):
    before = rss(front.proc.pid)
    status, raw, took = chat(front, mode)
    texts, error = texts_of(raw)
    assert status == 200 and error is not None and "over 1048576 characters" in error["message"], raw[-300:]
    assert took < 20
    still_serves(front, before)


@pytest.mark.parametrize("mode", ["comments", "stall", "silent"])
def test_an_upstream_without_text_is_a_504_by_the_first_text_deadline(front, mode):
    before = rss(front.proc.pid)
    status, raw, took = chat(front, mode, stream=False)
    assert status == 504 and b"sent nothing in 2 s" in raw, raw
    assert FIRST_TEXT - 0.5 < took < FIRST_TEXT + 5
    still_serves(front, before)


def test_an_upstream_that_goes_silent_mid_answer_ends_it_with_an_error_event(front):
    status, raw, took = chat(front, "midsilence")
    texts, error = texts_of(raw)
    assert status == 200 and "Hello" in texts and error is not None and "nothing for 2 s mid-answer" in error["message"]
    assert SILENCE - 0.5 < took < SILENCE + 5


def test_usage_counts_that_are_not_counts_are_ignored_with_a_warning(front):
    body = {"model": "x", "messages": [{"role": "user", "content": "badusage"}], "max_tokens": 20}
    status, _, raw = http(front.port, "POST", "/v1/chat/completions", body)
    answer = json.loads(raw)
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello there"
    assert answer["usage"]["completion_tokens"] == 2  # counted from the pieces
    deadline = time.monotonic() + 10  # the warning is on the server's stderr, read beside the answer: wait for it
    while not any("sent usage completion_tokens='lots': not a count, ignored" in line for line in front.lines):
        assert time.monotonic() < deadline, front.lines[-20:]
        time.sleep(0.05)
    assert not any("internal error" in line for line in front.lines)


def test_usage_counts_past_any_context_are_ignored_and_the_answer_ends_well(front):
    """Counts of 400 digits (JSON has no bound) overflowed the metrics' float sums: the whole
    answer was a 500, the stream's end an error event."""
    status, raw, _ = chat(front, "hugeusage")
    texts, error = texts_of(raw)
    assert status == 200 and error is None and texts == ["Hello", " there", ("finish", "stop")]
    assert raw.rstrip().endswith(b"data: [DONE]")
    status, raw, _ = chat(front, "hugeusage", stream=False)
    answer = json.loads(raw)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    said = "sent usage completion_tokens=" + "1" + "0" * 39 + ": not a count"  # its first 40 characters
    assert any(said in line for line in front.lines), front.lines[-10:]
    assert not any("internal error" in line or "Traceback" in line for line in front.lines)


def test_an_upstream_that_reasons_forever_is_cut_past_max_tokens(front):
    """Chunks that show life without text (reasoning, an empty piece of a call's arguments) kept
    the silence deadline moving: the answer never ended."""
    before = rss(front.proc.pid)
    status, raw, took = chat(front, "reasoning", max_tokens=5)
    texts, error = texts_of(raw)
    assert status == 200 and error is None and texts[-1] == ("finish", "length") and took < 10, raw[-300:]
    status, raw, took = chat(front, "reasoning", max_tokens=5, stream=False)
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] == "length" and took < 10
    still_serves(front, before)


def test_an_upstream_that_trickles_its_model_list_delays_a_request_by_a_bound():
    """Without --upstream-model each request asks GET /models: a reply of a byte every 2 s (each
    read within the 5-s timeout) held every request for as long as the upstream liked."""
    from streaming.generation.upstream.pool import GET_TIMEOUT

    h = Hostile(trickle_models=True)
    try:
        with ServerProcess("--engine", "upstream", "--upstream", f"http://127.0.0.1:{h.port}/v1") as s:
            s.wait()
            status, raw, took = chat(s, "normal", stream=False)
            answer = json.loads(raw)
            assert status == 200 and answer["choices"][0]["message"]["content"] == "Hello there", raw
            assert took < GET_TIMEOUT + 5
    finally:
        h.close()


def test_a_reader_who_never_reads_holds_the_upstream_back(front):
    """Backpressure: the relay stops reading the upstream while its reader is behind; the server
    grew by 507 MB in 8 s here before."""
    before = rss(front.proc.pid)
    s = socket.create_connection(("127.0.0.1", front.port))
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": "flood", "max_tokens": 4096}).encode()
    s.sendall(
        b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
        + body
    )
    time.sleep(4)  # reading nothing
    grown = rss(front.proc.pid) - before
    s.close()
    assert grown < 50 * 1024 * 1024, f"grew by {grown / 2**20:.0f} MB"
    still_serves(front, before)


def test_a_resumable_stream_whose_reader_left_holds_the_upstream_back(front):
    before = rss(front.proc.pid)
    with socket.create_connection(("127.0.0.1", front.port)) as s:
        s.sendall(b"GET /stream?prompt=flood&max_tokens=4096 HTTP/1.1\r\nHost: x\r\n\r\n")
        s.recv(4096)
    time.sleep(4)  # within its grace: generating for a reader who may come back, but bounded
    grown = rss(front.proc.pid) - before
    assert grown < 50 * 1024 * 1024, f"grew by {grown / 2**20:.0f} MB"
    still_serves(front, before)


def test_a_relay_held_back_by_its_reader_ends_at_once_when_stopped(hostile):
    """In process: the relay, 64 pieces ahead of a reader who takes none (and what the read that
    passed the mark carried), waits; a stop must end the job within moments (it waited for room
    forever once a stop's cancel was swallowed)."""
    from streaming.generation.upstream.pool import Pool
    from streaming.generation.upstream.relay import AHEAD, UpstreamJob
    from streaming.wire.params import GenerationParams

    async def run():
        pool = Pool([f"http://127.0.0.1:{hostile.port}/v1"], model="hostile")
        job = UpstreamJob(pool, [{"role": "user", "content": "flood"}], GenerationParams(max_tokens=4096)).start()
        await asyncio.wait_for(job.opened, 10)
        for _ in range(100):
            if job.out.qsize() >= AHEAD:
                break
            await asyncio.sleep(0.05)
        queued = job.out.qsize()
        await asyncio.sleep(0.3)
        assert job.out.qsize() == queued  # held back: no more read from the upstream
        job.stop.set()
        produced = await asyncio.wait_for(job.done, 3)
        return queued, produced, job.reason

    queued, produced, reason = asyncio.run(run())
    assert AHEAD <= queued <= AHEAD + 65536 // 100 and produced == queued and reason == "stopped"


def test_a_count_past_max_tokens_is_not_the_answers_and_is_ignored(front):
    """A completion_tokens under 2**31 was taken for the answer's, whatever max_tokens said."""
    body = {"model": "x", "messages": [{"role": "user", "content": "liarusage"}], "max_tokens": 20}
    status, _, raw = http(front.port, "POST", "/v1/chat/completions", body)
    answer = json.loads(raw)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2, answer
    assert when_line(front, "past max_tokens: ignored")


@pytest.mark.parametrize(
    "mode,told",
    [("nested", "an event that is not JSON"), ("dicterror", 'failed mid-answer: {"detail": "the GPU fell over"}')],
)
def test_an_event_nested_too_deep_or_an_error_not_in_words_is_told_plainly(front, mode, told):
    """An event nested past the recursion limit escaped the parser as a RecursionError (a generic
    "relaying failed", and the upstream never taken out); an error's message that is an object
    reached the reader in Python's repr ({'detail': ...})."""
    before = rss(front.proc.pid)
    status, raw, _ = chat(front, mode)
    texts, error = texts_of(raw)
    assert status == 200 and texts == ["Hello"] and error is not None and told in error["message"], raw[-300:]
    still_serves(front, before)


def when_line(server, text, timeout=10):
    deadline = time.monotonic() + timeout
    while not any(text in line for line in server.lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


REFUSALS = {
    "redirect": b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n",
    "wrong key": b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\n{}",
    "no such model": b'HTTP/1.1 404 Not Found\r\nContent-Length: 44\r\n\r\n{"error": {"message": "no model m, sorry!"}}',
}


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_an_upstream_that_refuses_every_request_is_taken_out_and_the_next_one_asked(hostile, refusal):
    """Only a refusal of the request itself (400, 413, 422) is the reader's. A redirect, a 401 or a
    404 for the model were taken as the reader's too: never retried, never taken out, and the
    upstream that answers at once (fewest in flight) was asked first every time."""
    refusing = Hostile(refuse=REFUSALS[refusal])
    try:
        urls = [
            "--upstream",
            f"http://127.0.0.1:{refusing.port}/v1",
            "--upstream",
            f"http://127.0.0.1:{hostile.port}/v1",
        ]
        with ServerProcess("--engine", "upstream", *urls, "--upstream-model", "m") as s:
            s.wait()
            for _ in range(3):
                status, raw, _ = chat(s, "normal", stream=False)
                assert status == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "Hello there"
            ups = metrics(s.port)[
                "upstreams"
            ]  # (left out 2 s: on a slow machine it may be asked again, and fail again)
            assert ups[0]["failures"] >= 1 and ups[0]["served"] == 0 and ups[1]["served"] == 3, ups
    finally:
        refusing.close()


def test_an_upstreams_user_and_password_are_sent_as_basic_and_never_shown(hostile):
    """They were never sent (only the host was), and /metrics.json, open to anyone without
    --api-key, showed them."""
    url = f"http://user:p%40ss@127.0.0.1:{hostile.port}/v1"
    with ServerProcess("--engine", "upstream", "--upstream", url, "--upstream-model", "m") as s:
        s.wait()
        status, _, _ = chat(s, "normal")
        assert status == 200
        sent = base64.b64encode(b"user:p@ss")
        assert b"\r\nauthorization: basic " + sent.lower() in hostile.heads[-1].lower()
        shown = json.dumps(metrics(s.port)["upstreams"])
        assert f'"http://127.0.0.1:{hostile.port}/v1"' in shown and "p%40ss" not in shown and "user" not in shown
        assert not any("p%40ss" in line for line in s.lines)
