"""Tokens per event: what one event a piece, `--stream-interval 4` and adaptive merging cost the
server and give a reader who keeps up and one who is slow.

    python scripts/bench.py merging [--tokens 1000] [--rounds 3] [--paces 0.001,0] [--slow-delay 0.01]

Three servers, up at once, each `--engine free` at one of --paces: paced (`--token-delay S`, one
' x' piece every S seconds: a model's pace without a model's CPU, so what differs between them is
the server's own work), then as fast as it goes (the engine ahead of every reader, as an
upstream's bursts are): **off** (`--stream-merge off`: one event a piece, as before), **interval 4**
(`--stream-interval 4 --stream-merge off`) and **adaptive** (the default: pieces already waiting
for a reader who is behind go as one event). Two readers of an OpenAI chat stream of --tokens
tokens (`ignore_eos`): **fast** reads as it comes; **slow** has a 16 KiB receive buffer and
takes SLOW_READ bytes a recv with --slow-delay seconds between (about 100 KB/s). Every round runs
each (setting, reader) pair for --answers answers, the order rotated and reversed from round to
round (these machines drift). Per pair, medians over the rounds: events per answer, bytes on the
wire, CPU microseconds per token of the server process (all its threads' schedstat time around
the answers: the paced engine's timers too, which every setting pays alike), the first text and
the whole text. Saves results/merging.json and results/merging.png: the slow reader's timeline
in the last round, a panel per pace (time on x, characters received on y, a marker at each
event, a line per setting).
Benchmarks are not tests: nothing here asserts.

Leaves out: a model (the tests and `bench.py load` run those), and the resumable streams, which
are never merged.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

from benchkit import pyplot

import client
from streaming.launch import Server
from streaming.wire import sse
from streaming.wire.http11 import END, ResponseReader

SETTINGS = {  # name: the server's options
    "off": ("--stream-merge", "off"),
    "interval 4": ("--stream-interval", "4", "--stream-merge", "off"),
    "adaptive": ("--stream-merge", "adaptive"),
}
READERS = ("fast", "slow")
SLOW_RCVBUF = 16 * 1024  # the slow reader's receive buffer: a slow link holds little in flight
SLOW_READ = 1024  # bytes a slow reader takes a recv (then sleeps --slow-delay)
FAST_READ = 65536


def request(port: int, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": "any",
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": tokens,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return (head + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def read(port: int, tokens: int, slow_delay: float | None) -> dict:
    """One answer, read fast (slow_delay None) or slowly: its events' times and characters."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if slow_delay is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SLOW_RCVBUF)  # (before connecting: the window)
    s.settimeout(60)
    s.connect(("127.0.0.1", port))
    reader, parser = ResponseReader(), sse.EventParser()
    timeline, chars, received, usage, done = [], 0, 0, None, False
    t0 = time.perf_counter()
    s.sendall(request(port, tokens))
    with s:
        while not done:
            data = s.recv(SLOW_READ if slow_delay is not None else FAST_READ)
            now = time.perf_counter() - t0
            received += len(data)
            reader.feed(data) if data else reader.feed_eof()
            while (event := reader.next_event()) is not None:
                if event is END:
                    done = True
                    break
                if not isinstance(event, bytes):
                    continue  # the head
                for e in parser.feed(event):
                    if e.data == "[DONE]":
                        continue
                    value = json.loads(e.data)
                    usage = value.get("usage") or usage
                    text = "".join(c["delta"].get("content") or "" for c in value.get("choices", []))
                    if text:
                        chars += len(text)
                        timeline.append((now, chars))
            if not data:
                break
            if slow_delay:
                time.sleep(slow_delay)
    return {"timeline": timeline, "bytes": received, "usage": usage}


def cpu_ns(pid: int) -> int:
    """A process's CPU time so far in nanoseconds, all its threads (/proc/PID/task/*/schedstat:
    /proc/PID/stat counts 10 ms ticks, too coarse for an answer's few milliseconds)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            pass
    return total


def one(server: Server, reader: str, args: argparse.Namespace) -> dict:
    """--answers answers one after another: each one's events, and the server's CPU over them all."""
    c0, answers = cpu_ns(server.proc.pid), []
    for _ in range(args.answers):
        answers.append(read(server.port, args.tokens, args.slow_delay if reader == "slow" else None))
    cpu = (cpu_ns(server.proc.pid) - c0) / 1e9
    tokens = sum((r["usage"] or {}).get("completion_tokens", args.tokens) for r in answers)
    last = answers[-1]["timeline"]

    def med(values: list[float]) -> float:
        return statistics.median(values)

    return {
        "events": med([len(r["timeline"]) for r in answers]),
        "chars": sorted({r["timeline"][-1][1] if r["timeline"] else 0 for r in answers}),
        "bytes": med([r["bytes"] for r in answers]),
        "tokens": tokens,
        "cpu_us_per_token": 1e6 * cpu / tokens,
        "first_s": med([r["timeline"][0][0] for r in answers if r["timeline"]]),
        "whole_s": med([r["timeline"][-1][0] for r in answers if r["timeline"]]),
        "timeline": last,
    }


def summary(runs: list[dict]) -> dict:
    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    keys = ("events", "bytes", "cpu_us_per_token", "first_s", "whole_s")
    chars = sorted({c for r in runs for c in r["chars"]})
    return {k: med(k) for k in keys} | {"runs": len(runs), "chars": chars}


def pace(delay: float, args: argparse.Namespace) -> dict:
    """Every (setting, reader) pair, --rounds times interleaved, against three servers paced at `delay`."""
    common = ("--port", "0", "--engine", "free", "--token-delay", str(delay), "--model", args.model)
    servers = {name: Server(name, *common, *extra) for name, extra in SETTINGS.items()}
    runs: dict[str, dict[str, list[dict]]] = {name: {r: [] for r in READERS} for name in SETTINGS}
    said = f"one piece every {1000 * delay:g} ms" if delay else "pieces as fast as the engine goes (it is ahead)"
    print(f"\n{args.tokens}-token answers, {said}:", flush=True)
    try:
        for s in servers.values():
            s.wait()
        idle = {name: cpu_ns(s.proc.pid) for name, s in servers.items()}
        time.sleep(1.0)
        idle = {name: (cpu_ns(s.proc.pid) - idle[name]) / 1e9 for name, s in servers.items()}
        print(f"  idle servers' CPU over 1 s: {', '.join(f'{n} {1000 * c:.1f} ms' for n, c in idle.items())}")
        for s in servers.values():  # warm: the first answer of a process costs more
            read(s.port, 20, None)
        pairs = [(name, reader) for reader in READERS for name in SETTINGS]
        for k in range(args.rounds):
            order = pairs[k % len(pairs) :] + pairs[: k % len(pairs)]
            for name, reader in order if k % 2 == 0 else order[::-1]:
                r = one(servers[name], reader, args)
                runs[name][reader].append(r)
                print(
                    f"  round {k + 1}: {name:10s} {reader}: {r['events']:5.0f} events, "
                    f"{r['cpu_us_per_token']:6.1f} µs CPU a token, whole text at {r['whole_s']:.2f} s",
                    flush=True,
                )
    finally:
        for s in servers.values():
            s.stop()
    return {
        "token_delay": delay,
        "idle_cpu_s": idle,
        "summary": {name: {r: summary(runs[name][r]) for r in READERS} for name in SETTINGS},
        "slow_timeline": {name: runs[name]["slow"][-1]["timeline"] for name in SETTINGS},
        "runs": {
            name: {r: [{k: v for k, v in x.items() if k != "timeline"} for x in runs[name][r]] for r in READERS}
            for name in SETTINGS
        },
    }


def table(out: dict) -> None:
    print(f"\n{out['tokens']}-token OpenAI chat streams, medians of {out['rounds']} interleaved rounds:")
    print(
        "| engine | reader | setting | events an answer | KB on the wire | server CPU µs a token | first text ms | whole text s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for p in out["paces"].values():
        engine = f"paced, {1000 * p['token_delay']:g} ms a token" if p["token_delay"] else "ahead of its reader"
        for reader in READERS:
            for name in SETTINGS:
                s = p["summary"][name][reader]
                print(
                    f"| {engine} | {reader} | {name} | {s['events']:.0f} | {s['bytes'] / 1000:.0f} "
                    f"| {s['cpu_us_per_token']:.1f} | {1000 * s['first_s']:.1f} | {s['whole_s']:.2f} |"
                )


def plot(out: dict, path: Path) -> Path | None:
    if (plt := pyplot()) is None:
        return None
    paces = list(out["paces"].values())
    fig, axes = plt.subplots(1, len(paces), figsize=(6 * len(paces), 4.5), squeeze=False)
    for ax, p in zip(axes[0], paces, strict=True):
        for name, timeline in p["slow_timeline"].items():
            t = [0.0] + [x for x, _ in timeline]
            c = [0] + [y for _, y in timeline]
            label = f"{name}: {len(timeline)} events"
            ax.plot(t, c, drawstyle="steps-post", marker="o", markersize=2.5, lw=1, label=label)
        said = (
            f"one token every {1000 * p['token_delay']:g} ms" if p["token_delay"] else "the engine ahead of the reader"
        )
        ax.set(xlabel="seconds since the request", ylabel="characters of text received", title=said)
        ax.title.set_fontsize(9)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"A slow reader ({SLOW_READ} B a recv every {1000 * out['slow_delay']:g} ms, a {SLOW_RCVBUF // 1024} KiB "
        f"receive buffer) of a {out['tokens']}-token OpenAI chat stream; a marker per event",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1000, help="tokens an answer")
    p.add_argument("--answers", type=int, default=2, help="answers a (setting, reader) pair runs each round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every (setting, reader) pair")
    p.add_argument(
        "--paces",
        default="0.001,0",
        help="the free engine's seconds between pieces (0: as fast as it goes), each in turn",
    )
    p.add_argument("--slow-delay", type=float, default=0.01, help="seconds the slow reader sleeps after each recv")
    p.add_argument("--model", default="tiny", help="the tokenizer's model (the free engine runs none)")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    out = {
        "tokens": args.tokens,
        "answers": args.answers,
        "rounds": args.rounds,
        "slow_delay": args.slow_delay,
        "slow_read": SLOW_READ,
        "slow_rcvbuf": SLOW_RCVBUF,
        "cpus": os.cpu_count(),
        "settings": {name: list(extra) for name, extra in SETTINGS.items()},
        "paces": {},
    }
    for delay in [float(x) for x in args.paces.split(",") if x]:
        out["paces"][f"{delay:g}"] = pace(delay, args)
    table(out)
    saved = Path(args.results) / "merging.json"
    client.save(saved, out)
    picture = plot(out, Path(args.results) / "merging.png")
    print(f"saved {saved}" + (f" and {picture}" if picture else ""), flush=True)
    return out
