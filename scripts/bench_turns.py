"""A conversation's next turns with and without the ended answers' keys kept (--retain-memory):
first text of turns 2 and 3 on the wire, this server twice, interleaved.

    python scripts/bench.py turns [--conversations 6] [--tokens 150]

Two servers up at once on the same model: one keeps ended answers' keys and values (its
default), one keeps none (--retain-memory 0). A conversation is a first question (prompts.json),
its answer (exactly --tokens tokens: ignore_eos), then two more questions, each request resending
the whole conversation so far in OpenAI's chat format, as every chat client does. Each
conversation runs on one server then the other, the order alternating. Printed per turn: first
text p50 and p99 on each server and their ratio, the prompt tokens (usage), and each server's own
count of prompt tokens copied from retained keys (/metrics.json). Saves results/turns.json.
Benchmarks are not tests: nothing here asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import bench_qoe
from benchkit import PROMPTS, pct

import client
from streaming.launch import Server

NEXT = ["Say more about the second thing you said.", "Now sum it all up in two sentences."]  # turns 2 and 3
CONVERSATIONS = 6
TOKENS = 150  # each answer
SERVERS = {"keeps ended answers": [], "keeps none": bench_qoe.NO_RETAIN}


async def conversation(port: int, first: str, tokens: int, seed: int) -> list[dict]:
    """One conversation's three turns on one server: each turn's first text (s) and prompt tokens."""
    url, messages, turns = f"http://127.0.0.1:{port}", [], []
    for question in [first, *NEXT]:
        messages.append({"role": "user", "content": question})
        extra = bench_qoe.extra(True, tokens) | {"messages": messages}
        r = await client.api_post("openai", question, tokens, url, seed=seed, extra=extra)
        messages.append({"role": "assistant", "content": "".join(r.pieces)})
        turns.append({"first": r.first, "prompt_tokens": (r.usage or {}).get("prompt_tokens")})
    return turns


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--conversations", type=int, default=CONVERSATIONS)
    p.add_argument("--tokens", type=int, default=TOKENS)
    p.add_argument("--server-args", default="", help="more options for both servers, as one string")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    servers = {
        name: Server(name, "--model", args.model, "--port", "0", *extra, *args.server_args.split())
        for name, extra in SERVERS.items()
    }
    runs: dict[str, list[list[dict]]] = {name: [] for name in servers}
    retained = {}
    try:
        for s in servers.values():
            s.wait()
        for i in range(args.conversations):
            order = list(servers) if i % 2 == 0 else list(servers)[::-1]
            for name in order:
                turns = asyncio.run(conversation(servers[name].port, PROMPTS[i % len(PROMPTS)], args.tokens, i))
                runs[name].append(turns)
                print(
                    f"conversation {i}, {name}: first text " + ", ".join(f"{t['first']:.2f}" for t in turns), flush=True
                )
        for name, s in servers.items():
            m = asyncio.run(client.get_json("/metrics.json", "127.0.0.1", s.port))
            retained[name] = m.get("prompt_tokens_retained")
    finally:
        for s in servers.values():
            s.stop()
    print(f"\n{args.conversations} conversations of 3 turns, {args.tokens} tokens an answer; first text in s")
    print("  turn  prompt tokens (mean)  " + "  ".join(f"{n}: p50    p99" for n in servers) + "   ratio of p50s")
    table = []
    for t in range(1 + len(NEXT)):
        firsts = {n: [c[t]["first"] for c in runs[n] if c[t]["first"] is not None] for n in servers}
        tokens = [c[t]["prompt_tokens"] for n in servers for c in runs[n] if c[t]["prompt_tokens"]]
        p50 = {n: pct(v, 50) for n, v in firsts.items()}
        keep, none = (p50[n] for n in servers)
        ratio = keep / none if keep and none else None
        row = {"turn": t + 1, "prompt_tokens": sum(tokens) / len(tokens) if tokens else None, "p50": p50}
        row["p99"] = {n: pct(v, 99) for n, v in firsts.items()}
        row["ratio"] = ratio
        table.append(row)
        cells = "  ".join(f"{' ' * len(n)}  {row['p50'][n] or 0:5.2f}  {row['p99'][n] or 0:5.2f}" for n in servers)
        print(f"  {t + 1:4d}  {row['prompt_tokens'] or 0:20.0f}  {cells}   {ratio or 0:.2f}x")
    print(
        "prompt tokens copied from retained keys (/metrics.json): " + ", ".join(f"{n} {v}" for n, v in retained.items())
    )
    out = Path(args.results) / "turns.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"conversations": runs, "table": table, "retained": retained}, indent=2))
    print(f"saved {out}", flush=True)
    return {"table": table, "retained": retained}


if __name__ == "__main__":
    main()
