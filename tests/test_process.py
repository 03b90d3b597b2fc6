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

import pytest
from helpers import ServerProcess, http, job_text, metrics, server_log, wait_for_log
from test_resume import drop_and_resume
from test_server import read_events_then_leave

import lm
from streaming.generation.batched import PREFILL_CHUNK
from streaming.generation.job import JobOptions
from streaming.generation.kv import KV_MEMORY
from streaming.generation.policy import Fifo
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.process import EngineProcess, ProcessJob
from streaming.generation.process_child import EngineSettings
from streaming.generation.waiting import MAX_WAITING
from streaming.model.loading import Model
from streaming.wire.errors import InvalidRequest
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
    model = Model(dataclasses.replace(lm.handle().choice))  # its own: the engine process tells it its context
    settings = EngineSettings(
        model.choice, JobOptions(), Fifo(), 2, PREFILL_CHUNK, MAX_WAITING, KV_MEMORY, RETAIN_MEMORY
    )
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
