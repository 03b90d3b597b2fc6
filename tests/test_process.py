"""`--engine process` (streaming/generation/process.py): the batched engine in a process of its own.

Real server processes over real sockets: the same text as the batched engine in the server's
process; a reader who leaves stops the engine process within a step; a queue's places reach the
waiting reader; a killed engine process is an error to every reader it served (not a hang), a new
one serves the next request; a resumable stream resumes; a server shut down leaves no engine
process behind. And an engine process driven from the test's own loop: a request it refuses at
admission is the InvalidRequest it was, across the pipe.
"""

import asyncio
import dataclasses
import json
import os
import signal
import threading
import time

import fake_engines
import pytest
from helpers import ServerProcess, http, job_text, metrics, server_log, wait_for_log
from test_resume import drop_and_resume
from test_server import read_events_then_leave

import lm
from streaming.generation import process
from streaming.generation.batched import PREFILL_CHUNK
from streaming.generation.job import JobOptions
from streaming.generation.kv import KV_MEMORY
from streaming.generation.policy import Fifo
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.process import EngineProcess, ProcessJob
from streaming.generation.process_child import EngineSettings
from streaming.generation.waiting import MAX_WAITING
from streaming.model.loading import Model
from streaming.wire.errors import InvalidRequest, ProtocolError
from streaming.wire.params import plain_request

PROCESS = ("--engine", "process", "--token-delay", "0.02", "--ping", "0.2", "--max-batch", "2")


@pytest.fixture(scope="module")
def engine_process():
    s = ServerProcess(*PROCESS)
    try:
        yield s.wait()
    finally:
        s.stop()


def alive(pid):
    """Whether a process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def stream(port, n, out, name):
    out[name] = http(port, "POST", "/stream", {"prompt": "Hello", "max_tokens": n, "ignore_eos": True})


def test_the_engine_process_gives_the_batched_engines_text(servers, engine_process):
    body = {"prompt": "The capital of France", "max_tokens": 30, "seed": 4, "temperature": 0}
    texts = [
        json.loads(http(p, "POST", "/complete", body)[2])["text"] for p in (servers["plain"].port, engine_process.port)
    ]
    assert texts[0] == texts[1]
    m = metrics(engine_process.port)
    assert m["engine"] == "process" and m["steps"] > 0 and m["model"] == "tiny"
    assert m["engine_pid"] != engine_process.proc.pid and alive(m["engine_pid"])


def test_a_reader_leaving_stops_the_engine_process_within_a_step(engine_process):
    port = engine_process.port
    before, m0 = len(server_log(port)), metrics(port)
    read_events_then_leave(port, {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True}, 10)
    path, generated, left = wait_for_log(port, before + 1)[-1]
    assert path == "/stream" and left is True and generated <= 12
    deadline = time.monotonic() + 10
    while (m1 := metrics(port))["active"] and time.monotonic() < deadline:  # the engine's own report
        time.sleep(0.05)
    assert m1["active"] == 0 and m1["requests_stopped"] - m0["requests_stopped"] == 1
    assert m1["tokens_after_stop"] - m0["tokens_after_stop"] <= 1  # at most the token being computed


def test_a_request_beyond_max_batch_is_told_its_place(engine_process):
    port, results = engine_process.port, {}
    first = [threading.Thread(target=stream, args=(port, 60, results, i)) for i in range(2)]
    for t in first:
        t.start()
    while metrics(port)["active"] < 2:
        time.sleep(0.01)
    stream(port, 3, results, "third")  # --max-batch 2: it waits for one of the first two
    for t in first:
        t.join()
    body = results["third"][2]
    assert b": waiting for a place in the batch, 0 ahead" in body.split(b"data: {")[0]
    assert body.rstrip().endswith(b"data: [DONE]")


def test_a_reader_who_drops_resumes_and_nothing_is_generated_twice(engine_process):
    drop_and_resume(engine_process.port)


@pytest.mark.parametrize("where", ["prompt", "answer so far"])
def test_an_id_past_the_vocabulary_is_the_engine_processs_invalid_request_not_a_failure(where):
    """As the batched engine in the server's process (test_engine.py), the engine process refuses
    such an id at admission, before any kernel (on a GPU it would end the CUDA context for every
    request after it); its refusal crosses the pipe as the InvalidRequest it is, message, param and
    status, so that the server says it in the endpoint's own shape (a 4xx, a close 1008), not as a
    500 "generation failed". The next request is served. An answer's tokens taken over from a
    store (`prior`) can hold such an id; the tokenizer makes none."""
    size = lm.handle().vocabulary()
    model, settings = own_settings()
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
    ids = lm.tok("Hello").input_ids
    prompt, prior, bad = (ids + [size], [], size) if where == "prompt" else (ids, [5, size + 7], size + 7)

    async def run():
        engine = EngineProcess(model, settings)
        try:
            await engine.start()
            with pytest.raises(InvalidRequest) as refused:
                await job_text(ProcessJob(engine, prompt, plain_request(body).params, prior=prior).start())
            return refused.value, await job_text(ProcessJob(engine, ids, plain_request(body).params).start()), engine
        finally:
            await asyncio.to_thread(engine.close)

    refused, good, engine = asyncio.run(run())
    assert f"token id {bad} is not in the model's vocabulary" in refused.message and refused.status == 422
    assert good and engine.jobs == {} and engine.restarts == 0


def test_a_killed_engine_process_is_an_error_to_every_reader_and_a_new_one_serves(engine_process):
    port, results = engine_process.port, {}
    old = metrics(port)["engine_pid"]
    readers = [threading.Thread(target=stream, args=(port, 4000, results, i)) for i in range(2)]
    for t in readers:
        t.start()
    while metrics(port)["active"] < 2:
        time.sleep(0.01)
    os.kill(old, signal.SIGKILL)
    for t in readers:
        t.join(30)
        assert not t.is_alive(), "a reader hung after the engine process died"
    for i in range(2):
        status, _, body = results[i]
        assert status == 200 and b"the engine process exited" in body and b"data: [DONE]" not in body
    states = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not states or states[-1] != 200):
        states.append(http(port, "GET", "/ready")[0])
        time.sleep(0.1)
    assert states[-1] == 200 and 503 in states  # not ready while the new one loads
    status, _, body = http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 5})
    assert status == 200 and json.loads(body)["text"]
    m = metrics(port)
    assert m["engine_restarts"] == 1 and m["engine_pid"] != old and not alive(old)
    assert engine_process.wait_line("engine process exited (code -9): starting a new one")


def test_a_server_shut_down_leaves_no_engine_process(engine_process):
    pid = metrics(engine_process.port)["engine_pid"]
    assert engine_process.stop() == 0
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def own_settings():
    model = Model(dataclasses.replace(lm.handle().choice))  # its own: the engine process tells it its context
    return model, EngineSettings(
        model.choice, JobOptions(), Fifo(), 2, PREFILL_CHUNK, MAX_WAITING, KV_MEMORY, RETAIN_MEMORY
    )


@pytest.mark.parametrize("fake", ["sends_bytes_that_are_no_message", "sends_a_message_out_of_the_protocol"])
def test_an_engine_process_that_garbles_its_pipe_is_stopped_and_its_readers_told(monkeypatch, fake):
    """Bytes that do not unpickle ended the server's receiving thread quietly: the process lived
    on, nothing restarted it, and every reader waited for good. A message not of the protocol (a
    piece cut short, in a step's batch) failed on the loop and dropped the rest of its batch, ends
    included. Either way the process is now killed: its readers get the restart's error, and a
    new one is started."""
    monkeypatch.setattr(process, "engine_main", getattr(fake_engines, fake))
    model, settings = own_settings()
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True}

    async def run():
        engine = EngineProcess(model, settings)
        try:
            assert await engine.start() == "a fake engine"
            job = ProcessJob(engine, lm.tok("Hello").input_ids, plain_request(body).params).start()
            with pytest.raises(ProtocolError) as told:
                await asyncio.wait_for(job_text(job), 20)
            while not engine.ready:  # the new one
                await asyncio.sleep(0.05)
            return told.value, engine
        finally:
            await asyncio.to_thread(engine.close)

    told, engine = asyncio.run(run())
    assert "the engine process exited" in told.message and told.status == 503
    assert engine.restarts == 1 and engine.jobs == {}


def test_a_stopped_engine_process_never_blocks_the_loop_and_is_replaced_past_the_stall(monkeypatch):
    """SIGSTOP (a process stuck in a kernel looks the same): a send from the loop waited on the
    full pipe for good, so the server stopped answering anyone, and nothing noticed the silence.
    Now sends go through a thread of their own, and an engine process silent for STALL s with
    requests is killed: its readers get the restart's error, and a new one serves."""
    monkeypatch.setattr(process, "STALL", 2.0)
    model, settings = own_settings()
    body = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}
    ids = lm.tok("Hello").input_ids

    async def run():
        engine = EngineProcess(model, settings)
        try:
            await engine.start()
            params = plain_request(body).params
            long = ProcessJob(engine, ids, params).start()
            assert await long.get() is not None  # it runs
            os.kill(engine.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            many = [ProcessJob(engine, ids * 1000, params).start() for _ in range(300)]  # past the pipe's buffer
            for job in many:
                job.stop.set()
            queued = time.monotonic() - t0
            with pytest.raises(ProtocolError) as told:
                await asyncio.wait_for(job_text(long), 30)
            while not engine.ready:
                await asyncio.sleep(0.05)
            short = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
            text = await asyncio.wait_for(job_text(ProcessJob(engine, ids, plain_request(short).params).start()), 30)
            return queued, told.value, text, engine
        finally:
            await asyncio.to_thread(engine.close)

    queued, told, text, engine = asyncio.run(run())
    assert queued < 2, queued  # (before: the loop blocked in the first send past the buffer, for good)
    assert "the engine process exited" in told.message and text and engine.restarts == 1
