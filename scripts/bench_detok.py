"""Benchmark: microseconds per token of the article's Detokenizer and of StreamDetokenizer.

Each detokenizes the first 64, 512 and 4,096 tokens of real text (the prompts' paragraphs,
plus the article's Vietnamese sentence with emoji, repeated), side by side in one run; the
figure is the best of several runs of the mean cost per token. Prints the ratio 4,096/64 for
each (flat is 1.0) and saves results/bench_detok.json. Not a test: nothing here asserts a time.
"""

import argparse
import json
import time
from pathlib import Path

import lm
from detokenizer import Detokenizer, StreamDetokenizer

SIZES = (64, 512, 4096)  # tokens of text
BUDGET_S = 2.0  # seconds of repeats per (detokenizer, size); the minimum is reported

parser = argparse.ArgumentParser(description=__doc__)
lm.add_arguments(parser)
lm.configure(parser.parse_args())

prompts = json.loads((Path(__file__).resolve().parent.parent / "prompts.json").read_text())
text = "\n\n".join(
    p["prompt"] + p["human"] + " Con vẹt 🦜 nói: mô hình sinh văn bản từng token một 🫠" for p in prompts
)
ids = lm.tok(text).input_ids
while len(ids) < max(SIZES):
    ids = ids + ids


def per_token_us(cls, n):
    best, spent = float("inf"), 0.0
    while spent < BUDGET_S or best == float("inf"):
        d = cls()
        t0 = time.perf_counter()
        for i in ids[:n]:
            d.push(i)
        d.flush()
        dt = time.perf_counter() - t0
        best, spent = min(best, dt / n * 1e6), spent + dt
    return best


results = {"model": lm.model_name(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "us_per_token": {}}
for cls in (Detokenizer, StreamDetokenizer):
    row = {n: per_token_us(cls, n) for n in SIZES}
    results["us_per_token"][cls.__name__] = row
    ratio = row[SIZES[-1]] / row[SIZES[0]]
    results.setdefault("ratio_4096_over_64", {})[cls.__name__] = ratio
    cells = ", ".join(f"{row[n]:8.2f} us at {n:5d}" for n in SIZES)
    print(f"{cls.__name__:18s} {cells} tokens; {SIZES[-1]}/{SIZES[0]}: {ratio:5.2f}x")
r = results["us_per_token"]
print(
    f"at {SIZES[-1]} tokens the article's costs {r['Detokenizer'][SIZES[-1]] / r['StreamDetokenizer'][SIZES[-1]]:.0f}x the stream's per token"
)
Path("results").mkdir(exist_ok=True)
Path("results/bench_detok.json").write_text(json.dumps(results, indent=1) + "\n")
