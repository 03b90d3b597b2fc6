"""Is generation faster than reading? The article's reading_speed.py, with our own numbers.

Tokens per word on the `human` continuations of prompts.json (the real tokenizer), against a
reader's speed: 238 words a minute for non-fiction, the average across studies (Brysbaert,
2019). The generation rate is not the article's constant: it is measured now, 100 tokens of the
chosen model on this machine, and so is the time to the first token. Saves results/reading_speed.json.
"""

import argparse
import json
import time
from pathlib import Path

import lm

WORDS_PER_MINUTE = 238  # Brysbaert (2019), non-fiction, silent reading
N_TOKENS = 100  # generated for the measurement, as the article's measure.py

parser = argparse.ArgumentParser(description=__doc__)
lm.add_arguments(parser)
lm.configure(parser.parse_args())
tok = lm.tok

prompts = json.loads((Path(__file__).resolve().parent.parent / "prompts.json").read_text())
texts = [p["human"] for p in prompts]
tokens = sum(len(tok(t).input_ids) for t in texts)
words = sum(len(t.split()) for t in texts)
per_word = tokens / words
reading = WORDS_PER_MINUTE / 60 * per_word  # tokens a second a reader gets through

t0 = time.perf_counter()
lm.model()
load = time.perf_counter() - t0
for _ in lm.tokens(prompts[1]["prompt"], 2):  # warm up: the first forward pass sets up kernels
    pass
t0 = time.perf_counter()
first, n = None, 0
for _ in lm.tokens(prompts[0]["prompt"], N_TOKENS, seed=0):
    first = first or time.perf_counter() - t0
    n += 1
total = time.perf_counter() - t0
generating = n / total

print(
    f"{per_word:.2f} tokens per word; a reader at {WORDS_PER_MINUTE} words a minute takes in {reading:.1f} tokens "
    f"a second; this machine generates {generating:.0f}, {generating / reading:.1f} times as fast"
)
for n_words in (50, 300):
    k = n_words * per_word
    print(
        f"a {n_words}-word answer ({k:.0f} tokens): {k / generating:.1f} s to generate, "
        f"{n_words / WORDS_PER_MINUTE * 60:.0f} s to read; without streaming the reader waits "
        f"{k / generating:.1f} s before the first word, with it about {first:.2f} s"
    )
print(
    f"(model {lm.model_name()} on {lm.DEVICE} in {str(lm.dtype()).removeprefix('torch.')}"
    f"{', int8 Linear layers' if lm.quantization() == 'int8' else ''}: loaded in {load:.1f} s, "
    f"{n} tokens in {total:.2f} s, {generating:.1f} tokens/s, first token after {first:.2f} s)"
)
Path("results").mkdir(exist_ok=True)
Path("results/reading_speed.json").write_text(
    json.dumps(
        {
            "model": lm.model_name(),
            "device": lm.DEVICE,
            "dtype": str(lm.dtype()).removeprefix("torch."),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tokens_per_word": per_word,
            "reader_tokens_per_s": reading,
            "load_s": load,
            "generated_tokens": n,
            "generate_s": total,
            "tokens_per_s": generating,
            "first_token_s": first,
        },
        indent=1,
    )
    + "\n"
)
