"""What a resumable stream costs in Redis, and what one Redis takes: docs/scaling.md's figures.

    python scripts/bench_store.py [--model tiny] [--tokens 1000]

1. Memory: a server with --store redis:// streams one resumable answer of --tokens tokens
   (ignore_eos); Redis' MEMORY USAGE of its stream and its hash, per event and per stream.
2. This server's CPU per event, resumable streams from the free engine (no model): --store memory
   against --store redis:// (the mirror's share).
3. Events a second one Redis takes: XADD of an entry of the measured size from redis-benchmark,
   50 clients, one command at a time and pipelined 16 deep (the mirror writes what piled up in one
   round trip), spread over 1,000 streams; and lease renewals (shared.RENEW_SCRIPT: a live
   stream's lease and its keys' time to live, once a second), pipelined 16 deep.

Saves results/store.json. Leaves out Redis on another machine (a network's round trip is longer
than the loopback's; the mirror's one command a round trip, whatever piled up, absorbs it).
"""

import argparse
import json
import re
import subprocess
import time
from pathlib import Path

import redis
from benchkit import cpu_seconds

from streaming import reader
from streaming.launch import Server
from streaming.redisctl import Redis
from streaming.server.resumable.store import LEASE_MS, RENEW_SCRIPT

ROUNDS = 5  # resumable streams per CPU measurement
EVENTS = 2000  # events per stream there


def memory(url, model, tokens):
    with Server("server", "--port", "0", "--model", model, "--store", url) as s:
        s.wait()
        r = reader.read(s.port, f"/stream?prompt=The%20keeper&max_tokens={tokens}&ignore_eos=true")
        time.sleep(1.5)  # the mirror has written the end
    db = redis.Redis.from_url(url)
    stream = db.memory_usage(f"streaming:s:{r.stream}", samples=0)
    meta = db.memory_usage(f"streaming:m:{r.stream}", samples=0)
    entry = db.xrange(f"streaming:s:{r.stream}", count=3)[2][1]
    db.close()
    n = len(r.events)
    out = {"tokens": tokens, "events": n, "stream_bytes": stream, "meta_bytes": meta}
    out |= {"bytes_per_event": stream / n, "bytes_per_1000_tokens": (stream + meta) * 1000 / tokens}
    out["typical_entry"] = {k.decode(): v.decode() for k, v in entry.items()}
    print(f"memory: {n} events, stream {stream} B + prompt {meta} B: {out['bytes_per_event']:.0f} B an event, "
          f"{out['bytes_per_1000_tokens'] / 1024:.0f} KiB per 1,000-token stream", flush=True)  # fmt: skip
    return out


def cpu_per_event(url):
    out = {}
    for store in ("memory", url):
        with Server("free server", "--port", "0", "--engine", "free", "--store", store) as s:
            s.wait()
            target = f"/stream?prompt=x&max_tokens={EVENTS}"
            reader.read(s.port, target)  # warm
            c0, n = cpu_seconds(s.proc.pid), 0
            for _ in range(ROUNDS):
                n += len(reader.read(s.port, target).events)
            time.sleep(0.5)  # the mirror's last writes
            us = 1e6 * (cpu_seconds(s.proc.pid) - c0) / n
        name = "memory" if store == "memory" else "redis"
        out[name] = {"events": n, "cpu_us_per_event": us}
        print(f"server CPU per resumable event, --store {name}: {us:.1f} us", flush=True)
    return out


def redis_rate(port, entry):
    out = {}
    fields = [x for k, v in entry.items() for x in (k, v)]
    for depth in (1, 16):
        argv = ["redis-benchmark", "-p", str(port), "-n", "200000", "-c", "50", "-P", str(depth), "-r", "1000", "-q"]
        p = subprocess.run([*argv, "XADD", "bench:s:__rand_int__", "*", *fields], capture_output=True, text=True)
        rate = float(re.findall(r"([\d.]+) requests per second", p.stdout)[-1])
        out[f"pipeline_{depth}"] = rate
        print(
            f"one Redis, XADD of a {sum(map(len, fields))}-byte entry, pipeline {depth}: {rate:,.0f} a second",
            flush=True,
        )
    argv = ["redis-benchmark", "-p", str(port), "-n", "200000", "-c", "50", "-P", "16", "-r", "100000", "-q"]
    keys = ["streaming:l:__rand_int__", "streaming:s:__rand_int__", "streaming:m:__rand_int__"]
    renew = ["EVAL", RENEW_SCRIPT, "3", *keys, "replica", str(LEASE_MS), "300000"]
    p = subprocess.run([*argv, *renew], capture_output=True, text=True)
    out["lease_renewals_per_s"] = float(re.findall(r"([\d.]+) requests per second", p.stdout)[-1])
    print(
        f"one Redis, lease renewals (a live stream's, each second), pipeline 16: {out['lease_renewals_per_s']:,.0f} a second"
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="the model whose text fills the stream (its bytes are what count)")
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    with Redis() as rd:
        out = {"memory": memory(rd.url, args.model, args.tokens), "cpu": cpu_per_event(rd.url)}
        out["redis_xadd_per_s"] = redis_rate(rd.port, out["memory"]["typical_entry"])
    path = Path(args.results) / "store.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
