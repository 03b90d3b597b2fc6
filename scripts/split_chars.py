"""A character split across tokens, decoded one token at a time and incrementally.

The article's split_chars.py: the parrot and the melting face each span three tokens, so
decoding token by token prints replacement characters, and the incremental detokenizer does not.
"""

import argparse

import client
import lm
from detokenizer import Detokenizer

parser = argparse.ArgumentParser(description=__doc__)
lm.add_arguments(parser)
lm.configure(parser.parse_args())
tok = lm.tok

text = "Con vẹt 🦜 nói: mô hình sinh văn bản từng token một 🫠"
ids = tok(text).input_ids
naive = [tok.decode([i]) for i in ids]
print(f"{len(ids)} tokens; decoded one by one:")
print("  " + " | ".join(naive))

d = Detokenizer()
pieces = [d.push(i) for i in ids] + [d.flush()]
print("incremental:")
print("  " + " | ".join(pieces[:-1]))
figures = {
    "model": lm.model_name(),
    "tokens": len(ids),
    "broken_one_by_one": sum("�" in p for p in naive),
    "broken_incremental": sum("�" in p for p in pieces),
    "joined_equal": "".join(pieces) == text,
}
print(
    f"broken pieces one by one: {figures['broken_one_by_one']}, incremental: "
    f"{figures['broken_incremental']}; joined text equal to the original: {figures['joined_equal']}"
)
client.save("results/split_chars.json", dict(figures, one_by_one=naive, incremental=pieces[:-1]))
