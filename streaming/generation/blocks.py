"""Decode attention in blocks of slots of like length, and when the slots are worth sorting.

A decode step's attention read every slot in use up to the longest row (the rest masked): beside
a row of 350 tokens, one of 60 read 350. In steady traffic, answers of 50-300 tokens starting at
any time, that padding was measured at 12 ms of a 131 ms forward pass (63 rows, the bundled
model in bfloat16, contexts spread over 60-350 against all at their mean, 209). So the slots are
read in blocks, each to its own longest row:

- `cuts`: where to cut the slots in use (in slot order) so that reading each block to its own
  longest costs least, a block also paying a call's fixed cost (a shortest path over cuts every
  few slots); a block with no row decoding is not read at all;
- `Sorter`: blocks pay where the slots are in order of length. Rows join at the end (they are the
  shortest) and leave from anywhere (kv.py moves the last slot into the hole), so the order
  decays, and a sort copies every row that moves. Blocks are cut only between pieces of `grain`
  slots, so a sort puts each row in its piece by rank and moves only the rows in another piece
  (their order within a piece does not matter). The ski-rental rule: sort once the reads spent
  since the last sort beyond what sorted slots would have read come to what the sort copies
  (never more than twice the best choice made in hindsight).

Costs are in token-reads: one token's keys and values read in every layer. Pure arithmetic over
lengths; kv.py moves the keys, attention.py reads the blocks.
Leaves out: pages, and a variable-length attention kernel (torch has none for the CPU).
"""

from __future__ import annotations

import itertools
import math

GRAIN = 4  # cuts fall every GRAIN slots at least (and then every n / MOST_PIECES: a few hundred pairs a step)
MOST_PIECES = 16
# A block's fixed cost in token-reads, by device: on the CPU about 20 us a layer for the call and
# its slices, where a token-read took about 1.5 us in a step (the bundled model, bfloat16, 24
# layers: 12.4 ms of padding over 8,500 token-reads); a GPU launches kernels for tens of us where
# reading a token costs nanoseconds: there blocks are worth little, and a high cost keeps one.
CALL_TOKENS = {"cpu": 330.0}
OTHER_CALL_TOKENS = 8192.0
# A token moved by a sort, in token-reads: it is read and written twice (gathered, then put back):
# 2.4 us against attention's 0.8-1.5 us to read it (measured on the AVX-512 kind).
COPY_TOKENS = 2.0


def call_tokens(device: str) -> float:
    """A block's fixed cost in token-reads on this device ("cpu", "cuda:0", "mps")."""
    return CALL_TOKENS.get(device.split(":")[0], OTHER_CALL_TOKENS)


def grain_of(n: int) -> int:
    """Slots a piece holds with n slots in use: blocks are cut between pieces."""
    return max(GRAIN, -(-n // MOST_PIECES))


def cuts(reads: list[int], call: float) -> tuple[list[tuple[int, int, int]], float]:
    """Blocks (start, end, longest) over slots 0..n-1, slot i read to `reads[i]` tokens this
    step (0: not read, its row sits the step out or is no decoding row), and what they cost in
    token-reads: each block reads every one of its slots to its longest, and pays `call`. The
    blocks with nothing to read are left out (they cost nothing)."""
    n = len(reads)
    if n == 0:
        return [], 0.0
    grain = grain_of(n)
    edges = [*range(0, n, grain), n]
    tops = [max(reads[a:b]) for a, b in itertools.pairwise(edges)]
    best, start = [0.0] + [math.inf] * len(tops), [0] * (len(tops) + 1)
    for j in range(1, len(tops) + 1):
        top = 0
        for i in range(j - 1, -1, -1):  # the last block is pieces i..j-1
            top = max(top, tops[i])
            cost = best[i] + ((edges[j] - edges[i]) * top + call if top else 0.0)
            if cost < best[j]:
                best[j], start[j] = cost, i
    blocks, j = [], len(tops)
    while j > 0:
        i = start[j]
        if top := max(tops[i:j]):
            blocks.append((edges[i], edges[j], top))
        j = i
    return blocks[::-1], best[-1]


class Sorter:
    """When to sort the slots, longest first (the ski-rental rule above)."""

    def __init__(self, call: float, copy: float = COPY_TOKENS) -> None:
        self.call, self.copy = call, copy
        self.spent = 0.0  # token-reads spent since the last sort beyond sorted slots' reads

    def due(self, lengths: list[int]) -> list[int] | None:
        """Called once a step with each slot's tokens: the order to put the slots in (slot s gets
        the row now in slot order[s]) once it pays, else None. The order puts every row in its
        piece by rank, longest first, and leaves in place each row that is in its piece."""
        n = len(lengths)
        if n <= GRAIN:  # one block, whatever the order
            return None
        order = pieces_by_rank(lengths)
        moved = [i for s, i in enumerate(order) if s != i]
        if not moved:
            self.spent = 0.0
            return None
        self.spent += cuts(lengths, self.call)[1] - cuts([lengths[i] for i in order], self.call)[1]
        if self.spent < self.copy * len(moved) * max(lengths[i] for i in moved):
            return None
        self.spent = 0.0
        return order


def pieces_by_rank(lengths: list[int]) -> list[int]:
    """An order of the slots (slot s gets the row now in slot order[s]) in which each piece of
    `grain_of(n)` slots holds the rows of its ranks by length, longest first; a row already in
    its piece keeps its slot, and the others fill the places left, in rank order."""
    n = len(lengths)
    grain = grain_of(n)
    ranked = sorted(range(n), key=lambda i: (-lengths[i], i))
    piece = [0] * n
    for rank, i in enumerate(ranked):
        piece[i] = rank // grain
    order = [i if piece[i] == i // grain else -1 for i in range(n)]
    arriving: dict[int, list[int]] = {}
    for i in ranked:
        if piece[i] != i // grain:
            arriving.setdefault(piece[i], []).append(i)
    for s in range(n):
        if order[s] < 0:
            order[s] = arriving[s // grain].pop(0)
    return order
