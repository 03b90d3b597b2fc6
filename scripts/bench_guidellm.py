"""The field's own benchmark tool, guidellm (the vLLM project's), against this server and
`transformers serve --continuous-batching`, both up at once, at equal work, interleaved.

    python scripts/bench.py guidellm [--quick] [--rates 0.1,0.2] [--streams 4,8] [--output-tokens 100]

guidellm 0.8.1 is installed into a virtual environment of its own (.venv-guidellm, about a minute
and a half the first time: it pins packages this project's environment must not take). Each
profile (one request at a time, Poisson at each rate, then N requests always in flight for each
--streams N) runs on one server then the other, the order alternating. The concurrent profile is
the load guidellm's client keeps on two cores beside the servers: its Poisson profile sends in
bursts when its workers fall behind (the `most in 1 s` column), while N streams are N streams
whenever each starts. guidellm asks this server for exactly `output_tokens` (`ignore_eos`,
`max_completion_tokens`); `transformers serve` refuses `ignore_eos` (422, "Unexpected fields"), so
guidellm is given it a `max_tokens` instead, with the `generation_config` of bench_qoe.py that
makes it generate exactly that many (checked: guidellm's report counts the output tokens).
Synthetic prompts of --prompt-tokens tokens, the bundled tokenizer. Saves guidellm's report per
server and profile under results/guidellm/ (JSON and CSV) and prints its console tables; the
summary below them is TTFT, inter-token latency and output tokens a second, median and p99, side
by side. Benchmarks are not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import bench_qoe
from benchkit import pct

from streaming.launch import ROOT
from streaming.model.bundled import converted_folder

VERSION = "0.8.1"
VENV = ROOT / ".venv-guidellm"
RATES = [0.1, 0.2]  # requests a second (Poisson): this AVX2 machine serves about 0.1/s at reading speed in float32
SECONDS = (
    120  # of each Poisson or concurrent profile (answers running at its end are cut: guidellm counts them incomplete)
)
SYNCHRONOUS = 3  # requests one at a time
STREAMS = [4, 8]  # guidellm's concurrent profile: requests always in flight (a burst of 8 is what this kind serves)
QUICK = {"rates": [0.35], "streams": [2], "seconds": 20, "synchronous": 2}


def guidellm() -> Path:
    """The guidellm command, installed into its own environment if it is not there."""
    exe = VENV / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing guidellm {VERSION} into {VENV} (once, about 1.5 minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "--quiet", f"guidellm=={VERSION}"], check=True)
    return exe


def backend(port: int, ours: bool, tokens: int, model: str | None) -> str:
    value: dict = {"kind": "openai_http", "target": f"http://127.0.0.1:{port}"}
    if model is not None:
        value["model"] = model
    if not ours:  # equal work: the peer has no ignore_eos (it answers 422 to the field), so guidellm is
        # not told the output length (it would send ignore_eos) but a max_tokens, and the peer
        # bench_qoe's generation_config, which makes it generate exactly that many
        value["max_tokens"] = tokens
    # the same sampling on both (temperature 0.7, top_p 0.9: bench_qoe's), not the format's
    # defaults on one side (top_p 1 costs this server less a token than a nucleus does)
    value["extras"] = {"body": bench_qoe.extra(ours, tokens)}
    return json.dumps(value)


def profile_run(exe: Path, name: str, server: dict, profile: str, args, folder: Path, out: Path) -> dict | None:
    data = f"kind=synthetic_text,prompt_tokens={args.prompt_tokens}"
    if server["ours"]:
        data += f",output_tokens={args.output_tokens}"  # guidellm then sends ignore_eos and the length
    kind, _, rate = profile.partition(" ")
    if kind == "synchronous":
        prof, constraint = "kind=synchronous", f"kind=max_requests,count={args.synchronous}"
    elif kind == "concurrent":
        prof, constraint = f"kind=concurrent,streams={rate}", f"kind=max_duration,seconds={args.seconds}"
    else:
        prof, constraint = f"kind=poisson,rate={rate}", f"kind=max_duration,seconds={args.seconds}"
    stem = out / f"{name.replace(', ', '-').replace(' ', '_')}-{profile.replace(' ', '-')}"
    argv = [str(exe), "run", "--backend", backend(server["port"], server["ours"], args.output_tokens, server["model"])]
    argv += ["--profile", prof, "--constraint", constraint, "--data", data]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={folder}", "--disable-progress"]
    argv += ["--output", "kind=console", "--output", f"kind=json,path={stem}.json"]
    argv += ["--output", f"kind=csv,path={stem}.csv"]
    print(f"\n== guidellm, {profile}, {name}", flush=True)
    r = subprocess.run(argv, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"), text=True)
    if r.returncode != 0 or not Path(f"{stem}.json").exists():
        print(f"guidellm failed (exit {r.returncode})", flush=True)
        return None
    return summary(json.loads(Path(f"{stem}.json").read_text()))


def summary(report: dict) -> dict:
    """TTFT, inter-token latency (ms) and output tokens of guidellm's successful requests (its
    JSON's benchmarks[*].requests.successful): the requests a max_duration profile cancels at its
    end ("incomplete", partial or not started: guidellm queues arrivals ahead) are counted, never
    averaged in (a 30-s run once averaged 169 cancelled requests into 2.5 tokens each)."""
    ok: list[dict] = []
    cut = errored = 0
    starts: list[float] = []  # when guidellm sent each request, to see the load it really made
    for bench in report.get("benchmarks") or []:
        requests = (bench or {}).get("requests") or {}
        ok += [r for r in requests.get("successful") or [] if isinstance(r, dict)]
        cut += len(requests.get("incomplete") or [])
        errored += len(requests.get("errored") or [])
        for kind in ("successful", "incomplete", "errored"):
            starts += [
                r["request_start_time"]
                for r in requests.get(kind) or []
                if isinstance(r, dict) and isinstance(r.get("request_start_time"), int | float)
            ]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in ok if isinstance(r.get(key), int | float)]

    ttft, itl, tokens = values("time_to_first_token_ms"), values("inter_token_latency_ms"), values("output_tokens")
    began, ended = values("request_start_time"), values("request_end_time")
    span = max(ended) - min(began) if began and ended else 0.0  # the finished requests' tokens over their span
    return {
        "ttft_ms_p50": pct(ttft, 50),
        "ttft_ms_p99": pct(ttft, 99),
        "itl_ms_p50": pct(itl, 50),
        "itl_ms_p99": pct(itl, 99),
        "requests": len(ok),
        "incomplete": cut,
        "errored": errored,
        "output_tokens_mean": sum(tokens) / len(tokens) if tokens else None,
        "tokens_per_s": sum(tokens) / span if span > 0 else None,
        "sent": len(starts),
        "most_in_1s": most_within(sorted(starts), 1.0),
    }


def most_within(times: list[float], seconds: float) -> int:
    """The most of the sorted `times` inside any window of `seconds`: guidellm's Poisson profile
    catches up in a burst when its workers fall behind (on 2 cores, beside the servers: once 20
    requests at its start against evenly spaced ones on the other server), so its loads are
    checked, not assumed."""
    best, first = 0, 0
    for last, t in enumerate(times):
        while t - times[first] > seconds:
            first += 1
        best = max(best, last - first + 1)
    return best


def main(argv=None):
    import lm

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.environ.get("LM_MODEL", "bundled"))
    p.add_argument("--dtype", default=None, help="the same for every server (default: the project's)")
    p.add_argument("--device", default=None, help="cuda, mps or cpu, every server's (default: the best found)")
    p.add_argument("--server-args", default="", help="more options for this server, as one string")
    p.add_argument("--quick", action="store_true", help=f"fewer profiles: {QUICK}")
    p.add_argument("--rates", default=",".join(map(str, RATES)), help="Poisson arrival rates, requests a second")
    p.add_argument("--streams", default=",".join(map(str, STREAMS)), help="concurrent profiles: requests in flight")
    p.add_argument("--seconds", type=int, default=SECONDS, help="seconds of each Poisson or concurrent profile")
    p.add_argument("--synchronous", type=int, default=SYNCHRONOUS, help="requests of the one-at-a-time profile")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=100)
    p.add_argument("--configs", default="qoe", help="this server's settings (bench_qoe.CONFIGS)")
    p.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True, help="run transformers serve too")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    rates = QUICK["rates"] if args.quick else [float(x) for x in args.rates.split(",") if x]
    streams = QUICK["streams"] if args.quick else [int(x) for x in args.streams.split(",") if x]
    if args.quick:
        args.seconds, args.synchronous = QUICK["seconds"], QUICK["synchronous"]
    lm.configure(model=args.model, device=args.device)
    args.dtype_asked = args.dtype is not None
    args.dtype = args.dtype or str(lm.dtype()).removeprefix("torch.")
    if args.model in lm.NAMED[1:]:
        args.peer = False  # (the test models live only in this project's processes)
    # the bundled model's folder (its tokenizer too, for the test models), made before the peer reads it
    folder = converted_folder() if args.model in lm.NAMED else Path(args.model)
    exe = guidellm()
    out_dir = Path(args.results) / "guidellm"
    out_dir.mkdir(parents=True, exist_ok=True)
    servers = bench_qoe.start(args)
    table: dict = {name: {} for name in servers}
    try:
        profiles = ["synchronous"] + [f"poisson {r:g}" for r in rates] + [f"concurrent {n}" for n in streams]
        for i, profile in enumerate(profiles):
            names = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in names:
                table[name][profile] = profile_run(exe, name, servers[name], profile, args, folder, out_dir)
    finally:
        bench_qoe.stop(servers)
    print("\nguidellm, side by side (ms; output tokens per request, asked:", args.output_tokens, ")", flush=True)
    print(
        "  profile         server                           TTFT p50    p99   ITL p50    p99  requests  tokens  cut"
        "  sent  most in 1 s  tokens/s"
    )
    for profile in profiles:
        for name in servers:
            s = table[name].get(profile) or {}
            print(
                f"  {profile:14s}  {name:32s} {s.get('ttft_ms_p50') or 0:8.0f} {s.get('ttft_ms_p99') or 0:6.0f}"
                f"  {s.get('itl_ms_p50') or 0:8.1f} {s.get('itl_ms_p99') or 0:6.1f}  {s.get('requests', 0):8d}"
                f"  {s.get('output_tokens_mean') or 0:6.1f}  {s.get('incomplete', 0):3d}"
                f"  {s.get('sent', 0):4d}  {s.get('most_in_1s', 0):11d}  {s.get('tokens_per_s') or 0:8.1f}",
                flush=True,
            )
    saved = out_dir / "summary.json"
    saved.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "profiles": table}, indent=2))
    print(f"saved {saved} and guidellm's reports in {out_dir}", flush=True)
    return table


if __name__ == "__main__":
    main()
