"""What readers feel under load, at equal work, interleaved: this server against
`transformers serve --continuous-batching`, both up at once, each load run on one then the other.

    python scripts/bench.py qoe [--quick] [--rates 0.2,0.35,0.5,0.7,1.0,1.4] [--bursts 8,16,32,48]
                                [--configs qoe] [--no-peer] [--seconds 60]

A comparison that cannot flatter either side:

- **Equal work.** Every request asks for exactly its drawn number of tokens, and gets it: this
  server is told `ignore_eos`; `transformers serve` takes no such option and its continuous
  batching ignores `min_new_tokens`, but a `generation_config` JSON string in the body replaces
  its generation settings, and one whose end-of-sequence id is PEER_EOS (a padding row of the
  Qwen2.5 vocabulary, never sampled) makes it generate exactly `max_new_tokens`. Every answer's
  `usage.completion_tokens` is checked against what was asked; the table says how many differ.
- **QoE on tokens.** What arrived is re-tokenized at each arrival (the same tokenizer serves
  both), so a piece of several tokens counts them all, and the QoE (streaming/qoe.py, the Andes
  paper's) is the reader's timeline in tokens, whoever chose the piece sizes.
- **Interleaved.** Every server is up from the start (an idle one uses no CPU: measured and
  printed), and each load runs on one server then the other, the order alternating from load to
  load: these machines drift 2x within half an hour, so one server's whole sweep after the
  other's would compare two machines. Before each run every server must be quiet (settle(): a
  server still busy after the previous run, with leftovers or freeing memory, would steal the
  cores from the next one); a wait of a second or more is printed.
- **The noise, reported.** One reader alone (SINGLE tokens of each of SINGLE_PROMPTS prompts,
  one answer after the other) runs at the start and again at the end; the two figures show how
  much the machine moved meanwhile. Several answers, not one: a lone reader's speed with guessed
  tokens depends on the text (one 200-token answer that looped past the model's own end ran at
  55 tokens/s where the same server's median over 12 was 24).

Loads: Poisson arrivals at each rate (requests a second, for --seconds, else for SECONDS or long
enough to expect MIN_ARRIVALS, answers of LENGTHS tokens uniform) and bursts (N requests at once,
BURST_TOKENS each), OpenAI chat streams of the prompts in prompts.json at temperature 0.7, top_p
0.9. Per load and server: mean QoE, p10, the share of readers at QoE >= 0.95, TTFT p50/p99, gap p99
between pieces, tokens a second (by usage), and the ratio to the peer. Headlines: the sustainable
rate (the highest with mean QoE >= 0.95), readers served (the largest burst with 95% at >= 0.95),
and the issue's goals, each said met or not (the overload goal at the lowest measured rate of at
least twice the peer's sustainable one; where the peer held no rate, the most its ratio can be,
from the peer's QoE at the lowest measured rate at or past twice the lowest). Where a quantized
config runs beside its dense twin (`qoe+w8a8` and `qoe`), issue 22 §4 is judged too: never worse
at any load (its mean QoE at every load, a lone reader's tokens a second; against_dense). A peer's headline of
0 (no rate held, no burst served) is read as a bound: below the lowest level measured, so the ratio
is "more than" ours over that level. The steady-load check (issue 22 §3): each Poisson load on
this server against a burst of as many readers at once (the bursts of the whole counts on either
side of its mean count, each run STEADY_BURSTS times right after the load, their means joined by
a straight line, the judge), in the load's steady window where it is long enough (steady_window:
`--seconds 150`), else over its whole busy period, both sides in generated tokens (by usage);
with each load, the engine's steps (how many, their milliseconds, tokens a step, rows sat out a
step, the sorts of its slots by length and the milliseconds of their bookkeeping; in a Poisson
load's steady window and each judging burst, the rows and prompt tokens a step and what the
steps prompts joined cost: the engine's counters read every SAMPLE_EVERY seconds). Saves
results/qoe.json (and results/qoe-partial.json after each load) and results/qoe.png. Benchmarks
are not tests: nothing here asserts. `python scripts/bench.py guidellm` runs the field's tool
against the same servers.

Leaves out: llama.cpp's server (it builds from source here, about 10 minutes) and vLLM (no
CPU build here).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

from benchkit import PROMPTS, pct, pyplot, start_peer

import client
from streaming import qoe
from streaming.launch import Process, Server
from streaming.model.bundled import converted_folder
from streaming.model.busy import read_stat, stat_ticks

LENGTHS = (50, 300)  # tokens an answer under Poisson arrivals: uniform
BURST_TOKENS = 100  # tokens an answer in a burst
SINGLE = 200  # tokens of the one-reader measurement
# Answers the one-reader measurement takes, in turn: their tokens a second together (the first
# prompts of prompts.json). Six, not three: w8a8's tokens kept a step over the same three answers
# moved 1.41-1.61 in one process, 1.47-1.81 through one server (its text changes with the widths
# its passes run), which put §4's lone-reader judge (against_dense) on a coin: 1.24x bfloat16 at
# run62's start, 0.93x at its end
SINGLE_PROMPTS = 6
TEMPERATURE, TOP_P = 0.7, 0.9
# requests a second (Poisson): up to past twice the peer's sustainable rate (0.5-0.7/s here), which
# the overload goal compares at
RATES = [0.2, 0.35, 0.5, 0.7, 1.0, 1.4]
BURSTS = [8, 16, 32, 48]
SECONDS = 60.0  # of arrivals at each rate
# expected arrivals at a rate, at the least, unless --seconds is given: a low rate's window grows
# (0.05/s: 240 s), so that its mean QoE is a dozen readers', not two or three's
MIN_ARRIVALS = 12
QUICK = {"rates": [0.35], "bursts": [16], "seconds": 20.0}
IDLE_SECONDS = 3.0  # how long each server's idle CPU is measured before the loads
TICK = os.sysconf("SC_CLK_TCK")  # /proc's CPU ticks a second
SETTLE_WINDOW, SETTLE_MAX = 0.5, 30.0  # before each run: every server quiet for a window (waited for at most)
# this server keeps no ended answer's keys (--retain-memory 0): the loads draw from prompts.json's 20
# prompts again and again, and a prompt it had seen would skip its prefill, work the peer does
# (what retaining is worth to a conversation's next turn is measured apart: README, "Scheduling")
NO_RETAIN = ["--retain-memory", "0"]
PEER_EOS = 151900  # a padding row of the Qwen2.5 vocabulary: never sampled, so the peer runs to max_new_tokens
CONFIGS = {  # this server's settings to compare: name -> options
    "fifo": ["--schedule", "fifo"],
    "qoe": ["--schedule", "qoe"],  # the defaults
    "qoe+none": ["--schedule", "qoe", "--quantize", "none"],  # the model's own float32 arithmetic on any CPU
    "fifo+int8": ["--schedule", "fifo", "--quantize", "int8"],
    "qoe+int8": ["--schedule", "qoe", "--quantize", "int8"],
    "qoe+bf16": ["--schedule", "qoe", "--quantize", "bf16"],  # a float32 model's weights in bfloat16 where faster
    "qoe+fp16": ["--schedule", "qoe", "--quantize", "fp16"],  # float16 weights through fbgemm, float32 arithmetic
    "qoe+w8a8": ["--schedule", "qoe", "--quantize", "w8a8"],  # int8 weights and rows, fbgemm (down_proj: weights)
    "qoe+linear": ["--schedule", "qoe", "--kernels", "linear"],  # F.linear everywhere: what kernels.py gains
    "qoe+process": ["--schedule", "qoe", "--engine", "process"],  # the engine in a process of its own
    "qoe+nospec": ["--schedule", "qoe", "--speculate", "0"],  # no guessed tokens (speculation.py)
    "qoe+w8a8+nospec": ["--schedule", "qoe", "--quantize", "w8a8", "--speculate", "0"],
    "qoe+hf": ["--schedule", "qoe", "--forward", "transformers"],  # the model's own forward (decoder.py)
    "qoe+w8a8+hf": ["--schedule", "qoe", "--quantize", "w8a8", "--forward", "transformers"],
    # without guesses both passes write the same text: the pass alone is compared
    "qoe+nospec+hf": ["--schedule", "qoe", "--speculate", "0", "--forward", "transformers"],
    "qoe+w8a8+nospec+hf": ["--schedule", "qoe", "--quantize", "w8a8", "--speculate", "0", "--forward", "transformers"],
}
PEER = "transformers serve"
# The goals (#22), each a check of the headlines against the peer's.
GOALS = [
    ("sustainable rate at least 2x the peer's", "sustainable_rate", 2.0, "higher"),
    ("burst of 48: mean QoE at least 1.5x the peer's", "burst48_qoe", 1.5, "higher"),
    ("burst of 48: TTFT p99 at most a third of the peer's", "burst48_ttft_p99", 1 / 3, "lower"),
    ("readers served at least 2x the peer's", "readers_served", 2.0, "higher"),
    ("one reader at least 1.5x the peer's tokens/s", "single_tokens_per_s", 1.5, "higher"),
]
# A headline of 0 (no rate held, no burst served) is a bound, not a figure: the level lies below
# the lowest one measured, so a ratio to it is at least ours over that (QoE falling with load).
BELOW = {"sustainable_rate": "sustainable_below", "readers_served": "served_below"}
OVERLOAD_QOE = 1.5  # at twice the peer's sustainable rate: mean QoE at least this x the peer's (and half at 0.95)
# A steady load's readers at once within this of a whole count are set against that count's burst
# alone: the other side's would weigh at most 5% (and cost two more bursts for it).
WHOLE = 0.05
STEADY_GOAL = 0.9  # steady Poisson load: at least 90% of the tokens/s a burst of as many readers gets (§3)
MIN_WINDOW = 20.0  # seconds of steady state (steady_window) for its own figures: fewer are noise
# The burst a steady load is set against, run this many times, their mean the judge: one burst's
# tokens/s moved by 5% between runs of the same hour (run46u: 438.4 for 61 readers where run46s
# had 416.2 for 59), as much as the effects the check is for.
STEADY_BURSTS = 2
# §4: a quantized mode never worse than its dense twin (the same config without "+MODE") at any
# load: its mean QoE not lower at three decimals (what the table shows), and a lone reader's tokens
# a second not lower. Strict: a difference inside the noise counts against it, as a reader would.
QUANTIZED = ("+int8", "+w8a8", "+int4", "+fp16", "+bf16")


def extra(ours: bool, tokens: int) -> dict:
    """What makes a request ask for exactly `tokens` tokens, on each kind of server."""
    body = {"temperature": TEMPERATURE, "top_p": TOP_P, "stream_options": {"include_usage": True}}
    if ours:
        return body | {"ignore_eos": True}
    config = {"max_new_tokens": tokens, "eos_token_id": PEER_EOS, "do_sample": True}
    return body | {"generation_config": json.dumps(config | {"temperature": TEMPERATURE, "top_p": TOP_P})}


def workload(kind: str, x: float, seconds: float, seed: int) -> list[tuple[float, int, int]]:
    """(start offset s, prompt index, tokens) per request: Poisson at rate x, x at once, or
    SINGLE_PROMPTS lone answers (run() starts them in turn: in_turn)."""
    rnd = random.Random(seed)
    if kind == "single":
        return [(0.0, i, SINGLE) for i in range(SINGLE_PROMPTS)]
    if kind == "burst":
        return [(0.0, rnd.randrange(len(PROMPTS)), BURST_TOKENS) for _ in range(int(x))]
    out, t = [], 0.0
    while (t := t + rnd.expovariate(x)) < seconds:
        out.append((t, rnd.randrange(len(PROMPTS)), rnd.randint(*LENGTHS)))
    return out


def window(seconds: float | None, rate: float) -> float:
    """Seconds of arrivals at `rate`: --seconds as given, else SECONDS stretched to MIN_ARRIVALS."""
    return seconds if seconds is not None else max(SECONDS, MIN_ARRIVALS / rate)


async def drive(port: int, requests, ours: bool, model: str | None, limit: float | None = None):
    """Run `requests` against a server; each one's result or error. With `limit`, a request not
    done `limit` seconds after the load began is cut (its connection closed: the server should
    stop its work) and counts as failed, with a TimeoutError: one server that cannot keep up
    costs the run a bounded time, and its row says how many it did not finish."""
    url = f"http://127.0.0.1:{port}"

    async def one(i, start, prompt, tokens):
        if limit is not None and start >= limit:  # arrives after the cut: not sent, not waited for
            return asyncio.TimeoutError()
        await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
        text = PROMPTS[prompt]
        call = client.api_post("openai", text, tokens, url, seed=i, extra=extra(ours, tokens), model=model)
        try:
            left = None if limit is None else max(0.0, limit - (time.perf_counter() - t0))
            return await asyncio.wait_for(call, left)
        except (OSError, ValueError, client.ServerError, asyncio.TimeoutError) as e:  # (3.10: not an OSError)
            return e

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    return results, time.perf_counter() - t0


def token_arrivals(result, tok) -> list[tuple[float, float]]:
    """(seconds, tokens that arrived then) with what arrived re-tokenized at each arrival."""
    out, text, count = [], "", 0
    for t, piece in zip(result.arrivals, result.pieces, strict=True):
        text += piece
        n = len(tok(text, add_special_tokens=False).input_ids)
        if n > count:
            out.append((t, float(n - count)))
            count = n
    return out


def figures(requests, results, wall, tok) -> dict:
    good = [(r, asked) for r, (_, _, asked) in zip(results, requests, strict=True) if not isinstance(r, BaseException)]
    timelines = {id(r): token_arrivals(r, tok) for r, _ in good}
    scores = [qoe.qoe(timelines[id(r)]) for r, _ in good] + [0.0] * (len(results) - len(good))
    ttft = [r.first for r, _ in good if r.first is not None]
    gaps = [b - a for r, _ in good for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    generated = [(r.usage or {}).get("completion_tokens") for r, _ in good]
    return {
        **qoe.summary(scores),
        "requests": len(results),
        "failed": len(results) - len(good),
        "cut": sum(isinstance(r, asyncio.TimeoutError) for r in results),  # not done within --load-limit
        "first_error": next((repr(r)[:200] for r in results if isinstance(r, BaseException)), None),  # why
        "asked_tokens": sum(asked for _, asked in good),
        "generated_tokens": sum(g or 0 for g in generated),
        "text_tokens": sum(n for line in timelines.values() for _, n in line),  # what arrived, re-tokenized
        "unequal": sum(g != asked for g, (_, asked) in zip(generated, good, strict=True)),  # usage says otherwise
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "gap_p99": pct(gaps, 99),
        "tokens_per_s": sum(g or 0 for g in generated) / wall if wall else None,
        "wall_s": wall,
        **at_once(requests, results, sum(g or 0 for g in generated)),
        "window": steady_window(requests, results, timelines),
    }


def at_once(requests, results, tokens: int) -> dict:
    """How many readers were served at once, on average, while any was (from each request's start
    to its last arrival), over how many seconds, and the tokens a second over those seconds: what
    a steady load is compared with a burst of as many readers by."""
    spans = sorted(
        (start, start + r.arrivals[-1])
        for (start, _, _), r in zip(requests, results, strict=True)
        if not isinstance(r, BaseException) and r.arrivals
    )
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy, end = busy + b - max(a, end), b
    return {
        "readers_at_once": sum(b - a for a, b in spans) / busy if busy else 0.0,
        "busy_s": busy,
        "busy_tokens_per_s": tokens / busy if busy else None,
    }


def steady_window(requests, results, timelines: dict) -> dict | None:
    """The load in its steady state: from the first arrival plus the p90 of the answers' durations
    (before it the readers at once still grow: with readers served side by side, their count is
    stationary once the first arrival's answer has run as long as most answers do, within a few
    per cent at the p90) to the last arrival (after it, readers only leave: the drain), the readers
    served at once on average and the tokens a second that arrived within it (generated tokens,
    by usage, placed where their text arrived: in_usage). A burst's readers start and end together; a Poisson load's whole busy period also holds
    its ramp and drain, whose fewer readers at once make fewer tokens a second. None where the
    window is shorter than MIN_WINDOW (60 s of arrivals of answers up to 300 tokens leave little:
    `--seconds 150` measures it)."""
    served = [
        (start, r)
        for (start, _, _), r in zip(requests, results, strict=True)
        if not isinstance(r, BaseException) and r.arrivals
    ]
    if not served:
        return None
    begin = min(start for start, _ in served) + pct([r.arrivals[-1] for _, r in served], 90)
    end = max(start for start, _ in served)
    if end - begin < MIN_WINDOW:
        return None
    # In generated tokens (by usage), as a burst's tokens/s are counted: each answer's re-tokenized
    # arrivals scaled to its usage. The re-tokenized text alone holds fewer (sampled text splits
    # into fewer tokens than were sampled: 94% of them at 1/s, by the engine's own counts), and
    # set against a burst's usage that read as steps lost.
    scale = {id(r): in_usage(r, timelines[id(r)]) for _, r in served}  # once an answer, not a token
    tokens = sum(n * scale[id(r)] for start, r in served for t, n in timelines[id(r)] if begin <= start + t < end)
    overlap = sum(max(0.0, min(end, start + r.arrivals[-1]) - max(begin, start)) for start, r in served)
    return {
        "from_s": begin,
        "to_s": end,
        "readers_at_once": overlap / (end - begin),
        "tokens_per_s": tokens / (end - begin),
    }


def in_usage(result, timeline: list[tuple[float, float]]) -> float:
    """Generated tokens per re-tokenized token of an answer (its usage over its timeline's
    tokens; 1 where either is missing)."""
    text = sum(n for _, n in timeline)
    used = (result.usage or {}).get("completion_tokens")
    return used / text if used and text else 1.0


def single_rate(results) -> float | None:
    """A lone reader's tokens a second after its first text, over answers read one after the other
    (by usage, less each first token): all their tokens over all their streaming time."""
    tokens, streamed = 0, 0.0
    for result in results:
        if isinstance(result, BaseException) or len(result.arrivals) < 2:
            return None
        streamed += result.arrivals[-1] - result.arrivals[0]
        tokens += ((result.usage or {}).get("completion_tokens") or len(result.arrivals)) - 1
    return tokens / streamed if streamed else None


async def in_turn(port: int, requests, ours: bool, model: str | None, limit: float | None = None):
    """drive() for each request alone, one after the other; the requests with the offsets they
    started at, their results and the whole wall time. `limit` bounds them all together, as it
    bounds any load: an answer not started by then is not sent, one running then is cut."""
    done, results, wall = [], [], 0.0
    for _, prompt, tokens in requests:
        left = None if limit is None else max(0.0, limit - wall)
        one, took = await drive(port, [(0.0, prompt, tokens)], ours, model, left)
        done.append((wall, prompt, tokens))
        results += one
        wall += took
    return done, results, wall


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (an engine process, `--engine process`)."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and (fields := read_stat(f"/proc/{entry}/stat")) and int(fields[1]) == pid
    ]


def cpu_ticks(pid: int) -> int:
    """CPU ticks of a server and its child processes (an engine process works there)."""
    return sum(stat_ticks(read_stat(f"/proc/{p}/stat")) for p in (pid, *children(pid)))


def loop_ticks(pid: int) -> int:
    """CPU ticks of a server's main thread: this server's event loop (the engine has threads, or a
    process, of its own)."""
    return stat_ticks(read_stat(f"/proc/{pid}/task/{pid}/stat"))


def ticks_over(servers: dict, seconds: float) -> dict:
    """Each server's CPU ticks over the next `seconds`."""
    before = {name: cpu_ticks(s["process"].proc.pid) for name, s in servers.items()}
    time.sleep(seconds)
    return {name: cpu_ticks(s["process"].proc.pid) - before[name] for name, s in servers.items()}


def idle_cpu(servers: dict) -> dict:
    """Each server's CPU ticks while nobody asks it anything, over IDLE_SECONDS."""
    return ticks_over(servers, IDLE_SECONDS)


def settle(servers: dict, most: float = SETTLE_MAX) -> float:
    """Wait until no server uses CPU (at most 1 tick in SETTLE_WINDOW), so that a run never shares
    the cores with the previous run's leftovers (a server still finishing, freeing or compiling);
    the seconds waited (`most` at most: then the run goes ahead and the wait says so)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < most:
        if max(ticks_over(servers, SETTLE_WINDOW).values()) <= 1:
            break
    return time.monotonic() - t0 - SETTLE_WINDOW


def start(args) -> dict:
    """Every server, started one after the other, each up before the next starts: {name: {"process",
    "port", "ours", "model"}}. Not all at once: a server that times its kernels at load (kernels.py,
    the first load on a machine, then kept) beside another's loading keeps tables of the
    contention. run58's w8a8 tables so kept `linear` for the gate and up product in prefills, where
    fbgemm's w8a8 takes 72 ms against linear's 91 for 512 rows alone: its join passes were 5%
    slower than bfloat16's (1743.7 against 1647.5 ms, whole 620-token passes), where after timing
    alone they were 10% faster (1570.9)."""
    servers: dict = {}
    try:
        started(args, servers)
        for name, s in servers.items():
            s["port"] = s["process"].port
            if s["ours"]:  # what its defaults chose (choice.default_dtype, default_quantize)
                m = asyncio.run(client.get_json("/metrics.json", "127.0.0.1", s["port"]))
                print(f"{name}: {m.get('dtype')}, --quantize {m.get('quantize')}", flush=True)
    except BaseException:  # (one that did not start, or answer: those up are stopped, not left running)
        stop(servers)
        raise
    return servers


def started(args, servers: dict) -> None:
    """start()'s servers, into `servers` as each is up."""
    for config in [c for c in args.configs.split(",") if c]:
        name = f"this server, {config}"
        # --dtype only where asked: a server left to choose runs its own defaults (fp16 weights on a
        # CPU without native bfloat16, choice.default_quantize); the peer always gets args.dtype
        dtype = ["--dtype", args.dtype] if args.dtype_asked else []
        device = ["--device", args.device] if args.device else []
        p = Server(
            name,
            "--model",
            args.model,
            *dtype,
            *device,
            "--port",
            "0",
            *NO_RETAIN,
            *CONFIGS[config],
            *args.server_args.split(),
        )
        servers[name] = {"process": p, "ours": True, "model": None}
        p.wait()
    if args.peer:
        folder = converted_folder() if args.model == "bundled" else Path(args.model)
        try:
            peer = start_peer(folder, args.dtype, lm_device(args))
            servers[PEER] = {"process": peer, "ours": False, "model": str(folder)}
        except (RuntimeError, TimeoutError, FileNotFoundError) as e:
            print(f"{PEER}: could not start ({e})", flush=True)


def lm_device(args) -> str:
    """The device every server runs on: --device, else the best this machine has."""
    from streaming.model.choice import best_device

    return args.device or best_device()


def stop(servers: dict) -> None:
    for s in servers.values():
        p: Process = s["process"]
        p.stop()


def loads(args) -> list[tuple[str, float]]:
    return [("single", 0)] + [("rate", r) for r in args.rates] + [("burst", n) for n in args.bursts] + [("single", 1)]


def label(kind: str, x: float) -> str:
    return {
        "single": f"one reader ({'end' if x else 'start'})",
        "rate": f"{x:g}/s Poisson",
        "burst": f"burst of {x:g}",
    }[kind]


def run(args, servers: dict, tok) -> dict:
    names = list(servers)
    out: dict = {name: {} for name in names}
    for name, s in servers.items():  # warm: the first request's own costs (kernels, caches) out of the figures
        asyncio.run(drive(s["port"], workload("burst", 2, 0, 0), s["ours"], s["model"]))
        if (m := engine_counts(s)) and "max_batch" in m:  # what it chose for its device where the options were left out
            s["sizes"] = {"max_batch": m["max_batch"], "kv_memory": m.get("kv_memory")}
            kv = f"{m['kv_memory'] / 2**30:.1f} GiB" if m.get("kv_memory") else "?"
            print(f"{name}: --max-batch {m['max_batch']}, --kv-memory {kv}", flush=True)
    print(
        "\n  load                 server                           QoE mean  p10  >=.95  TTFT p50  p99 s"
        "  gap p99 ms  tokens/s  unequal",
        flush=True,
    )
    for i, (kind, x) in enumerate(loads(args)):
        requests = workload(kind, x, window(args.seconds, x) if kind == "rate" else 0.0, seed=int(100 * x) + 1)
        for name in names if i % 2 == 0 else names[::-1]:  # each load on one then the other, alternating
            s = servers[name]
            waited = settle(servers, args.settle)
            before, pid = engine_counts(s), s["process"].proc.pid
            cpu0, loop0 = cpu_ticks(pid), loop_ticks(pid)
            samples: list = []
            if kind == "single":
                sent, results, wall = asyncio.run(in_turn(s["port"], requests, s["ours"], s["model"], args.load_limit))
            else:
                sent, load = requests, drive(s["port"], requests, s["ours"], s["model"], args.load_limit)
                (results, wall), samples = asyncio.run(sampled(load, s["port"] if kind == "rate" and before else None))
            f = figures(sent, results, wall, tok) | {"settle_s": round(waited, 1)}
            if kind == "rate" and f["window"] and samples:  # the engine's steps within the steady window
                f["window"]["engine"] = engine_steps(*within(samples, f["window"]["from_s"], f["window"]["to_s"]))
            f["cpu_s"], f["loop_cpu_s"] = ((cpu_ticks(pid) - cpu0) / TICK, (loop_ticks(pid) - loop0) / TICK)
            if kind == "single":
                f["single_tokens_per_s"] = single_rate(results)
                f |= lone_step(before, engine_counts(s), f["single_tokens_per_s"])
            else:
                f["engine"] = engine_steps(before, engine_counts(s))
            out[name][f"{kind} {x:g}"] = f
            client.save(Path(args.results) / "qoe-partial.json", out)  # what a run stopped short keeps
            print(
                f"  {label(kind, x):20s} {name:32s} {f['qoe_mean']:.3f}  {f['qoe_p10']:.2f}  {f['qoe_share_95']:.2f}"
                f"   {f['ttft_p50'] or 0:6.2f} {f['ttft_p99'] or 0:6.2f}   {1000 * (f['gap_p99'] or 0):8.0f}"
                f"  {f['tokens_per_s'] or 0:8.1f}  {f['unequal']:4d}"
                + (
                    f"  ({f['failed']} failed, {f['cut']} of them cut at the limit: {f['first_error']})"
                    if f["failed"]
                    else ""
                )
                + (f"  (waited {waited:.0f} s for quiet)" if waited >= 1 else "")
                + (
                    f"  {f['single_tokens_per_s']:.2f} tokens/s alone"
                    if kind == "single" and f["single_tokens_per_s"]
                    else ""
                ),
                flush=True,
            )
            if s["ours"] and f["cpu_s"]:  # what the event loop took of the server's CPU (issue 22 §2)
                print(
                    f"  {'':20s} {'':32s} CPU {f['cpu_s']:.1f} s, of it the event loop's {f['loop_cpu_s']:.2f} s"
                    f" ({100 * f['loop_cpu_s'] / f['cpu_s']:.1f}%)",
                    flush=True,
                )
            if e := f.get("engine"):
                print(
                    f"  {'':20s} {'':32s} {e['steps']} steps of {e['step_ms']:.1f} ms (forward {e['forward_ms']:.1f},"
                    f" sampling {e['sampling_ms']:.1f}): {e['tokens_per_step']:.1f} tokens a step,"
                    f" {e['sat_out_per_step']:.2f} rows sat out a step, the slots sorted {e['kv_sorts']} times"
                    f" (kv {e['kv_ms']:.1f} ms a step)",
                    flush=True,
                )
            if (w := f.get("window") or {}).get("engine"):
                print(f"  {'':20s} {'':32s} in its steady window: {steps_said(w['engine'])}", flush=True)
            elif e:
                print(f"  {'':20s} {'':32s} {steps_said(e)}", flush=True)
            if kind == "rate" and f["generated_tokens"]:
                print(
                    f"  {'':20s} {'':32s} its text re-tokenized: {f['text_tokens']:.0f} tokens of"
                    f" {f['generated_tokens']} generated ({100 * f['text_tokens'] / f['generated_tokens']:.1f}%)",
                    flush=True,
                )
            if f.get("step_ms"):
                print(
                    f"  {'':20s} {'':32s} the model's step {f['step_ms']:.1f} ms (forward {f['forward_ms']:.1f}),"
                    f" the reader's gap {f['gap_ms']:.1f} ms: {f['gap_ms'] / f['step_ms']:.3f}x the step",
                    flush=True,
                )
        if kind == "rate":  # after both servers ran the load (they stay back to back), before the next load
            quiet, key = functools.partial(settle, servers, args.settle), f"{kind} {x:g}"
            for name, s in servers.items():
                if s["ours"]:
                    steady(s, name, key, out[name][key], tok, quiet, args.load_limit)
            client.save(Path(args.results) / "qoe-partial.json", out)
    return out


def steady(s: dict, name: str, key: str, f: dict, tok, quiet: Callable[[], float], limit: float | None = None) -> None:
    """§3's check for one Poisson load on this server (`f`, its figures under `key`), run right after
    the load ran on every server (`quiet()` before each burst, as before every load): bursts of as
    many readers as it served at once (the whole counts on either side, at_readers: between
    them), and the ratio of the steady load's tokens a second to the burst's: in its steady window
    (steady_window: without the ramp and the drain), the goal's judge, and over its whole busy
    period, printed beside it. The peer is not measured (the goal is this
    engine's). The bursts run next to the load they judge: run at the end of the whole run, the
    judge of run55's 1/s load (w8a8) came about half an hour after it, on a machine that drifts 2x
    in that time."""
    if not f["busy_tokens_per_s"] or f["cut"]:
        return  # (a cut load's tokens/s is not its own: no ratio)
    win = f.get("window")
    parts = [("busy", f["readers_at_once"], f["busy_tokens_per_s"])]
    if win:
        parts.append(("window", win["readers_at_once"], win["tokens_per_s"]))
    bursts: dict = f.setdefault("steady_bursts", {})  # n -> its runs' tokens/s and the first run's steps
    ratios = {}
    for part, readers, tokens in parts:
        if readers < 1 or not tokens:
            continue
        # the bursts on either side (within WHOLE of a whole count: that count's alone)
        near = round(readers)
        ns = [near] if abs(readers - near) < WHOLE else [math.floor(readers), math.ceil(readers)]
        runs = {n: burst_of(s, bursts, n, tok, quiet, limit) for n in ns}
        if all(runs.values()):
            means = {n: sum(r) / len(r) for n, r in runs.items()}  # type: ignore[arg-type]
            burst = at_readers(means, readers)
            ratios[part] = (tokens, readers, runs, means, burst, tokens / burst)
    f["busy_ratio"] = ratios["busy"][-1] if "busy" in ratios else None
    judged = "window" if "window" in ratios else "busy"
    f["steady_ratio"] = ratios[judged][-1] if judged in ratios else None
    for part, (tokens, readers, runs, means, burst, ratio) in ratios.items():
        where = (
            f"its steady window ({win['to_s'] - win['from_s']:.0f} s)"
            if part == "window"
            else f"its whole busy period ({f['busy_s']:.0f} s)"
        )
        judge = f"goal {STEADY_GOAL:.2f}" if part == judged else "not the judge"
        said = "; ".join(
            f"a burst of {n}: {', '.join(f'{x:.1f}' for x in r or ())} tokens/s (mean {means[n]:.1f})"
            for n, r in runs.items()
        )
        print(
            f"  steady {key.split()[1]}/s, {name}, {where}: {tokens:.1f} tokens/s with {readers:.1f} readers"
            f" at once; {said}; at {readers:.1f} readers {burst:.1f} -> {ratio:.2f}x ({judge})",
            flush=True,
        )
    for n in sorted({n for v in ratios.values() for n in v[2]}):  # (tokens, readers, runs, ...)
        if e := bursts[n].get("engine"):  # the judge's steps, beside the load's
            print(f"    the burst of {n}'s steps: {steps_said(e)}", flush=True)


def at_readers(means: dict[int, float], readers: float) -> float:
    """A burst's tokens a second at a fractional count of readers: between the bursts of the whole
    counts on either side, in a straight line. Rounded to one burst instead, the count moved the
    ratio by a reader's share: 8.7 readers at 0.7/s against a burst of 9 gave 0.88x, where 8.4
    readers in the run before against a burst of 8 gave 0.99x (each reader 13.0 tokens/s in both
    bursts)."""
    lo, hi = min(means), max(means)
    return means[lo] if lo == hi else means[lo] + (readers - lo) / (hi - lo) * (means[hi] - means[lo])


def burst_of(
    server: dict, bursts: dict, n: int, tok, quiet: Callable[[], float], limit: float | None
) -> list[float] | None:
    """A burst of n readers' tokens a second on this server, from STEADY_BURSTS runs of the same
    requests, each after `quiet()` (kept in `bursts[n]`: its runs' tokens/s, the first run's
    steps); None if one was cut."""
    requests = workload("burst", n, 0, seed=100 * n + 1)

    def run() -> dict:
        quiet()
        before = engine_counts(server)
        results, wall = asyncio.run(drive(server["port"], requests, server["ours"], server["model"], limit))
        return figures(requests, results, wall, tok) | {"engine": engine_steps(before, engine_counts(server))}

    if n not in bursts:
        first = run()
        bursts[n] = {"runs_tokens_per_s": [first["tokens_per_s"]], "cut": first["cut"], "engine": first["engine"]}
    burst = bursts[n]
    runs = burst["runs_tokens_per_s"]
    while not burst["cut"] and len(runs) < STEADY_BURSTS:
        if (again := run())["cut"]:
            burst["cut"] = again["cut"]
            return None
        runs.append(again["tokens_per_s"])
    return None if burst["cut"] else runs


def engine_counts(server: dict) -> dict | None:
    """This server's engine counters (/metrics.json: steps, their seconds, the parts), or None
    for the peer or an engine without them."""
    if not server["ours"]:
        return None
    m = asyncio.run(client.get_json("/metrics.json", "127.0.0.1", server["port"]))
    return m if "steps" in m else None


SAMPLE_EVERY = 1.0  # seconds between the engine's counters read during a Poisson load (its steady window's steps)


async def sampled(load, port: int | None):
    """Run a load (drive()'s coroutine) while reading this server's engine counters every
    SAMPLE_EVERY seconds (none where `port` is None): its result and the (offset s, counters)
    read, offsets from the load's start as drive()'s are."""
    samples: list[tuple[float, dict]] = []
    t0 = time.perf_counter()

    async def poll() -> None:
        while True:
            m = await client.get_json("/metrics.json", "127.0.0.1", port)
            samples.append((time.perf_counter() - t0, m))
            await asyncio.sleep(SAMPLE_EVERY)

    task = asyncio.create_task(poll()) if port is not None else None
    try:
        return await load, samples
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def within(samples: list[tuple[float, dict]], begin: float, end: float) -> tuple[dict | None, dict | None]:
    """The counters read last at or before `begin` and first at or after `end` (the steady
    window's edges, within SAMPLE_EVERY)."""
    before = [m for t, m in samples if t <= begin]
    after = [m for t, m in samples if t >= end]
    return (before[-1] if before else None), (after[0] if after else None)


def lone_step(before: dict | None, after: dict | None, rate: float | None) -> dict:
    """A lone reader's mean gap against the engine's own mean step over the same answer (issue
    22 §2: a lone stream's gap should be within 10% of the model's step): what the event loop,
    the hand-off and the wire add to the model."""
    steps = engine_steps(before, after)
    if steps is None or not rate:
        return {}
    return {k: steps[k] for k in ("steps", "step_ms", "forward_ms")} | {"gap_ms": 1000 / rate}


def engine_steps(before: dict | None, after: dict | None) -> dict | None:
    """This engine's steps over a load (its counters before and after): how many, their mean
    milliseconds and the forward pass's and sampling's of them, the tokens a step and the rows
    that sat a step out (the qoe policy's choice: what a steady load's tokens/s may lose to it)."""
    if before is None or after is None or (steps := after["steps"] - before["steps"]) <= 0:
        return None
    part = {k: v - before["step_parts_seconds"].get(k, 0.0) for k, v in after["step_parts_seconds"].items()}
    return {
        "steps": steps,
        "step_ms": 1000 * (after["step_seconds"] - before["step_seconds"]) / steps,
        "forward_ms": 1000 * part["forward"] / steps,
        "sampling_ms": 1000 * part["sampling"] / steps,
        "tokens_per_step": (after["tokens_generated"] - before["tokens_generated"]) / steps,
        "sat_out_per_step": (after["rows_skipped"] - before["rows_skipped"]) / steps,
        "kv_sorts": after.get("kv_sorts", 0) - before.get("kv_sorts", 0),  # blocks.py's sorts of the slots by length
        "kv_ms": 1000 * part.get("kv", 0.0) / steps,  # the slots' bookkeeping: layouts, growth, sorts
    } | joins(before, after, steps, part["forward"])


def steps_said(e: dict) -> str:
    """engine_steps() in words: rows and prompt tokens a step, and what the joining steps cost."""
    out = f"{e['steps']} steps of {e['step_ms']:.1f} ms, {e['tokens_per_step']:.1f} tokens a step"
    if "rows_per_step" not in e:
        return out
    ms = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    return (
        out + f", {e['rows_per_step']:.1f} rows a step, {e['prompt_tokens_per_step']:.1f} prompt tokens a step;"
        f" prompts joined {100 * e['join_share']:.0f}% of the steps, forward {ms(e['join_forward_ms'])} ms there"
        f" against {ms(e['decode_forward_ms'])} ms in the others"
    )


def joins(before: dict, after: dict, steps: int, forward: float) -> dict:
    """The rows a step ran, and what the prompts joining cost: the prompt tokens a step, the share
    of steps they joined, those steps' forward pass and the others' (by the engine's counters; an
    engine without them: nothing)."""
    if "rows_run" not in after or "rows_run" not in before:
        return {}
    d = {k: after[k] - before[k] for k in ("rows_run", "prompt_tokens_computed", "join_steps", "join_forward_seconds")}
    joined, alone = d["join_steps"], steps - d["join_steps"]
    return {
        "rows_per_step": d["rows_run"] / steps,
        "prompt_tokens_per_step": d["prompt_tokens_computed"] / steps,
        "join_share": joined / steps,
        "join_forward_ms": 1000 * d["join_forward_seconds"] / joined if joined else None,
        "decode_forward_ms": 1000 * (forward - d["join_forward_seconds"]) / alone if alone else None,
    }


def of_kind(loads_: dict, kind: str) -> dict:
    """One server's loads of a kind ("rate", "burst") by their rate or size (a steady judge's
    bursts are in its load's figures, `steady_bursts`, not among these)."""
    return {(float if kind == "rate" else int)(float(k.split()[1])): f for k, f in loads_.items() if k.startswith(kind)}


def headlines(by_server: dict) -> dict:
    """Per server: the sustainable rate, readers served, the burst of 48, one reader."""
    out = {}
    for name, loads_ in by_server.items():
        rates, bursts = of_kind(loads_, "rate"), of_kind(loads_, "burst")
        steady_ = [
            (r, f["steady_ratio"], f.get("busy_ratio")) for r, f in sorted(rates.items()) if f.get("steady_ratio")
        ]
        singles = [loads_[k]["single_tokens_per_s"] for k in ("single 0", "single 1") if loads_.get(k)]
        b48 = bursts.get(48, {})
        held = [r for r, f in rates.items() if f["qoe_mean"] >= 0.95]
        served = [n for n, f in bursts.items() if f["qoe_share_95"] >= 0.95]
        out[name] = {
            "sustainable_rate": max(held, default=0.0),
            "sustainable_below": min(rates, default=None) if not held else None,  # BELOW
            "readers_served": max(served, default=0),
            "served_below": min(bursts, default=None) if not served else None,
            "burst48_qoe": b48.get("qoe_mean"),
            "burst48_ttft_p99": b48.get("ttft_p99"),
            "single_tokens_per_s": sum(s for s in singles if s) / len([s for s in singles if s])
            if any(singles)
            else None,
            "single_start_end": singles,
            "steady_ratio": steady_[-1][1] if steady_ else None,  # at the most loaded rate measured
            "steady_rate": steady_[-1][0] if steady_ else None,
            "steady_busy_ratio": steady_[-1][2] if steady_ else None,  # over the whole busy period, ramp and drain in
            "by_rate": {r: {"qoe_mean": f["qoe_mean"], "qoe_share_95": f["qoe_share_95"]} for r, f in rates.items()},
        }
    return out


def compare(heads: dict) -> dict:
    them = heads.get(PEER)
    print("\nheadlines (this machine, one interleaved run, equal work):", flush=True)
    verdicts: dict = {}
    for name, h in heads.items():
        singles = ", ".join(f"{s:.2f}" for s in h["single_start_end"] if s)
        print(
            f"  {name:32s} sustainable rate {h['sustainable_rate']:g}/s, readers served {h['readers_served']}, "
            f"burst of 48 QoE {h['burst48_qoe'] or 0:.3f} TTFT p99 {h['burst48_ttft_p99'] or 0:.2f} s, "
            f"one reader {singles} tokens/s (start, end)",
            flush=True,
        )
        if h.get("steady_ratio"):
            met = h["steady_ratio"] >= STEADY_GOAL
            print(
                f"    steady load ({h['steady_rate']:g}/s) at least {STEADY_GOAL:.0%} of a burst's tokens/s at as many "
                f"readers: {h['steady_ratio']:.2f}x -> {'met' if met else 'NOT met'}"
                + (
                    f" (its steady window; over its whole busy period, ramp and drain in, {h['steady_busy_ratio']:.2f}x)"
                    if h.get("steady_busy_ratio") and h["steady_busy_ratio"] != h["steady_ratio"]
                    else ""
                ),
                flush=True,
            )
        if them is None or name == PEER:
            continue
        verdicts[name] = {}
        for goal, key, factor, better in GOALS:
            ratio, shown, bound = goal_ratio(h[key], them[key], them.get(BELOW.get(key, "")))
            met = ratio is not None and (ratio >= factor if better == "higher" else ratio <= factor)
            finite = ratio if ratio is None or ratio < float("inf") else "inf"  # JSON has no infinity
            verdicts[name][key] = {"ratio": finite, "met": met, "bound": bound}
            print(f"    {goal}: {shown} -> {'met' if met else 'NOT met'}", flush=True)
        verdicts[name]["overload"] = overload(h, them)
    return verdicts


def twin(name: str) -> str | None:
    """A quantized config's dense twin: "this server, qoe+w8a8" -> "this server, qoe"."""
    mode = next((m for m in QUANTIZED if m in name), None)
    return name.replace(mode, "", 1) if mode else None


def against_dense(by_server: dict) -> dict:
    """§4, judged where a quantized config ran beside its dense twin (QUANTIZED): at each load its
    mean QoE and TTFT p99 beside the twin's, the loads where its QoE was lower, and a lone reader's
    tokens a second; met where neither was ever lower."""
    verdicts = {}
    for name, loads_ in by_server.items():
        dense = by_server.get(twin(name) or "")
        if dense is None:
            continue
        behind, said = [], []
        for load, f in loads_.items():
            d = dense.get(load)
            if not (f and d) or "qoe_mean" not in f or "qoe_mean" not in d:
                continue
            lower = round(f["qoe_mean"], 3) < round(d["qoe_mean"], 3)
            slower = load.startswith("single") and (f.get("single_tokens_per_s") or 0) < (
                d.get("single_tokens_per_s") or 0
            )
            if lower or slower:
                behind.append(load)
            said.append(
                f"{load}: {f['qoe_mean']:.3f} / {d['qoe_mean']:.3f}, TTFT p99 {f['ttft_p99'] or 0:.2f} / {d['ttft_p99'] or 0:.2f} s"
                + (
                    f", {f['single_tokens_per_s']:.2f} / {d['single_tokens_per_s']:.2f} tok/s"
                    if load.startswith("single")
                    else ""
                )
                + (" (behind)" if load in behind else "")
            )
        met = not behind
        print(
            f"  {name} against {twin(name)} (§4: never worse at any load, mean QoE, a lone reader's tokens/s): "
            f"{'met' if met else 'NOT met, behind at ' + ', '.join(behind)}\n    " + "; ".join(said),
            flush=True,
        )
        verdicts[name] = {"against": twin(name), "met": met, "behind": behind}
    return verdicts


def goal_ratio(mine, theirs, below) -> tuple[float | None, str, bool]:
    """Ours over the peer's, how to say it, and whether it is a bound: a plain ratio; a bound
    ("more than") where the peer's 0 means "below the lowest level measured" (BELOW); infinite
    where the peer's figure is a measured 0 (a QoE) and ours is not."""
    if mine is None or theirs is None:
        return None, "n/a", False
    if theirs:
        return mine / theirs, f"{mine / theirs:.2f}x", False
    if below:
        return mine / below, f"more than {mine / below:.2f}x (the peer held none, down to {below:g})", True
    if mine:
        return float("inf"), "inf (the peer's 0)", False
    return None, "n/a (both 0)", False


def overload(mine: dict, them: dict) -> dict:
    """The issue's goal at twice the peer's sustainable rate (the lowest measured rate at or past
    it): mean QoE at least OVERLOAD_QOE x the peer's, and at least half the readers at 0.95."""
    goal = (
        f"at 2x the peer's sustainable rate: mean QoE at least {OVERLOAD_QOE}x the peer's, half the readers at >= 0.95"
    )
    target = 2 * them["sustainable_rate"]
    rate = min((r for r in mine["by_rate"] if r >= target and r in them["by_rate"]), default=None)
    if not them["sustainable_rate"] or rate is None:
        below = them.get("sustainable_below")
        if them["sustainable_rate"]:
            why = f"no rate of {target:g}/s or more measured on both"
        elif below:
            why = f"the peer held none, down to {below:g}/s: its sustainable rate lies below, twice it below {2 * below:g}/s"
            if (most := overload_bound(them, 2 * below)) is not None and most < OVERLOAD_QOE:
                print(f"    {goal}: at most {most:.2f}x ({why}) -> NOT met", flush=True)
                return {"rate": None, "ratio_at_most": most, "met": False}
        else:
            why = "no sustainable rate"
        print(f"    {goal}: n/a ({why}) -> NOT met", flush=True)
        return {"rate": None, "met": False}
    a, b = mine["by_rate"][rate], them["by_rate"][rate]
    ratio = a["qoe_mean"] / b["qoe_mean"] if b["qoe_mean"] else float("inf")
    met = ratio >= OVERLOAD_QOE and a["qoe_share_95"] >= 0.5
    # A QoE is at most 1: past a peer's QoE of 1 / OVERLOAD_QOE no server could meet the ratio, and
    # the line says so rather than leave it read as this server's shortfall (run43: the peer's 0.945)
    ceiling = 1.0 / b["qoe_mean"] if b["qoe_mean"] else float("inf")
    why = (
        f" (at most {ceiling:.2f}x for any server: the peer's own {b['qoe_mean']:.3f})"
        if ceiling < OVERLOAD_QOE
        else ""
    )
    print(
        f"    {goal} ({rate:g}/s): {ratio:.2f}x, {a['qoe_share_95']:.0%} at >= 0.95{why} -> {'met' if met else 'NOT met'}",
        flush=True,
    )
    return {"rate": rate, "ratio": ratio, "share_95": a["qoe_share_95"], "met": met, "ceiling": ceiling}


def overload_bound(them: dict, under: float) -> float | None:
    """Where twice the peer's sustainable rate is only known to lie under `under`: the most the
    QoE ratio there can be. QoE falls as the rate grows, so the peer's QoE there is at least its
    QoE at any measured rate from `under` up, and ours is at most 1: the ratio is at most 1 over
    the peer's QoE at the lowest such rate. None where no such rate was measured on the peer."""
    rate = min((r for r in them["by_rate"] if r >= under), default=None)
    floor = them["by_rate"][rate]["qoe_mean"] if rate is not None else 0.0
    return 1.0 / floor if floor else None


def plot(out, path):
    if (plt := pyplot()) is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, loads_ in out["servers"].items():
        rates, bursts = sorted(of_kind(loads_, "rate").items()), sorted(of_kind(loads_, "burst").items())
        a.plot([r for r, _ in rates], [f["qoe_mean"] for _, f in rates], "o-", label=name)
        b.plot([n for n, _ in bursts], [f["qoe_mean"] for _, f in bursts], "o-", label=name)
    for ax in (a, b):
        ax.axhline(0.95, color="gray", ls="--")
    a.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="mean QoE (on tokens)", ylim=(0, 1.02))
    b.set(xlabel="burst size (requests at once)", ylabel="mean QoE (on tokens)", ylim=(0, 1.02))
    a.legend(fontsize=7)
    fig.suptitle(
        f"{out['model']} in {out['dtype']}, equal work, interleaved; Poisson answers of {LENGTHS[0]}-{LENGTHS[1]} "
        f"tokens, bursts of {BURST_TOKENS}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    import lm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("LM_MODEL", "bundled"))
    p.add_argument("--dtype", default=None, help="the same for every server (default: the project's)")
    p.add_argument(
        "--device", default=None, help="cuda, mps or cpu, the same for every server (default: the best found)"
    )
    p.add_argument(
        "--settle",
        type=float,
        default=SETTLE_MAX,
        help="seconds to wait at most for quiet servers before each run (a GPU server's idle threads may spin)",
    )
    p.add_argument("--server-args", default="", help="more options for this server, as one string ('--max-batch 256')")
    p.add_argument("--quick", action="store_true", help=f"fewer loads: {QUICK}")
    p.add_argument("--rates", default=",".join(map(str, RATES)), help="Poisson arrival rates, requests a second")
    p.add_argument("--bursts", default=",".join(map(str, BURSTS)), help="burst sizes")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"seconds of arrivals at each rate (default {SECONDS:g}, more at a rate below {MIN_ARRIVALS / SECONDS:g}/s:"
        f" {MIN_ARRIVALS} arrivals expected)",
    )
    p.add_argument(
        "--load-limit",
        type=float,
        default=None,
        help="seconds a load may run on a server: requests not done by then are cut and count as failed"
        " (default: none; a lent GPU's minutes are few)",
    )
    p.add_argument("--configs", default="qoe", help=f"this server's settings, of {', '.join(CONFIGS)}")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run transformers serve too")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    args.rates = QUICK["rates"] if args.quick else [float(x) for x in args.rates.split(",") if x]
    args.bursts = QUICK["bursts"] if args.quick else [int(x) for x in args.bursts.split(",") if x]
    args.seconds = QUICK["seconds"] if args.quick else args.seconds
    if args.load_limit is not None and any(window(args.seconds, r) >= args.load_limit for r in args.rates):
        p.error(
            "--load-limit must be longer than every rate's seconds of arrivals (--seconds): arrivals after it are cut"
        )
    lm.configure(model=args.model, device=args.device)
    args.dtype_asked = args.dtype is not None
    args.dtype = args.dtype or str(lm.dtype()).removeprefix("torch.")
    if args.peer and args.model in lm.NAMED[1:]:
        print(f"the peer is skipped: --model {args.model} lives only in this project's processes", flush=True)
        args.peer = False
    out = {
        "model": args.model,
        "device": lm_device(args),
        "dtype": args.dtype,
        "lengths": LENGTHS,
        "burst_tokens": BURST_TOKENS,
    }
    out |= {
        "seconds": {f"{r:g}": window(args.seconds, r) for r in args.rates},
        "peer_eos": PEER_EOS,
        "interleaved": True,
    }
    servers = start(args)
    try:
        out["idle_cpu_ticks"] = idle_cpu(servers)
        print(f"idle CPU ticks in {IDLE_SECONDS:g} s (an idle server must use none): {out['idle_cpu_ticks']}")
        out["servers"] = run(args, servers, lm.tok)
        out["sizes"] = {name: s["sizes"] for name, s in servers.items() if "sizes" in s}
    finally:
        stop(servers)
    out["headlines"] = headlines(out["servers"])
    out["goals"] = compare(out["headlines"])
    out["quantized"] = against_dense(out["servers"])
    saved = Path(args.results) / "qoe.json"
    client.save(saved, out)
    picture = plot(out, Path(args.results) / "qoe.png")
    print(f"saved {saved}" + (f" and {picture}" if picture else ""), flush=True)
    return out


if __name__ == "__main__":
    main()
