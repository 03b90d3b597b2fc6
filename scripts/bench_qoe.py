"""What readers feel under load: QoE with Poisson arrivals and with bursts, this server's
schedules and kernels against `transformers serve --continuous-batching`, in one run.

    python scripts/bench.py qoe [--quick] [--eos] [--rates 0.5,1,2] [--bursts 8,16,32,48]
                                [--configs fifo,qoe,qoe+int8] [--no-peer]

Every server gets the same requests, drawn once with a fixed seed: OpenAI chat streams of the
prompts in prompts.json with answer lengths uniform in LENGTHS (this server is told ignore_eos;
the peer takes no such option, so it is given max_tokens and what it streams is counted), at
temperature 0.7. The peer's answers end at end of sequence, which for these prompts comes after
about 45 pieces, a quarter of the drawn lengths: with `--eos` this server stops there too, so
every server does the same work (the fair comparison; without it this server streams the drawn
lengths, four times the peer's tokens). Two workloads:

- Poisson arrivals at each rate (requests a second) for --seconds;
- bursts: N requests at once.

First one reader alone (SINGLE tokens: first text, then tokens a second). Per rate and per N:
mean QoE, p10 QoE, the share of readers at QoE >= 0.95 (streaming/qoe.py, a
piece counted as a token), TTFT p50/p99, gap p99, tokens a second. The headlines: the
**sustainable rate**, the highest rate whose mean QoE >= 0.95, and **readers served**, the
largest burst in which 95% of readers get QoE >= 0.95; each with its ratio to the peer's. Saves
results/qoe.json and results/qoe.png (mean QoE against the arrival rate, a line per server).
Benchmarks are not tests: nothing here asserts.

Leaves out: arrival rates past the point where every server is clearly overloaded, and
llama.cpp's server (it builds from source here, about 10 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import bench

import client
from streaming import qoe
from streaming.launch import Server
from streaming.model.bundled import bundled_folder

LENGTHS = (50, 300)  # tokens an answer: uniform, as the issue asks
SINGLE = 300  # tokens of the single-stream measurement
TEMPERATURE = 0.7
RATES = [0.25, 0.5, 1.0, 1.5, 2.0]  # requests a second (Poisson)
BURSTS = [8, 16, 32, 48, 64]
SECONDS = 40.0  # of arrivals at each rate
QUICK = {"rates": [0.5, 1.0, 2.0], "bursts": [16, 48], "seconds": 20.0}
CONFIGS = {  # this server's settings to compare: name -> options
    "fifo": ["--schedule", "fifo"],
    "qoe": ["--schedule", "qoe"],
    "fifo+int8": ["--schedule", "fifo", "--quantize", "int8"],
    "qoe+int8": ["--schedule", "qoe", "--quantize", "int8"],
}
PEER = "transformers serve --continuous-batching"


def workload(rate: float | None, n: int, seconds: float, seed: int) -> list[tuple[float, int, int]]:
    """(start offset s, prompt index, max_tokens) per request: Poisson at `rate`, or n at once."""
    rnd = random.Random(seed)
    out, t = [], 0.0
    while True:
        if rate is not None:
            t += rnd.expovariate(rate)
            if t >= seconds:
                return out
        elif len(out) == n:
            return out
        out.append((t if rate is not None else 0.0, rnd.randrange(len(bench.PROMPTS)), rnd.randint(*LENGTHS)))


async def drive(port: int, requests, ignore_eos: bool, model: str | None):
    url = f"http://127.0.0.1:{port}"

    async def one(i, start, prompt, tokens):
        await asyncio.sleep(max(0.0, start - (time.perf_counter() - t0)))
        extra = {"temperature": TEMPERATURE} | ({"ignore_eos": True} if ignore_eos else {})
        try:
            return await client.api_post("openai", bench.PROMPTS[prompt], tokens, url, seed=i, extra=extra, model=model)
        except (OSError, ValueError, client.ServerError) as e:
            return e

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    return results, time.perf_counter() - t0


def figures(results, wall) -> dict:
    good = [r for r in results if not isinstance(r, BaseException)]
    scores = [qoe.qoe([(t, 1) for t in r.arrivals]) for r in good] + [0.0] * (len(results) - len(good))
    ttft = [r.first for r in good if r.first is not None]
    gaps = [b - a for r in good for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    return {
        **qoe.summary(scores),
        "requests": len(results),
        "failed": len(results) - len(good),
        "ttft_p50": bench.pct(ttft, 50),
        "ttft_p99": bench.pct(ttft, 99),
        "gap_p99": bench.pct(gaps, 99),
        "tokens_per_s": sum(len(r.pieces) for r in good) / wall if wall else None,
        "wall_s": wall,
    }


def run_server(name, port, args, ours, model=None) -> dict:
    print(f"\n{name}", flush=True)
    print("  load          QoE mean  p10  >=.95   TTFT p50   p99 s   gap p99 ms   tokens/s   pieces", flush=True)
    asyncio.run(drive(port, workload(None, 2, 0, 0), ours, model))  # warm
    streamed = "every server stops at end of sequence" if args.eos else "the peer stops at end of sequence"
    out: dict = {"rates": {}, "bursts": {}}
    (one,), _ = asyncio.run(drive(port, [(0.0, 0, SINGLE)], ours, model))  # one reader alone, SINGLE tokens if it can
    if isinstance(one, BaseException):
        raise one
    streamed = one.arrivals[-1] - one.arrivals[0]
    out["single"] = {"ttft_s": one.first, "tokens_per_s": (len(one.arrivals) - 1) / streamed if streamed else None}
    print(f"  one reader alone: first text {one.first:.2f} s, then {out['single']['tokens_per_s']:.1f} tokens/s")
    plans = [("rate", r) for r in args.rates] + [("burst", n) for n in args.bursts]
    for kind, x in plans:
        requests = workload(x if kind == "rate" else None, int(x), args.seconds, seed=int(100 * x))
        results, wall = asyncio.run(drive(port, requests, ours and not args.eos, model))
        f = figures(results, wall)
        f["mean_pieces"] = sum(len(r.pieces) for r in results if not isinstance(r, BaseException)) / len(results)
        f["streamed"] = streamed
        out["rates" if kind == "rate" else "bursts"][str(x)] = f
        label = f"{x:g}/s Poisson" if kind == "rate" else f"burst of {x}"
        print(
            f"  {label:14s}  {f['qoe_mean']:.2f}  {f['qoe_p10']:.2f}  {f['qoe_share_95']:.2f}   "
            f"{f['ttft_p50'] or 0:6.2f}  {f['ttft_p99'] or 0:6.2f}   {1000 * (f['gap_p99'] or 0):8.0f}   "
            f"{f['tokens_per_s']:8.1f}   {f['mean_pieces']:6.0f}"
            + (f"   ({f['failed']} failed)" if f["failed"] else ""),
            flush=True,
        )
    out["sustainable_rate"] = max((float(r) for r, f in out["rates"].items() if f["qoe_mean"] >= 0.95), default=0.0)
    out["readers_served"] = max((int(n) for n, f in out["bursts"].items() if f["qoe_share_95"] >= 0.95), default=0)
    print(f"  sustainable rate {out['sustainable_rate']:g}/s; readers served in a burst {out['readers_served']}")
    return out


def ours(args, config, out, saved):
    child = Server(
        f"this server, {config}", "--model", args.model, "--dtype", args.dtype, "--port", "0", *CONFIGS[config]
    )
    try:
        child.wait()
        out["servers"][f"this server, {config}"] = run_server(f"this server, {config}", child.port, args, True)
    finally:
        child.stop()
    client.save(saved, out)


def peer(args, out, saved):
    folder = bundled_folder() if args.model == "bundled" else args.model
    try:
        p = bench.start_peer(folder, args.dtype)
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"\n{PEER}: could not start ({e})", flush=True)
        return
    try:
        out["servers"][PEER] = run_server(PEER, p.port, args, False, model=str(folder))
    finally:
        p.stop()
    client.save(saved, out)


def compare(out) -> None:
    them = out["servers"].get(PEER)
    print("\nheadlines (this machine, one run):")
    for name, r in out["servers"].items():
        line = f"  {name:44s} sustainable rate {r['sustainable_rate']:g}/s, readers served {r['readers_served']}"
        line += f", one stream {r['single']['tokens_per_s']:.1f} tokens/s"
        if them and name != PEER:
            ratios = {}
            for key in ("sustainable_rate", "readers_served"):
                ratios[key] = r[key] / them[key] if them[key] else None
            ratios["single"] = r["single"]["tokens_per_s"] / them["single"]["tokens_per_s"]
            r["vs_peer"] = ratios
            line += "; vs the peer " + ", ".join(f"{v:.2f}x" if v else "-" for v in ratios.values())
        print(line, flush=True)


def plot(out, path):
    if (plt := bench.pyplot()) is None:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in out["servers"].items():
        rates = sorted(r["rates"], key=float)
        a.plot([float(x) for x in rates], [r["rates"][x]["qoe_mean"] for x in rates], "o-", label=name)
        ns = sorted(r["bursts"], key=int)
        b.plot([int(n) for n in ns], [r["bursts"][n]["qoe_share_95"] for n in ns], "o-", label=name)
    a.axhline(0.95, color="gray", ls="--")
    b.axhline(0.95, color="gray", ls="--")
    a.set(xlabel="arrival rate (requests/s, Poisson)", ylabel="mean QoE", ylim=(0, 1.02))
    b.set(xlabel="burst size (requests at once)", ylabel="share of readers at QoE >= 0.95", ylim=(0, 1.02))
    a.legend(fontsize=7)
    fig.suptitle(f"{out['model']} in {out['dtype']}, answers of {LENGTHS[0]}-{LENGTHS[1]} tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    import lm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("LM_MODEL", "bundled"))
    p.add_argument("--dtype", default=None, help="the same for every server (default: the project's)")
    p.add_argument("--quick", action="store_true", help=f"fewer loads: {QUICK}")
    p.add_argument("--rates", default=",".join(map(str, RATES)), help="Poisson arrival rates, requests a second")
    p.add_argument("--bursts", default=",".join(map(str, BURSTS)), help="burst sizes")
    p.add_argument("--seconds", type=float, default=SECONDS, help="seconds of arrivals at each rate")
    p.add_argument("--configs", default="fifo,qoe,qoe+int8", help=f"this server's settings, of {', '.join(CONFIGS)}")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run transformers serve too")
    p.add_argument(
        "--eos",
        action="store_true",
        help="this server stops at end of sequence too (the peer has no ignore_eos): the same work for all",
    )
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    args.rates = QUICK["rates"] if args.quick else [float(x) for x in args.rates.split(",") if x]
    args.bursts = QUICK["bursts"] if args.quick else [int(x) for x in args.bursts.split(",") if x]
    args.seconds = QUICK["seconds"] if args.quick else args.seconds
    lm.configure(model=args.model)
    args.dtype = args.dtype or str(lm.dtype()).removeprefix("torch.")
    out = {"model": args.model, "dtype": args.dtype, "lengths": LENGTHS, "seconds": args.seconds, "eos": args.eos}
    out["servers"] = {}
    saved = Path(args.results) / "qoe.json"
    for config in [c for c in args.configs.split(",") if c]:
        ours(args, config, out, saved)
    if args.peer and args.model in lm.NAMED[1:]:
        print(f"\nthe peer is skipped: --model {args.model} lives only in this project's processes", flush=True)
    elif args.peer:
        peer(args, out, saved)
    compare(out)
    client.save(saved, out)
    picture = plot(out, Path(args.results) / "qoe.png")
    print(f"saved {saved}" + (f" and {picture}" if picture else ""), flush=True)
    return out


if __name__ == "__main__":
    main()
