"""Many readers at once: the load benchmark of the batched engine, the thread engine and a peer.

    python scripts/bench.py load [--model bundled] [--dtype bfloat16] [--ns 1,4,16,32,48,64] [--no-peer]
    python scripts/bench.py profile [--model bundled] [--dtype float32]     # where a step's time goes
    python scripts/bench.py qoe [--quick]     # QoE at equal work, interleaved with the peer (scripts/bench_qoe.py)
    python scripts/bench.py guidellm [--quick]   # guidellm against both servers (scripts/bench_guidellm.py)
    python scripts/bench.py merging [--rounds 3]   # tokens per event, fast and slow readers (scripts/bench_merging.py)
    python scripts/bench.py turns      # a conversation's next turns, ended answers' keys kept or not (bench_turns.py)

For each server (this one with --engine batched, this one with --engine thread, and the peer
`transformers serve --continuous-batching`), one after the other on the same model, dtype and
prompts: N concurrent readers each stream a TOKENS-token answer over SSE (OpenAI's chat format,
which all three speak), for N in --ns. Per N it reports the time to first text p50/p99, the gaps
between pieces p50/p99/max, and the aggregate tokens a second; the headline is **readers served
at reading speed**: the largest N with gap p99 <= GAP_LIMIT and TTFT p99 <= TTFT_LIMIT. Also:
the largest gap 16 streaming readers see while a JOIN_TOKENS-token prompt joins; the tokens
generated after 16 of 32 readers leave mid-stream; and the server's own CPU time per event with a
generator that costs nothing (--engine free) against uvicorn + Starlette's StreamingResponse.
Saves results/load.json and results/load.png. Benchmarks are not tests: nothing here asserts.

Leaves out: a sweep past the point where a server is clearly behind (CUTOFF), and other peers.
"""

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from pathlib import Path

import bench_guidellm
import bench_merging
import bench_qoe
import bench_turns
from benchkit import PROMPTS, cpu_seconds, pct, pyplot, start_peer

import client
from streaming import qoe
from streaming.launch import ROOT, Process, Server, free_port
from streaming.model.bundled import converted_folder

NS = [1, 4, 16, 32, 48, 64]  # concurrent readers
TOKENS = 100  # tokens per answer, as the article's experiments
GAP_LIMIT = 0.180  # s between pieces: past it a reader at 5.5 tokens/s catches up with the text
TTFT_LIMIT = 1.0  # s to first text
CUTOFF = 3.0  # stop a server's sweep once its gap p99 is past CUTOFF x GAP_LIMIT: larger N only take longer
JOIN_TOKENS = 2000  # the long prompt that joins 16 running streams
JOIN_READ = 60  # tokens each of those 16 readers asks for: enough to span the join on a slow CPU
LEAVE_TOKENS = 40  # tokens each of the 32 readers of the leave measurement asks for
FREE_EVENTS = 4000  # events a request in the per-event cost measurement (max_tokens allows 4096)


async def readers(port, n, tokens=TOKENS, offset=0, leave_after=None, ours=True, model=None):
    url = f"http://127.0.0.1:{port}"

    async def one(i):
        prompt = PROMPTS[(i + offset) % len(PROMPTS)]
        body = {"ignore_eos": True} if ours else {}  # the peer takes no ignore_eos: its answers may end early
        stop = leave_after if leave_after and i % 2 == 0 else None
        return await client.api_post("openai", prompt, tokens, url, seed=i, stop_after=stop, extra=body, model=model)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    wall = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    return [r for r in results if not isinstance(r, BaseException)], wall, failed


def figures(results, wall):
    ttft = [r.first for r in results if r.first is not None]
    gaps = [b - a for r in results for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    pieces = sum(len(r.pieces) for r in results)
    quality = qoe.summary([qoe.qoe([(t, 1) for t in r.arrivals]) for r in results])  # a piece is a token
    return {
        **quality,
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "gap_p50": pct(gaps, 50),
        "gap_p99": pct(gaps, 99),
        "gap_max": max(gaps, default=None),
        "tokens_per_s": pieces / wall if wall else None,
        "pieces": pieces,
        "wall_s": wall,
    }


def share(x):
    return "   -" if x is None else f"{x:4.2f}"


def ms(x):
    return "    -" if x is None else f"{1000 * x:5.0f}"


def metrics(port):
    try:
        return asyncio.run(client.get_json("/metrics.json", port=port))
    except (OSError, ValueError, client.ServerError):
        return {}


def sweep(name, port, ns, ours=True, cutoff=CUTOFF, model=None, on_row=None):
    print(f"\n{name}", flush=True)
    print(
        "    N  TTFT p50  p99 ms   gap p50   p99   max ms   tokens/s   mean step ms   QoE mean  p10  >=.95", flush=True
    )
    rows = {}
    asyncio.run(readers(port, 1, 5, ours=ours, model=model))  # warm
    for n in ns:
        before = metrics(port)
        results, wall, failed = asyncio.run(readers(port, n, ours=ours, model=model))
        after = metrics(port)
        f = figures(results, wall)
        f["failed"] = len(failed)
        steps = after.get("steps", 0) - before.get("steps", 0)
        f["mean_step_ms"] = 1000 * (after["step_seconds"] - before["step_seconds"]) / steps if steps else None
        rows[n] = f
        if on_row:  # saved as it goes: a long sweep interrupted keeps its rows
            on_row(n, f)
        step = f"{f['mean_step_ms']:8.0f}" if f["mean_step_ms"] else "       -"
        print(
            f"  {n:3d}  {ms(f['ttft_p50'])}  {ms(f['ttft_p99'])}     {ms(f['gap_p50'])} {ms(f['gap_p99'])} {ms(f['gap_max'])}"
            f"   {f['tokens_per_s']:8.1f}   {step}      {share(f['qoe_mean'])} {share(f['qoe_p10'])} {share(f['qoe_share_95'])}"
            + (f"   ({len(failed)} failed)" if failed else ""),
            flush=True,
        )
        if f["gap_p99"] is None or cutoff and f["gap_p99"] > cutoff * GAP_LIMIT:
            print(f"  (past {cutoff:g}x the gap limit: larger N not run)", flush=True)
            break
    result = {"rows": rows, **headlines(rows)}
    print(
        f"  readers served at reading speed: {result['readers_at_reading_speed']} "
        f"(by the gaps alone, TTFT aside: {result['readers_at_reading_speed_gaps_only']})",
        flush=True,
    )
    return result


def headlines(rows):
    """The largest N at reading speed (gap p99 and TTFT p99 within their limits), and by the gaps alone."""
    fine = {n: f for n, f in rows.items() if f["gap_p99"] is not None and not f["failed"]}
    return {
        "readers_at_reading_speed": max(
            (n for n, f in fine.items() if f["gap_p99"] <= GAP_LIMIT and f["ttft_p99"] <= TTFT_LIMIT), default=0
        ),
        "readers_at_reading_speed_gaps_only": max((n for n, f in fine.items() if f["gap_p99"] <= GAP_LIMIT), default=0),
    }


def long_prompt(tokens=JOIN_TOKENS):
    import lm

    text, ids = "", []
    i = 0
    while len(ids) < tokens:
        text += PROMPTS[i % len(PROMPTS)] + "\n"
        ids = lm.tok(text).input_ids
        i += 1
    return lm.tok.decode(ids[:tokens])


def join(port, prompt, ours=True, model=None):
    """16 readers streaming; once all have text, a long prompt joins: the largest gap they see."""

    async def run():
        task = asyncio.ensure_future(readers(port, 16, JOIN_READ, ours=ours, model=model))
        await asyncio.sleep(0.5)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until all 16 are in the batch (where /metrics says so)
            try:
                if (await client.get_json("/metrics.json", port=port)).get("active", 16) >= 16:
                    break
            except (OSError, ValueError, client.ServerError):
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)
        t_join = time.perf_counter()
        url = f"http://127.0.0.1:{port}"
        joined = await client.api_post(
            "openai", prompt, 10, url, extra={"ignore_eos": True} if ours else {}, model=model
        )
        results, wall, failed = await task
        return results, joined, t_join

    results, joined, t_join = asyncio.run(run())
    gaps = [b - a for r in results for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    return {"largest_gap_s": max(gaps, default=None), "joined_ttft_s": joined.first, "readers": len(results)}


def leave(port):
    """32 readers; 16 leave after 10 pieces: the tokens generated for them after they left."""
    before = metrics(port)
    asyncio.run(readers(port, 32, LEAVE_TOKENS, leave_after=10))
    time.sleep(1.0)
    after = metrics(port)
    stopped = after["requests_stopped"] - before["requests_stopped"]
    extra = after["tokens_after_stop"] - before["tokens_after_stop"]
    return {"readers_left": stopped, "tokens_after_stop": extra, "per_reader": extra / stopped if stopped else None}


STARLETTE_APP = """
import json
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

async def stream(request):
    body = await request.json()
    async def events():
        for _ in range(body["max_tokens"]):
            yield "data: " + json.dumps({"text": " x"}) + "\\n\\n"
        yield "data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")

app = Starlette(routes=[Route("/stream", stream, methods=["POST"])])
"""


def event_cost(model):
    """Server CPU time per event: ours (--engine free) and uvicorn + Starlette, same events."""
    out = {}
    ours = Server("free server", "--port", "0", "--engine", "free", "--model", model, "--stream-merge", "off")
    try:
        ours.wait()
        out["this server"] = cost_of(ours.port, ours.proc.pid)
    finally:
        ours.stop()
    app = ROOT / "results" / "_starlette_app.py"
    app.parent.mkdir(exist_ok=True)
    app.write_text(STARLETTE_APP)
    port = free_port()
    exe = [sys.executable, "-m", "uvicorn", "--app-dir", str(app.parent), "_starlette_app:app"]
    uvicorn = Process("uvicorn", [*exe, "--port", str(port), "--log-level", "warning"], port=port, quiet=True)
    try:
        uvicorn.wait(60)
        out["uvicorn + Starlette"] = cost_of(port, uvicorn.proc.pid)
    finally:
        uvicorn.stop(10)
        app.unlink()
    return out


def cost_of(port, pid, events=FREE_EVENTS, rounds=5):
    """The server process's CPU seconds over `rounds` requests of `events` events, per event."""
    asyncio.run(client.post("/stream", "x", 100, port=port))  # warm
    c0, t0, n = cpu_seconds(pid), time.perf_counter(), 0
    for _ in range(rounds):
        n += len(asyncio.run(client.post("/stream", "x", events, port=port)).pieces)
    wall, cpu = time.perf_counter() - t0, cpu_seconds(pid) - c0
    return {"events": n, "cpu_us_per_event": 1e6 * cpu / n, "wall_us_per_event": 1e6 * wall / n}


def plot(results, path):
    if (plt := pyplot()) is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results["servers"].items():
        ns = sorted(int(n) for n in r["rows"])
        a.plot(ns, [1000 * r["rows"][n]["gap_p99"] for n in ns], "o-", label=name)
        b.plot(ns, [r["rows"][n]["tokens_per_s"] for n in ns], "o-", label=name)
    a.axhline(1000 * GAP_LIMIT, color="gray", ls="--", label=f"{1000 * GAP_LIMIT:.0f} ms: reading speed")
    a.set(xlabel="concurrent readers", ylabel="gap between pieces, p99 (ms)", yscale="log")
    b.set(xlabel="concurrent readers", ylabel="tokens a second, all readers")
    a.legend(fontsize=8)
    b.legend(fontsize=8)
    fig.suptitle(
        f"{results['model']} on {results['device']} in {results['dtype']}, {TOKENS}-token answers", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load(args):
    import lm

    ns = [int(n) for n in args.ns.split(",")]
    lm.configure(model=args.model)
    args.dtype = args.dtype or str(lm.dtype()).removeprefix("torch.")
    out = {"tokens": TOKENS, "gap_limit_s": GAP_LIMIT, "ttft_limit_s": TTFT_LIMIT, "servers": {}, "join": {}}
    saved = Path(args.results) / "load.json"
    if args.merge and saved.exists():  # add rows (more N, or another server) to an earlier run
        out = json.loads(saved.read_text())
        for r in out["servers"].values():
            r["rows"] = {int(n): f for n, f in r["rows"].items()}
    prompt = long_prompt()
    for engine in [e for e in args.engines.split(",") if e]:
        this_server(args, engine, ns, prompt, out, saved)
        client.save(saved, out)  # so far, in case a later part fails
    if args.peer and args.model in lm.NAMED[1:] and not args.peer_folder:
        print(f"\nthe peer is skipped: --model {args.model} lives only in this project's processes", flush=True)
    elif args.peer:
        folder = args.peer_folder or (converted_folder() if args.model == "bundled" else args.model)
        the_peer(args, folder, ns, prompt, out, saved)
    if args.extras:
        print("\nserver's own CPU time per event, a generator that costs nothing:", flush=True)
        out["event_cost"] = event_cost(args.model)
    for name, c in out.get("event_cost", {}).items():
        print(f"  {name:22s} {c['cpu_us_per_event']:6.1f} µs CPU a event ({c['events']} events)", flush=True)
    compare(out)
    client.save(saved, out)
    picture = plot(out, Path(args.results) / "load.png")
    print(f"saved {saved}" + (f" and {picture}" if picture else ""), flush=True)
    return out


def this_server(args, engine, ns, prompt, out, saved):
    """This server with one engine: the sweep, and for the batched engine the join and leave."""
    common = ["--model", args.model, "--dtype", args.dtype, "--port", "0", *bench_qoe.NO_RETAIN]  # equal work
    child = Server(f"--engine {engine}", *common, "--engine", engine)
    try:
        child.wait()
        info = metrics(child.port)
        out.update(model=info.get("model"), device=info.get("device"), dtype=info.get("dtype"))
        name = f"this server, --engine {engine}"
        merge(out, name, sweep(name, child.port, ns, cutoff=args.cutoff, on_row=keep(out, name, saved)))
        if engine == "batched" and args.extras:  # (16 threads of the thread engine: many minutes here)
            print(f"  a {JOIN_TOKENS}-token prompt joins 16 streams:", end=" ", flush=True)
            j = out["join"][engine] = join(child.port, prompt)
            print(
                f"the largest gap they saw {1000 * j['largest_gap_s']:.0f} ms; "
                f"its first text after {j['joined_ttft_s']:.1f} s",
                flush=True,
            )
            lv = out["leave"] = leave(child.port)
            print(
                f"  16 of 32 readers leave after 10 pieces: {lv['tokens_after_stop']} tokens generated after they left ({lv['per_reader']:.2f} a reader)",
                flush=True,
            )
    finally:
        child.stop()


def the_peer(args, folder, ns, prompt, out, saved):
    """`transformers serve --continuous-batching`: the sweep and the join."""
    name = "transformers serve --continuous-batching"
    try:
        peer = start_peer(folder, args.dtype)
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"\n{name}: could not start ({e})", flush=True)
        return
    try:
        model = str(folder)  # it serves only the model it was started with, by that name
        rows = sweep(name, peer.port, ns, ours=False, cutoff=args.cutoff, model=model, on_row=keep(out, name, saved))
        merge(out, name, rows)
        if args.extras:
            print(f"  a {JOIN_TOKENS}-token prompt joins 16 streams:", end=" ", flush=True)
            j = out["join"]["peer"] = join(peer.port, prompt, ours=False, model=model)
            print(f"the largest gap they saw {1000 * j['largest_gap_s']:.0f} ms", flush=True)
    finally:
        peer.stop()


def compare(out):
    """The headline, side by side: readers at reading speed, and the batched engine's ratios."""
    heads = {name: r["readers_at_reading_speed"] for name, r in out["servers"].items()}
    print("\nreaders served at reading speed:", ", ".join(f"{k}: {v}" for k, v in heads.items()), flush=True)
    mine = "this server, --engine batched"
    mine_n = heads.get(mine, 0)
    for other, v in heads.items():
        if other == mine or mine not in out["servers"]:
            continue
        out.setdefault("ratios", {})[other] = mine_n / v if v else None
        line = f"  batched / {other}: readers " + (f"{mine_n / v:.2f}x" if v else f"{mine_n} against {v}")
        common = set(out["servers"][mine]["rows"]) & set(out["servers"][other]["rows"])
        if common:  # capacity where both ran: the tokens a second all readers got
            n = max(common)
            a, b = out["servers"][mine]["rows"][n], out["servers"][other]["rows"][n]
            out.setdefault("throughput_ratios", {})[other] = {"n": n, "ratio": a["tokens_per_s"] / b["tokens_per_s"]}
            line += f"; tokens a second at {n} readers {a['tokens_per_s'] / b['tokens_per_s']:.2f}x"
            line += f", gap p50 {1000 * a['gap_p50']:.0f} ms against {1000 * b['gap_p50']:.0f}"
        print(line, flush=True)


def keep(out, name, path):
    """on_row for sweep(): merge each row into the results and save them."""

    def on_row(n, f):
        merge(out, name, {"rows": {n: f}})
        client.save(path, out)

    return on_row


def merge(out, name, result):
    """A server's sweep into the results, keeping rows of other N from an earlier run."""
    old = out["servers"].get(name, {"rows": {}})["rows"]
    rows = {**old, **result["rows"]}
    result["rows"] = dict(sorted(rows.items()))
    result.update(headlines(rows))
    out["servers"][name] = result


def profile(args):
    """Where a step's time goes: one decode step of the model at profile_batches() (a 64-token
    context) with the kernels measured at load (streaming/model/kernels.py) and with F.linear
    everywhere, and torch.profiler's top operators at batch 16."""
    import torch

    import lm
    from streaming.model import judging, kernels

    lm.configure(model=args.model, device=args.device, dtype=args.dtype, kernels="measure")
    m = lm.model()
    ids = lm.tok(PROMPTS[0]).input_ids[:64]
    out = {"model": lm.model_name(), "dtype": str(lm.dtype()).removeprefix("torch."), "step_ms": {}, "linear_ms": {}}
    out["device"] = str(m.device)
    out["quantize"] = lm.quantization()  # LM_QUANTIZE=int8 profiles the quantized kernels
    out["kernels"] = getattr(m, "kernel_tables", None)
    layers = [x for x in m.modules() if isinstance(x, kernels.ChosenLinear)]
    print(f"kernels: {kernels.describe(out['kernels'] or {})}")
    print(f"one decode step, {len(ids)}-token context, {out['dtype']}, --quantize {out['quantize']}:", flush=True)

    def timed(b):
        """Medians of decode steps with the chosen kernels and with F.linear forced, in turn over one
        cache (a drift of the machine, or a first touch of memory, falls on both alike)."""
        c = batch_cache(m, ids, b)
        step = functools.partial(decode_step, m, c)
        everywhere = functools.partial(judging.forced_pass, [(layers, "linear")], step, b)
        median = judging.medians({None: functools.partial(step, b), "linear": everywhere}, STEP_ROUNDS)
        return [1000 * median[k] for k in (None, "linear")]

    # the first steps of a fresh process touch the weights' pages and oneDNN's caches: a batch of
    # one timed first took 104 ms a step against 78 right after (AMD EPYC, bfloat16): one discarded
    timed(1)
    for b in profile_batches():
        chosen, plain = timed(b)  # the same weights, F.linear forced
        out["step_ms"][b], out["linear_ms"][b] = chosen, plain
        print(
            f"  batch {b:2d}: {chosen:6.0f} ms a step ({chosen / b:6.1f} a token); "
            f"F.linear everywhere {plain:6.0f} ms: {plain / chosen:4.2f}x",
            flush=True,
        )
    out["engine_parts_ms"] = engine_parts(lm, out)
    c = batch_cache(m, ids, 16)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if m.device.type == "cuda":  # the kernels' own time too: on a GPU the CPU's time is the launches
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        decode_step(m, c, 16)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    print("batch 16, top operators by their own CPU time:\n" + table, flush=True)
    out["top_ops_batch16"] = table
    if m.device.type == "cuda":
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=8)
        print("batch 16, top kernels by their own GPU time:\n" + table, flush=True)
        out["top_kernels_batch16"] = table
    client.save(Path(args.results) / "profile.json", out)
    return out


def profile_batches() -> tuple[int, ...]:
    """profile's batch sizes: the kernel tables' row counts (kernels.ROWS) up to PROFILE_MOST, so
    each band's own kernels are shown (48 among them since the tables time it: a burst of 48)."""
    from streaming.model import kernels

    return tuple(r for r in kernels.ROWS if r <= PROFILE_MOST)


def batch_cache(m, ids, b):
    """A KV cache of b rows, each the prefilled context `ids`."""
    import torch
    from transformers import DynamicCache

    c = DynamicCache(config=m.config)
    with torch.inference_mode():
        m(input_ids=torch.tensor([ids], device=m.device), cache=c, use_cache=True, logits_to_keep=1)
    for layer in c.layers:
        layer.keys, layer.values = layer.keys.repeat(b, 1, 1, 1), layer.values.repeat(b, 1, 1, 1)
    return c


def decode_step(m, c, b):
    """One decode step of b rows over the cache c, finished (a GPU's kernels run after the call
    returns: waited for, or the timings would be the launches')."""
    import torch

    from streaming.generation.parts import device_sync

    with torch.inference_mode():
        m(input_ids=torch.full((b, 1), 100, device=m.device), cache=c, use_cache=True, logits_to_keep=1)
    if (sync := device_sync(str(m.device))) is not None:
        sync()


PROFILE_MOST = 64  # profile: the largest batch timed, as since it began (batched.MAX_BATCH, a CPU's default)
STEP_ROUNDS = 4  # profile: decode steps timed per kernel choice and batch size (after one to warm up)
PARTS_CONTEXT = 300  # tokens of each row's context in the engine's step profile (the "32 rows of 300")
PARTS_STEPS = 4  # steps timed per batch size
JOINING = 4  # chat prompts that join the running rows in the profile's joining step


def engine_parts(lm, out):
    """The batched engine's own steps, in this process without its thread: for each batch size,
    every row at a PARTS_CONTEXT-token context, PARTS_STEPS steps of every row (fifo), then as many
    with half the rows sitting out (what the qoe schedule's steps cost when readers are ahead), then
    a step in which JOINING chat prompts join the running rows (their prefill rides in the same
    pass); per step, the milliseconds of each part (streaming/generation/parts.py)."""
    from streaming.generation.prompts import encode_chat
    from streaming.wire.params import plain_request

    ids = (lm.tok(" ".join(PROMPTS)).input_ids * 4)[:PARTS_CONTEXT]
    params = plain_request({"prompt": "x", "max_tokens": 4000, "ignore_eos": True}).params
    # JOINING prompts to time, then two others that start together first: the chat template's
    # shared beginning is learned from them (prefixes.py: two distinct prompts; twins copy each
    # other instead), so the timed step is a join as most are, not the rare pass that learns it
    chats = [encode_chat(lm.handle(), [{"role": "user", "content": p}], params) for p in PROMPTS[: JOINING + 2]]
    result = {}
    print(f"the engine's step by part, ms (a {PARTS_CONTEXT}-token context, {out['dtype']}):", flush=True)
    print(
        f"  rows  step  forward  sampling    kv  hand-off | half the rows sit out: step  kv"
        f" | {JOINING} prompts join ({sum(map(len, chats[:JOINING]))} tokens): step  forward",
        flush=True,
    )
    asyncio.run(parts_at(lm, 1, ids, chats, params))  # the engine's first steps warm it: discarded
    for b in profile_batches():
        t = asyncio.run(parts_at(lm, b, ids, chats, params))
        result[b] = t
        a, h = t["all"], t["half"]
        print(
            f"  {b:4d} {a['step']:5.0f} {a['forward']:8.0f} {a['sampling']:9.1f} {a['kv']:5.1f} {a['hand_off']:9.1f}"
            f" | {h['step']:27.0f} {h['kv']:3.1f} | {t['join']['step']:5.0f} {t['join']['forward']:8.0f}",
            flush=True,
        )
    return result


async def parts_at(lm, b, ids, chats, params):
    """engine_parts at b rows: each kind of step's milliseconds, in all and by part."""
    import torch

    from streaming.generation.batched import BatchEngine
    from streaming.generation.policy import Fifo, Plan

    class Half(Fifo):
        def plan(self, rows, now, joining=None, costs=None, waiting=None):  # noqa: ARG002 - as Fifo.plan
            return Plan(list(range(0, len(rows), 2)), self.budget)

    # plain steps, without guessed tokens (--speculate: a step's tokens would vary with its rows' text)
    e = BatchEngine(lm.handle(), max_batch=b, policy=Fifo(PARTS_CONTEXT * b, speculate=0))
    jobs = admit(e, [ids] * b, params)
    with torch.inference_mode():
        while e.batch.joining:
            e.batch.step()
        timed = {}
        for name, policy in (("all", Fifo(0, speculate=0)), ("half", Half(0, speculate=0))):
            e.batch.policy = policy
            e.batch.parts.reset()
            t0 = time.perf_counter()
            for _ in range(PARTS_STEPS):
                e.batch.step()
            step = 1000 * (time.perf_counter() - t0) / PARTS_STEPS
            timed[name] = {"step": step, **{k: 1000 * v / PARTS_STEPS for k, v in e.batch.parts.snapshot().items()}}
        e.batch.policy = Fifo(10_000, speculate=0)
        jobs += admit(e, chats[JOINING:], params)  # the chat template's shared beginning, learned once
        e.batch.step()
        jobs += admit(e, chats[:JOINING], params)
        e.batch.parts.reset()
        t0 = time.perf_counter()
        e.batch.step()
        join = 1000 * (time.perf_counter() - t0)
        timed["join"] = {"step": join, **{k: 1000 * v for k, v in e.batch.parts.snapshot().items()}}
    for job in jobs:
        job.stop.set()
    return timed


def admit(e, prompts, params):
    """Requests for these prompts, placed in the engine's batch by hand (no thread runs it)."""
    from streaming.generation.batch import Row
    from streaming.generation.batched import BatchedJob

    jobs = [BatchedJob(e, p, params) for p in prompts]
    for job in jobs:
        job.stats.active.add(job)
        e.waiting.append(Row(job, 0.0))
    e.batch.admit(e.max_batch + len(prompts))
    return jobs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["qoe"]:  # QoE under Poisson arrivals and bursts, interleaved: its own script
        return bench_qoe.main(argv[1:])
    if argv[:1] == ["guidellm"]:  # the field's benchmark tool against the same servers: its own script
        return bench_guidellm.main(argv[1:])
    if argv[:1] == ["merging"]:  # pieces per event: --stream-interval and adaptive merging
        return bench_merging.main(argv[1:])
    if argv[:1] == ["turns"]:  # a conversation's next turns: --retain-memory
        return bench_turns.main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "what",
        choices=["load", "profile", "qoe", "guidellm", "merging", "turns"],
        help="qoe, guidellm, merging, turns: see scripts/bench_qoe.py, bench_guidellm.py, bench_merging.py, bench_turns.py",
    )
    p.add_argument("--model", default=os.environ.get("LM_MODEL", "bundled"))
    p.add_argument("--device", default=None, help="profile: cuda, mps or cpu (default: the best found)")
    p.add_argument(
        "--dtype",
        default=None,
        help="the same for every server (default: the project's, bfloat16 only with native bf16)",
    )
    p.add_argument("--ns", default=",".join(map(str, NS)), help="reader counts, comma-separated")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run transformers serve too")
    p.add_argument("--peer-folder", default=None, help="a model folder for the peer (default: the bundled model's)")
    p.add_argument("--cutoff", type=float, default=CUTOFF, help="stop a sweep past this x the gap limit (0: never)")
    p.add_argument("--engines", default="batched,thread", help="load: which of this server's engines to run")
    p.add_argument(
        "--extras",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load: the join, leave and per-event measurements",
    )
    p.add_argument("--merge", action="store_true", help="load: add to results/load.json instead of replacing it")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    (load if args.what == "load" else profile)(args)


if __name__ == "__main__":
    main()
