"""What a prompt joining the batch copies instead of computing: the longest beginning it shares
with a prompt already in a slot of the KV cache, else a kept shared beginning (prefixes.py).

The same question asked twice, or one conversation's earlier turns, begin alike well past the
system prompt. A prompt that shares at least PREFIX_MIN tokens more than the kept prefix with a
row in a slot copies that row's keys and values (kv.SlotKV.copy) and computes only the rest (at
least its last token, for its own logits): what vLLM's automatic prefix cache and SGLang's
RadixAttention skip. Where the other row is still computing that beginning (in the same step, or
a long prompt a chunk a step), the prompt waits for it rather than computing it twice; a row
that leaves first hands it over on its way out (`inherit`). An exact repeat of a prompt that the
step's pass completes (its twin) waits for nothing: after the pass it copies all of the twin's
keys and takes its first token from the twin's logits (`twins`, `ride`), so it joins in the same
step instead of a step later for one token (a burst of 48 joined in a third pass of 9-12 such).
The benchmark's burst of 48 chat prompts, drawn from prompts.json's 20, had ~2,300 prompt tokens
past the system prompt, ~900 of them distinct.

Plain functions over token ids, rows (anything with ids, a slot and its fill), the slots and the
kept prefixes: no threads, no model (batch.py calls them; the tests drive them directly).
A row that has left leaves its keys to prefixes.py (`retain`), where a prompt not started finds
them as it finds a kept shared beginning. A row copies only from rows of its own `cache_salt`
(prefixes.py: tenants apart).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, TypeVar

from streaming.generation.kv import SlotKV
from streaming.generation.prefixes import PREFIX_MIN, Prefixes, shared_beginning


class Joiner(Protocol):
    """What sharing reads and sets of a row (the engine's Row)."""

    ids: list[int]
    salt: str | None  # its request's cache_salt: it shares keys only with rows of the same
    slot: int | None
    filled: int  # prompt tokens in its slot
    length: int  # tokens in its slot


R = TypeVar("R", bound=Joiner)


def beginning(row: Joiner, ahead: Iterable[R], prefixes: Prefixes) -> tuple[R | None, int, int]:
    """What a prompt not started can copy: the row of `ahead` whose prompt shares the longest
    beginning with it, at least PREFIX_MIN tokens past a kept prefix; how long; and the kept
    prefix's length. (None, 0, kept) where no row does."""
    n = prefixes.length(row.ids, row.salt)
    others = ((r, r.ids) for r in ahead if r is not row and r.salt == row.salt)
    donor, share = shared_beginning(row.ids, others, PREFIX_MIN + n)
    return donor, share, n


def to_prefill(joining: Iterable[Joiner], holders: Sequence[Joiner], prefixes: Prefixes) -> int:
    """Prompt tokens the joining prompts still have to compute: each one's rest, less for those
    not started what they will copy (from a row in a slot or a prompt ahead of them, or kept)."""
    total, ahead = 0, list(holders)
    for r in joining:
        if r.slot is None:
            donor, share, kept = beginning(r, ahead, prefixes)
            riding = donor is not None and donor.ids == r.ids and donor.filled < len(donor.ids)
            total += 0 if riding else len(r.ids) - max(share, kept)
            ahead.append(r)
        else:
            total += len(r.ids) - r.filled
    return total


def start(row: Joiner, donor: Joiner | None, share: int, kv: SlotKV, prefixes: Prefixes) -> int:
    """A prompt takes its slot, with the `share` tokens its donor's slot holds copied into it, or
    else a kept shared beginning. Returns the tokens copied from the donor."""
    kv.take(row)
    assert row.slot is not None
    if donor is not None:
        assert donor.slot is not None and donor.filled >= share
        kv.copy(donor.slot, row.slot, share)
        row.filled = row.length = share
        return share
    if (kept := prefixes.lookup(row.ids, row.salt)) is not None:
        n, layers = kept
        kv.put(row.slot, layers, n)
        row.filled = row.length = n
    return 0


def inherit(gone: list[R], waiting: Iterable[R], holders: list[R], prefixes: Prefixes) -> Iterator[tuple[R, R, int]]:
    """Before rows leave: each prompt not started whose best donor is one of them, with that donor
    and the share to take from it (a donor whose answer ended at its first token), for the caller
    to `start` before the slots go."""
    for row in [r for r in waiting if r.slot is None]:
        donor, share, _ = beginning(row, holders, prefixes)
        if donor is not None and any(donor is r for r in gone) and donor.filled >= share:
            yield row, donor, share


def twins(pieces: Iterable[tuple[R, int]], joining: Iterable[R]) -> list[tuple[R, R]]:
    """The prompts not started that repeat exactly (same ids, same salt) a prompt whose last piece
    is among `pieces`: each with that twin, to `ride` on it once the pass has run."""
    ending: dict[tuple[str | None, int], list[R]] = {}
    for r, n in pieces:
        if r.filled + n == len(r.ids):
            ending.setdefault((r.salt, len(r.ids)), []).append(r)
    if not ending:  # (a decode step: the prompts waiting are not walked)
        return []
    out = []
    for row in joining:
        if row.slot is None:
            twin = next((t for t in ending.get((row.salt, len(row.ids)), ()) if t.ids == row.ids), None)
            if twin is not None:
                out.append((row, twin))
    return out


def ride(row: Joiner, twin: Joiner, kv: SlotKV) -> int:
    """After the pass that completed `twin`'s prompt: `row` takes a slot with all of its keys (its
    first token comes from the twin's logits). Returns the tokens copied."""
    kv.take(row)
    assert row.slot is not None and twin.slot is not None and twin.filled == len(row.ids)
    kv.copy(twin.slot, row.slot, len(row.ids))
    row.filled = row.length = len(row.ids)
    return len(row.ids)
