"""The server layer without sockets: one answer's lifecycle (streaming/server/answer.py) driven
with a scripted job and a fake connection, and the exchange (exchange.py) deciding heads and
saying errors, as h11's test_connection.py drives its Connection with bytes only.

What an Answer promises: a normal end is logged as finished; a reader who leaves stops the job
at once and is logged as having left (no end sent); a reader who cannot take a piece counts the
same, unless the server is --naive (then the job goes on, for nobody); a stop said by the reader
is logged as such; a failed job is a ProtocolError, which the exchange says as an HTTP error
before the head and as the stream's own error after it (a job refused at admission, the request's
fault, is its InvalidRequest: a 4xx, and in a resumable stream's recording an invalid_request); an answer the shutdown cut short leaves
with 503 shutting_down, but not one whose reader had left."""

import asyncio
import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from streaming.generation.job import Job
from streaming.server.answer import FAILED, Answer, Answers, Early
from streaming.server.exchange import Exchange, Progress
from streaming.server.metrics import Metrics
from streaming.server.resumable.encodings import Article
from streaming.server.state import Phase, ServerState
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.http11 import END, Request, ResponseReader
from streaming.wire.openai import OpenAI
from streaming.wire.params import GenerationParams
from streaming.wire.sse import EventParser


class ScriptedJob(Job):
    """A real Job whose producing side is a coroutine handing out `pieces`, one per `every`
    seconds, honouring its stop flag before each (as every engine does), then ending or failing."""

    def __init__(self, pieces, every=0.0, fail=None):
        super().__init__([1, 2, 3], GenerationParams(max_tokens=len(pieces)))
        self.script, self.every, self.failure = list(pieces), every, fail

    def start(self):
        super().start()
        self.loop.create_task(self.run())
        return self

    async def run(self):
        for piece in self.script:
            await asyncio.sleep(self.every)
            if self.stop.is_set():
                self.reason = "stopped"
                break
            self.produced += 1
            self.out.put_nowait(piece)
        else:
            if self.failure is not None:
                self.out.put_nowait(self.failure)
                self.ended.set()
                self.finish(self.produced)
                return
            self.reason = "length"
        self.out.put_nowait(None)
        self.ended.set()
        self.finish(self.produced)


class FakeReader:
    """A reader's connection as an Answer watches it: `leave()` is its end-of-file."""

    def __init__(self):
        self.gone, self.eof = False, asyncio.Event()

    def leave(self):
        self.eof.set()

    async def watch(self, job):
        await self.eof.wait()
        self.gone = True
        job.stop.set()


def answers(ping=15.0, naive=False):
    state = ServerState()
    return Answers(Metrics(lambda: 0, lambda: 0, lambda: 0), state, ping, naive), state


def outcomes(a):
    """The streaming_requests counter by (endpoint, outcome), from the Prometheus text."""
    found = {}
    for family in text_string_to_metric_families(a.metrics.text().decode()):
        for s in family.samples:
            if s.name == "streaming_requests_total" and s.value:
                found[(s.labels["endpoint"], s.labels["outcome"])] = s.value
    return found


def test_a_whole_answer_relays_every_piece_and_is_logged_as_finished():
    async def run():
        a, _ = answers()
        job, reader, got = ScriptedJob(["a", "b", "c"]).start(), FakeReader(), []

        async def deliver(text):
            got.append(text)
            return True

        async with Answer(a, job, "/stream", watch=reader) as answer:
            await answer.relay(deliver)
        return a, answer, got

    a, answer, got = asyncio.run(run())
    assert got == ["a", "b", "c"] and not answer.left and answer.produced == 3
    assert list(a.log) == [["/stream", 3, False]] and len(answer.arrivals) == 3
    assert outcomes(a) == {("/stream", "finished"): 1.0}


def test_a_reader_who_leaves_stops_the_job_at_once_and_gets_no_end():
    async def run():
        a, _ = answers()
        job, reader = ScriptedJob(["x"] * 100, every=0.01).start(), FakeReader()
        got = []

        async def deliver(text):
            got.append(text)
            if len(got) == 5:
                reader.leave()  # end-of-file on the request side, as a closed tab sends
            return True

        async with Answer(a, job, "/complete", watch=reader) as answer:
            await answer.relay(deliver)
        return a, answer, job

    a, answer, job = asyncio.run(run())
    assert answer.left and job.reason == "stopped" and answer.produced <= 7  # within a piece or two
    assert list(a.log) == [["/complete", answer.produced, True]]
    assert outcomes(a) == {("/complete", "reader_left"): 1.0}


@pytest.mark.parametrize("naive", [False, True])
def test_a_reader_who_cannot_take_a_piece_has_left_unless_the_server_is_naive(naive):
    async def run():
        a, _ = answers(naive=naive)
        job = ScriptedJob(["x"] * 50, every=0.001).start()
        tries = []

        async def deliver(text):
            tries.append(text)
            return len(tries) < 3  # the third write fails: the reader is gone

        async with Answer(a, job, "/stream", watch=FakeReader()) as answer:
            await answer.relay(deliver)
        return answer, tries

    answer, tries = asyncio.run(run())
    assert answer.left
    if naive:  # the article's naive server: every token generated, for nobody, none sent after
        assert answer.produced == 50 and len(tries) == 3
    else:
        assert answer.produced <= 5 and len(tries) == 3


def test_a_stop_the_reader_says_is_logged_as_such_and_counted_stopped():
    async def run():
        a, _ = answers()
        job = ScriptedJob(["x"] * 100, every=0.01).start()

        async def deliver(_text):
            if job.produced == 4:
                job.stop.set()  # {"stop": true} on a WebSocket
            return True

        async with Answer(a, job, "/ws", early=Early.SAID_STOP) as answer:
            await answer.relay(deliver)
        return a, answer

    a, answer = asyncio.run(run())
    assert not answer.left and answer.produced <= 5
    assert list(a.log) == [["/ws", answer.produced, True]]
    assert outcomes(a) == {("/ws", "stopped"): 1.0}


def test_silence_calls_the_keep_alive_and_a_failed_one_means_the_reader_left():
    async def run():
        a, _ = answers(ping=0.05)
        job = ScriptedJob(["x", "y"], every=0.3).start()
        pings = []

        async def keep_alive():
            pings.append(1)
            return len(pings) < 3

        async def deliver(_text):
            return True

        async with Answer(a, job, "/stream") as answer:
            await answer.relay(deliver, keep_alive)
        return answer, job, pings

    answer, job, pings = asyncio.run(run())
    assert len(pings) == 3 and answer.left and job.reason == "stopped" and answer.produced == 0


def test_a_stop_string_found_by_the_delivery_ends_the_answer_and_its_count():
    """As the APIs' streams do (v1.stream): the delivery finds the stop string and says matched();
    the job stops, the pieces that still come go nowhere, and the usage counts the pieces taken."""
    from streaming.wire.stops import StopMatcher

    async def run():
        a, _ = answers()
        job, got, matcher = ScriptedJob(["Hel", "lo", " wo", "rld", "!"]).start(), [], StopMatcher(["o w"])

        async def deliver(text):
            if matcher.matched is None:
                got.append(matcher.push(text))
                if matcher.matched is not None:
                    answer.matched()
            return True

        async with Answer(a, job, "/v1/chat/completions") as answer:
            await answer.relay(deliver)
        return got, matcher.matched, job, answer

    got, matched, job, answer = asyncio.run(run())
    assert "".join(got) == "Hell" and matched == "o w" and job.stop.is_set()
    assert answer.matched_at is not None and answer.counted() <= answer.matched_at


# --- errors: the job's failure, before the head and after it, and the shutdown's cut -----------


class FakeWriter:
    def __init__(self, conn):
        self.conn = conn

    async def drain(self):
        pass


class FakeConnection:
    """What an Exchange writes through, collecting the bytes."""

    def __init__(self):
        self.out, self.gone, self.spoilt, self.closing = bytearray(), False, False, False
        self.writer = FakeWriter(self)

    def write(self, data):
        self.out += data

    async def send(self, data, _timeout):
        self.out += data
        return True

    async def drain(self, _timeout):
        return True

    def stream_buffers(self):
        pass

    def no_more_requests(self):
        self.spoilt = True


def request(path="/stream"):
    return Request("POST", path, "HTTP/1.1", {"content-type": "application/json"}, path=path)


def head_and_body(raw):
    reader = ResponseReader()
    reader.feed(bytes(raw))
    reader.feed_eof()
    head, body = reader.next_event(), b""
    while (event := reader.next_event()) is not END:
        body += event
    return head, body


def test_a_failed_job_is_a_500_in_the_familys_shape_before_the_head():
    async def run():
        a, _ = answers()
        conn = FakeConnection()
        ex = Exchange(conn, request("/v1/chat/completions"), keep_alive=True)
        ex.format = OpenAI()
        job = ScriptedJob(["a"], fail=RuntimeError("boom")).start()
        try:
            async with Answer(a, job, "/v1/chat/completions") as answer:
                async for _ in answer.pieces():
                    pass
        except ProtocolError as e:
            await ex.fail(e)
        return a, conn, ex

    a, conn, ex = asyncio.run(run())
    head, body = head_and_body(conn.out)
    assert head.status == 500 and head.headers["connection"] == "close" and not ex.reusable
    assert b'"type": "server_error"' in body and b"generation failed" in body and b"boom" not in body
    assert list(a.log) == [["/v1/chat/completions", 1, False]]
    assert outcomes(a) == {("/v1/chat/completions", "error"): 1.0}


@pytest.mark.parametrize("path", ["/complete", "/v1/chat/completions"])
def test_a_job_refused_at_admission_is_the_familys_invalid_request_not_a_500(path):
    """An engine refuses an id past the model's vocabulary (Job.begin; a stream taken over from a
    store can hold one) with InvalidRequest in the job's queue: the request's fault, so the
    exchange says it as a request check (422 ours, 400 the APIs', a close 1008), never as a 500
    "generation failed", and the answer is still logged."""

    async def run():
        a, _ = answers()
        conn = FakeConnection()
        ex = Exchange(conn, request(path), keep_alive=True)
        ex.format = OpenAI() if path.startswith("/v1/") else None
        job = ScriptedJob([], fail=InvalidRequest("token id 151936 is not in the model's vocabulary")).start()
        try:
            async with Answer(a, job, path) as answer:
                async for _ in answer.pieces():
                    pass
        except (ProtocolError, InvalidRequest) as e:  # as protocol.py's exchange catches them
            assert isinstance(e, InvalidRequest)
            await ex.fail(e)
        return a, conn, ex

    a, conn, ex = asyncio.run(run())
    head, body = head_and_body(conn.out)
    assert head.status == (400 if path.startswith("/v1/") else 422) and not ex.reusable
    assert b"token id 151936 is not in the model" in body and b"generation failed" not in body
    assert b"invalid_request" in body and list(a.log) == [[path, 0, False]]


def test_after_the_head_an_error_is_the_streams_own_event_never_a_status():
    async def run():
        a, _ = answers()
        conn = FakeConnection()
        ex = Exchange(conn, request())

        async def ending(err):
            await ex.send(b"event: error\ndata: " + err.message.encode() + b"\n\n")

        ex.start_stream([("Content-Type", "text/event-stream")], ending)
        job = ScriptedJob(["a", "b"], fail=RuntimeError("boom")).start()

        async def deliver(text):
            return await ex.send(f"data: {text}\n\n".encode())

        try:
            async with Answer(a, job, "/stream") as answer:
                await answer.relay(deliver)
        except ProtocolError as e:
            await ex.fail(e)
        return conn, ex

    conn, ex = asyncio.run(run())
    head, body = head_and_body(conn.out)
    assert head.status == 200 and head.headers["connection"] == "close" and ex.progress is Progress.STREAMING
    events = EventParser().feed(body)
    assert [e.data for e in events] == ["a", "b", FAILED] and events[-1].event == "error"


def test_the_shutdown_cuts_an_answer_short_with_a_503_but_not_one_whose_reader_left():
    async def run(leave):
        a, state = answers()
        job, reader = ScriptedJob(["x"] * 100, every=0.01).start(), FakeReader()

        async def deliver(_text):
            if job.produced == 3:
                state.phase = Phase.CLOSING  # the grace is over:
                job.stop.set()  # the backend stops every job (Backend.stop_all)
                if leave:
                    reader.leave()
            return True

        try:
            async with Answer(a, job, "/stream", watch=reader) as answer:
                await answer.relay(deliver)
        except ProtocolError as e:
            return e, a.log
        return None, a.log

    cut, log = asyncio.run(run(leave=False))
    assert cut is not None and cut.status == 503 and cut.kind == "shutting_down" and cut.close_code == 1001
    assert log[0][2] is False  # logged, as every answer is
    cut, log = asyncio.run(run(leave=True))
    assert cut is None and log[0][2] is True


def test_a_whole_response_keeps_the_connection_and_a_request_check_is_the_familys_status():
    conn = FakeConnection()
    ex = Exchange(conn, request("/complete"), keep_alive=True)
    ex.cors = [("Access-Control-Allow-Origin", "http://a.example")]
    ex.respond_json(200, {"text": "hi"})
    head, body = head_and_body(conn.out)
    assert head.headers["connection"] == "keep-alive" and head.headers["access-control-allow-origin"]
    assert ex.reusable and body == b'{"text": "hi"}'
    ours, api = Exchange(FakeConnection(), request()), Exchange(FakeConnection(), request())
    api.format = OpenAI()
    bad = InvalidRequest("temperature must be from 0 to 2", "temperature")
    assert ours.problem(bad).status == 422 and api.problem(bad).status == 400
    assert ours.problem(bad).close_code == 1008  # on a WebSocket: a close 1008


# --- a resumable stream's pump: it waits for its readers, here or on another replica ----------------


def test_the_pump_waits_for_its_readers_and_goes_on_when_one_reads_elsewhere():
    from streaming.server.resumable import pump as pumping
    from streaming.server.resumable.recordings import Recording

    async def until(condition):
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the condition never held")

    async def run(naive=False):
        a, _ = answers(naive=naive)
        job = ScriptedJob(["x"] * 10_000, every=0.0005).start()  # (still generating throughout)
        rec = Recording("S", job)
        task = asyncio.create_task(pumping.pump(a, rec, Article()))
        await until(lambda: job.produced > pumping.UNREAD + 150)  # well past the mark
        held = len(rec.events)  # nobody has been sent anything
        rec.read_elsewhere(10.0, 100)  # a reader on another replica has had 100 events
        await until(lambda: job.produced > pumping.UNREAD + 300)
        moved = len(rec.events)
        job.stop.set()  # (its grace ran out): the rest goes into the recording, then its end
        await asyncio.wait_for(task, 5)
        return held, moved, rec

    held, moved, rec = asyncio.run(run())
    assert held == pumping.UNREAD + 1 and moved == 100 + pumping.UNREAD + 1 and rec.ended
    held, _, rec = asyncio.run(run(naive=True))  # the naive server generates every token for nobody
    assert held > pumping.UNREAD + 100 and rec.ended


def test_a_resumable_streams_job_refused_at_admission_ends_its_recording_with_an_invalid_request():
    """A stream taken over from a store whose answer so far holds an id past the vocabulary: its
    engine refuses the job at admission (InvalidRequest), and the pump ends the recording with the
    request's own error event (422 invalid_request), not a 500, and not a pump task that dies
    with the recording left open for its readers."""
    from streaming.server.resumable import pump as pumping
    from streaming.server.resumable.recordings import Recording

    async def run():
        a, _ = answers()
        job = ScriptedJob([], fail=InvalidRequest("token id 151943 is not in the model's vocabulary")).start()
        rec = Recording("S", job)
        await asyncio.wait_for(pumping.pump(a, rec, Article()), 5)
        return rec

    rec = asyncio.run(run())
    events = EventParser().feed(b"".join(rec.events))
    assert rec.ended and events[-1].event == "error"
    said = "token id 151943 is not in the model's vocabulary"
    assert json.loads(events[-1].data)["error"] == {"status": 422, "type": "invalid_request", "message": said}
