"""The step-batched engine (streaming/generation/batched.py) in process: joining and leaving
mid-batch, stop flags within one step, KV rows released, seeds giving the text of a request
alone, chunked prefill, the queue beyond max_batch; and the server's --engine and /metrics.

What the engine promises is checked two ways, so that it holds on every CPU and in every dtype:
- the plumbing (each row's own generator, detokenizer and queue; joining, leaving, padding and
  compacting the cache) with the `exact` model, whose logits are small integers that depend on
  a row's own tokens only: there a batch must give exactly the texts of the thread engine;
- the arithmetic with the tiny real model: each row's logits in a batch equal its logits alone
  within a stated tolerance (padding changes the shapes of the sums, so the last bits differ).
Both in float32 and bfloat16 (emulated, slower, on a CPU without native bf16: kept small)."""

import asyncio
import functools
import json
import threading

import pytest
import torch
from helpers import TOLERANCE, ServerProcess, http, metrics, model_of

import lm
import server
from streaming.generation.batch import Batch
from streaming.generation.batched import (
    BF16_CPU_MAX_BATCH,
    GPU_MAX_BATCH,
    MAX_BATCH,
    BatchedJob,
    BatchEngine,
    default_max_batch,
)
from streaming.generation.kv import GPU_KV_SHARE, KV_MEMORY, default_kv_memory
from streaming.generation.thread import ThreadJob
from streaming.model.choice import cpu_has_bf16
from streaming.model.testing import ExactModel, tiny_model
from streaming.wire.errors import InvalidRequest
from streaming.wire.params import GenerationParams, plain_request

PROMPTS = [
    "Hello there",
    "The lighthouse keeper wrote in his log every night about the sea and the ships",
    "a",
    "Once upon a time in a land far away",
    "x y z",
]
DTYPES = [torch.float32, torch.bfloat16]


def params(i, n=20, greedy=None):
    temperature = 0 if (greedy if greedy is not None else i % 2) else 1.0
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": n, "seed": i, "temperature": temperature}
    return plain_request(body).params


def ids(i):
    return lm.tok(PROMPTS[i % len(PROMPTS)]).input_ids


def exact(dtype):
    return ExactModel(lm.load_tokenizer()).to(dtype)


async def text(job, on_piece=None):
    out = []
    while (x := await job.get()) is not None:
        if isinstance(x, BaseException):
            raise x
        out.append(x)
        if on_piece:
            on_piece(len(out))
    return "".join(out), await job.done


async def settled(e, timeout=10.0):
    """Until the engine's thread has compacted its finished rows (a reader gets its end from
    inside the step, before the step frees the row's slot), at most `timeout` seconds."""
    for _ in range(int(timeout / 0.01)):
        if not e.batch.rows and e.batch.kv.rows() == 0:
            return
        await asyncio.sleep(0.01)


async def alone_with_threads(net, n=20):
    return [await text(ThreadJob(ids(i), params(i, n), model=model_of(net)).start()) for i in range(len(PROMPTS))]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_alone_and_together_give_the_thread_engines_text(dtype):
    net = exact(dtype)

    async def run():
        e = BatchEngine(max_batch=8, prefill_chunk=8, model=model_of(net))
        expected = await alone_with_threads(net)
        alone = [await text(BatchedJob(e, ids(i), params(i)).start()) for i in range(len(PROMPTS))]
        together = await asyncio.gather(*(text(BatchedJob(e, ids(i), params(i)).start()) for i in range(5)))
        return expected, alone, together

    expected, alone, together = asyncio.run(run())
    assert len({t for t, _ in expected}) == len(PROMPTS)  # five different answers
    assert alone == expected  # greedy and seeded sampling alike
    assert list(together) == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_requests_join_and_leave_mid_batch_and_the_cache_keeps_only_live_rows(dtype):
    net = exact(dtype)

    async def run():
        e = BatchEngine(max_batch=8, prefill_chunk=64, model=model_of(net))
        expected = await alone_with_threads(net, 30)
        first = [BatchedJob(e, ids(i), params(i, 30)).start() for i in range(3)]
        started = asyncio.Event()
        tasks = [asyncio.ensure_future(text(j, lambda k: k >= 5 and started.set())) for j in first]
        await started.wait()  # the first three are mid-answer: two more join
        late = [BatchedJob(e, ids(i), params(i, 30)).start() for i in (3, 4)]
        results = await asyncio.gather(*tasks, *(text(j) for j in late))
        await settled(e)
        return expected, results, e

    expected, results, e = asyncio.run(run())
    assert list(results) == expected
    assert e.batch.rows == [] and len(e.batch.kv) == 0 and e.batch.kv.rows() == 0  # every finished row's KV is gone


class RecordingBatch(Batch):
    """A batch that feeds every row the same fixed tokens and records each row's logits."""

    FEED = [100 + 37 * k for k in range(12)]

    def __init__(self, *args):
        super().__init__(*args)
        self.logits = {}

    def emit(self, rows, logits):
        for row, row_logits in zip(rows, logits, strict=True):
            seen = self.logits.setdefault(tuple(row.ids), [])
            seen.append(row_logits.float().clone())
            row.next = self.FEED[len(seen) - 1]
            if len(seen) == len(self.FEED):
                row.done = True
                row.job.end("length")


class Recording(BatchEngine):
    """An engine whose batch is a RecordingBatch."""

    def __init__(self, **kw):
        super().__init__(**kw)
        b = self.batch
        b.policy.speculate = 0  # it feeds its own tokens: no guesses (their logits would be recorded too)
        self.batch = RecordingBatch(b.model, b.chunk, b.policy, b.clock, b.waiting, b.lock)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_logits_in_a_batch_equal_its_logits_alone_within_the_tolerance(dtype):
    net = tiny_model(lm.load_tokenizer()).to(dtype).eval()

    async def run(together):
        e = Recording(max_batch=8, prefill_chunk=8, model=model_of(net))
        jobs = []
        for i in range(len(PROMPTS)):  # each alone (the one before it has ended), or all in one batch
            jobs.append(BatchedJob(e, ids(i), GenerationParams(max_tokens=100)).start())
            if not together:
                await jobs[-1].done
        await asyncio.gather(*(j.done for j in jobs))
        return e.batch.logits

    alone, batched = asyncio.run(run(False)), asyncio.run(run(True))
    assert set(alone) == set(batched) and all(len(v) == len(RecordingBatch.FEED) for v in batched.values())
    scale = max(float(x.abs().max()) for steps in alone.values() for x in steps)
    worst = max(float((a - b).abs().max()) for k in alone for a, b in zip(alone[k], batched[k], strict=True))
    assert worst <= TOLERANCE[dtype] * scale, f"{worst} against {scale}"


def test_a_stop_is_honoured_within_one_step_and_its_rows_leave_the_cache():
    async def run():
        e = BatchEngine(lm.handle(), max_batch=8, token_delay=0.01)
        jobs = [BatchedJob(e, ids(i), params(i, 2000)).start() for i in range(4)]
        seen = {}

        def stop_at(job, k):
            if k >= 5 and not job.stop.is_set():
                job.stop.set()

        victim = jobs[1]
        task = asyncio.ensure_future(text(victim, lambda k: stop_at(victim, k)))
        await task
        await asyncio.sleep(0.1)
        seen["batch"] = len(e.batch.kv)  # slots in use
        seen["rows"] = len(e.batch.rows)
        for j in jobs:
            j.stop.set()
        await asyncio.gather(*(j.done for j in jobs))
        return victim, seen, jobs

    victim, seen, jobs = asyncio.run(run())
    assert victim.reason == "stopped" and victim.produced - victim.stop.at <= 1
    assert seen == {"batch": 3, "rows": 3}  # the stopped row left its slot of the KV cache
    assert all(j.produced - j.stop.at <= 1 for j in jobs)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_keep_going():
    net = exact(torch.float32)

    async def run():
        e = BatchEngine(max_batch=8, prefill_chunk=4, token_delay=0.005, model=model_of(net))
        running = BatchedJob(e, ids(0), params(0, 400, greedy=True)).start()
        counts = []
        task = asyncio.ensure_future(text(running, counts.append))
        while not counts:
            await asyncio.sleep(0.01)
        long_ids = ids(1) * 6  # ~100 tokens: 25 chunks of 4
        before = running.produced
        joined = BatchedJob(e, long_ids, params(1, 3, greedy=True)).start()
        long_text = await text(joined)
        during = running.produced - before
        running.stop.set()
        await task
        alone = await text(ThreadJob(long_ids, params(1, 3, greedy=True), model=model_of(net)).start())
        return during, len(long_ids), long_text, alone

    during, n, long_text, alone = asyncio.run(run())
    assert during >= n // 4  # a decode step for the running reader between every chunk
    assert long_text == alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_requests_beyond_max_batch_wait_their_turn(dtype):
    net = exact(dtype)

    async def run():
        e = BatchEngine(max_batch=2, token_delay=0.01, model=model_of(net))
        expected = await alone_with_threads(net, 10)
        jobs = [BatchedJob(e, ids(i), params(i, 10)).start() for i in range(5)]
        await asyncio.sleep(0.05)
        m = e.metrics()
        results = await asyncio.gather(*(text(j) for j in jobs))
        return m, expected, results

    m, expected, results = asyncio.run(run())
    assert m["active"] <= 2 and m["waiting"] >= 2
    assert list(results) == expected


def test_a_failed_step_fails_its_requests_not_the_engine(monkeypatch):
    head = lm.handle().net.lm_head  # called by every pass (the engine's own, decoder.py, and the model's forward)
    forward = head.forward
    failed = []

    def fails_once(*args, **kw):
        if not failed:
            failed.append(True)
            raise RuntimeError("a kernel failed")
        return forward(*args, **kw)

    monkeypatch.setattr(head, "forward", fails_once)

    async def run():
        e = BatchEngine(lm.handle(), max_batch=4)
        with pytest.raises(RuntimeError, match="a kernel failed"):
            await text(BatchedJob(e, ids(0), params(0)).start())
        return await text(BatchedJob(e, ids(0), params(0)).start()), e

    (good, _), e = asyncio.run(run())
    assert failed and good and e.thread.is_alive()


@pytest.mark.parametrize("where", ["prompt", "answer so far"])
def test_an_id_past_the_vocabulary_fails_its_request_before_any_step(where):
    """Such an id would be an index error on a CPU, but on a GPU a device-side assert that ends the
    process's CUDA context for every request after it (seen on an H200): refused at admission, on
    every device. The tokenizer makes no such id; an answer's tokens taken over from a store can."""
    size = lm.handle().vocabulary()

    async def run():
        e = BatchEngine(lm.handle(), max_batch=4)
        prompt, prior, bad = (ids(0) + [size], [], size) if where == "prompt" else (ids(0), [5, size + 7], size + 7)
        with pytest.raises(InvalidRequest, match=f"token id {bad} "):
            await text(BatchedJob(e, prompt, params(0), prior=prior).start())
        good = await text(BatchedJob(e, ids(0), params(0)).start())
        await settled(e)
        return good, e

    (good, _), e = asyncio.run(run())
    assert good and e.thread.is_alive() and e.batch.kv.rows() == 0


@pytest.mark.parametrize("engine", ["batched", "thread"])
def test_an_answer_whose_tokens_so_far_reach_max_tokens_ends_at_its_length_with_no_new_token(engine):
    """A stream taken over after its last token but before its end was recorded: both engines
    end it at once, reason "length", no token past max_tokens (the batched one gave one more)."""
    prior = [5, 6, 7, 8, 9]

    async def run():
        e = BatchEngine(lm.handle(), max_batch=4)
        make = (
            functools.partial(BatchedJob, e) if engine == "batched" else functools.partial(ThreadJob, model=lm.handle())
        )
        job = make(ids(0), params(0, n=len(prior)), prior=prior).start()
        out = await text(job)
        later = await text(make(ids(1), params(1, n=3)).start())  # the engine goes on
        return job, out, later, e

    job, (out, produced), (later, _), e = asyncio.run(run())
    assert (out, produced, job.reason) == ("", len(prior), "length") and later
    assert engine == "thread" or e.batch.tokens == 3  # the batch generated only the next request's


def test_a_call_runs_on_the_engines_own_thread_between_steps_and_brings_back_its_result_or_error():
    """The model is loaded through BatchEngine.call (Backend.load), so torch's kernels run in the
    thread that loaded them; a failed call is its caller's error and the engine goes on."""

    def boom():
        raise ValueError("no model here")

    async def run():
        e = BatchEngine(model_of(exact(torch.float32)), max_batch=2)
        name = await asyncio.wrap_future(e.call(lambda: threading.current_thread().name))
        with pytest.raises(ValueError, match="no model here"):
            await asyncio.wrap_future(e.call(boom))
        return name, await text(BatchedJob(e, ids(0), params(0, 5)).start()), e

    name, out, e = asyncio.run(run())
    assert name == "engine" == e.thread.name and out and e.thread.is_alive()


# --- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    servers = [
        ServerProcess("--engine", "thread"),
        ServerProcess("--max-batch", "1", "--ping", "0.2", "--token-delay", "0.05"),
    ]
    try:
        yield [s.wait() for s in servers]
    finally:
        for s in servers:
            s.stop()


def test_both_engines_give_the_same_text(servers, pair):
    body = {"prompt": PROMPTS[1], "max_tokens": 30, "seed": 4, "temperature": 0}
    texts = [json.loads(http(p, "POST", "/complete", body)[2])["text"] for p in (servers["plain"].port, pair[0].port)]
    assert texts[0] == texts[1]
    assert metrics(pair[0].port)["engine"] == "thread" and metrics(servers["plain"].port)["engine"] == "batched"


def test_metrics_show_the_engine(servers):
    port = servers["plain"].port
    http(port, "POST", "/complete", {"prompt": "Hi", "max_tokens": 5})
    m = metrics(port)
    assert {"active", "waiting", "steps", "tokens_generated", "tokens_after_stop", "requests_stopped"} <= set(m)
    assert m["steps"] > 0 and m["tokens_generated"] >= 5 and m["max_batch"] == default_max_batch(lm.DEVICE, lm.dtype())
    assert m["kv_memory"] == default_kv_memory(lm.DEVICE)


def test_the_batch_and_its_kv_budget_are_sized_for_the_device():
    """Left out, --max-batch and --kv-memory are sized for the model's device (a GPU's step is
    launch-bound, so more rows cost next to nothing there); given, they are taken as given."""
    assert default_max_batch("cpu") == default_max_batch("mps") == MAX_BATCH
    assert default_max_batch("cuda") == default_max_batch("cuda:1") == GPU_MAX_BATCH
    assert default_max_batch("cpu", torch.float32) == default_max_batch("mps", torch.bfloat16) == MAX_BATCH
    native = BF16_CPU_MAX_BATCH if cpu_has_bf16() else MAX_BATCH  # a CPU's matrix units: more rows a step
    assert default_max_batch("cpu", torch.bfloat16) == native
    assert default_kv_memory("cpu") == default_kv_memory("mps") == KV_MEMORY
    assert default_kv_memory("cuda", total=141 << 30) == int(GPU_KV_SHARE * (141 << 30))
    assert default_kv_memory("cuda:0", total=6 << 30) == 3 << 30  # a small GPU: its share, not a CPU's 4 GiB
    left_out = server.config_of(server.parse_args(["--engine", "free"]), "cpu")
    assert (left_out.max_batch, left_out.kv_memory) == (default_max_batch("cpu", lm.dtype()), None)  # KV: the engine's
    given = server.config_of(server.parse_args(["--max-batch", "3", "--kv-memory", "0.5"]), "cuda")
    assert (given.max_batch, given.kv_memory) == (3, 1 << 29)
    assert server.config_of(server.parse_args(["--retain-memory", "0.5"]), "cpu").retain_memory == 1 << 29
    assert server.config_of(server.parse_args(["--retain-memory", "0"]), "cpu").retain_memory == 0
    for bad in (
        ["--max-batch", "0"],
        ["--kv-memory", "0"],
        ["--kv-memory", "inf"],
        ["--retain-memory", "-1"],
        ["--retain-memory", "inf"],
    ):
        with pytest.raises(SystemExit):
            server.parse_args(bad)

    async def run():  # the engine sizes a budget left out for its model's device
        e = BatchEngine(model_of(exact(torch.float32)), max_batch=4, kv_memory=None)
        await asyncio.gather(*(text(BatchedJob(e, ids(i), params(i, 5)).start()) for i in range(3)))
        return e.batch.kv_memory

    assert asyncio.run(run()) == KV_MEMORY


def test_a_request_beyond_max_batch_waits_with_keep_alive_pings(pair):
    port = pair[1].port  # --max-batch 1
    results = {}

    def stream(name, n):
        results[name] = http(port, "POST", "/stream", {"prompt": "Hello", "max_tokens": n, "ignore_eos": True})

    first = threading.Thread(target=stream, args=("first", 30))
    first.start()
    while metrics(port)["active"] == 0:
        pass
    second = threading.Thread(target=stream, args=("second", 3))
    second.start()
    while metrics(port)["waiting"] == 0 and first.is_alive():
        pass
    first.join()
    second.join()
    body = results["second"][2]
    assert b": waiting for a place in the batch, 0 ahead" in body.split(b"data: {")[0]  # told its place while it waited
    assert body.rstrip().endswith(b"data: [DONE]")
