"""The batch's KV cache as slots, and the layout of one step over them.

Every request in the batch owns a slot: a row of keys and values allocated ahead (each layer's
are (slots, kv heads, room, head dim)), filled up to the request's own length. A step is one
forward pass over a flat sequence of tokens (a batch of one): a token for each decoding row that
runs, then the pieces of prompts that join (a short prompt whole, a long one a chunk). `Layout`
says where each token goes (its slot and position); the model's layers hand their new keys and
values to `SlotKV.update`, which writes each token's into its slot, and attention
(attention.py) reads the slots through the layout. So:

- a row that sits a step out costs nothing: its slot is not touched (before, the running rows'
  keys were gathered into a smaller cache and the new column scattered back: 4-63 ms a step);
- a prompt joins in the same pass as the others' decode (Sarathi-Serve's chunked prefill), and
  copies nothing of theirs: its keys are written straight into its slot;
- a row that leaves copies one row: the last slot moves into its place, so the slots in use stay
  0..n-1;
- decode attention reads the slots in blocks, each to its own longest row, and the slots are
  sorted longest first when the padding read would cost more than the copy (blocks.py);
- the room grows by doubling (one copy of the cache, a few times in a long answer), the slots
  with a few spare (fewer for a long room), and both shrink when most of the batch has left; an
  empty batch holds no memory.

Plain tensor bookkeeping, no threads and no model: the tests drive it directly.
Leaves out: pages (vLLM's PagedAttention): every slot has room for the batch's longest row.
"""

from __future__ import annotations

import bisect
from typing import Any, Protocol

import torch

from streaming.generation.blocks import Sorter, call_tokens, cuts

FIRST_SLOTS = 8  # slots allocated at first; past them, a few spare ones are added with each that is needed
SPARE_ROOM = 8192  # tokens of room the spare slots may hold in all (copies saved against memory held)
FIRST_ROOM = 256  # tokens of room a slot has at first (doubled when a row needs more)
SHRINK = 4  # shrink when the rows in use need a quarter of what is held or less
# The most KV memory the batch may come to hold (its rows at their whole answers): a request that
# would pass it waits its turn (honest queue). Every slot holds the longest row's room, so one
# 32,000-token row among 63 short ones would be 25 GB for the bundled model in bfloat16 (12 KiB a
# token): 4 GiB is 64 rows of 5,400 tokens, or one long row and a few others.
KV_MEMORY = 4 << 30
# On CUDA, --kv-memory left out: this share of the device's memory, whatever its size. The
# weights of the models served here are a few GB of a GPU's tens; vLLM takes 0.9 of the memory for
# weights, activations and KV together, and half leaves the activations of a long prefill room.
GPU_KV_SHARE = 0.5


def default_kv_memory(device: str, total: int | None = None) -> int:
    """--kv-memory left out: KV_MEMORY, or on CUDA GPU_KV_SHARE of the device's memory (`total`
    bytes; asked of the device when not given). The engine's batch calls it, on the model's side
    (in the engine process with --engine process), so the server process never asks a GPU."""
    if not device.startswith("cuda"):
        return KV_MEMORY
    if total is None:
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return int(GPU_KV_SHARE * total)


class Holder(Protocol):
    """What a slot's owner has (the engine's Row): its slot, and the tokens in it."""

    slot: int | None
    length: int


class SlotKV:
    """Keys and values of every layer, one slot per request; the model's cache object (`update`)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.keys: dict[int, torch.Tensor] = {}  # by layer: (slots, heads, room, dim)
        self.values: dict[int, torch.Tensor] = {}
        self.owners: list[Holder] = []  # the Holder in each slot in use: owners[i].slot == i
        self.slots, self.room = FIRST_SLOTS, FIRST_ROOM  # what each layer's tensors hold
        self.layout: Layout | None = None  # the step being run
        self.call = call_tokens(device)  # a block of decode attention's fixed cost (blocks.py)
        self.sorter, self.sorts = Sorter(self.call), 0  # sorts: how many, for /metrics.json

    def __len__(self) -> int:
        return len(self.owners)

    def rows(self) -> int:
        """Rows held in memory (0 once the batch is empty: tests of memory released)."""
        return self.slots if self.keys else 0

    # --- places --------------------------------------------------------------------------------

    def take(self, owner: Holder) -> int:
        """A slot for `owner` (its length starts at 0)."""
        owner.slot = len(self.owners)
        self.owners.append(owner)
        self.fit(len(self.owners), 1)
        return owner.slot

    def release(self, owner: Holder) -> None:
        """`owner` leaves: the last slot's row moves into its place (one row's copy)."""
        i, last = owner.slot, self.owners.pop()
        owner.slot = None
        if last is not owner:
            assert i is not None and last.slot is not None
            self.copy(last.slot, i, last.length)
            self.owners[i], last.slot = last, i
        if not self.owners:
            self.clear()
            return
        longest = max(o.length for o in self.owners)
        slots = self.slots if len(self.owners) * SHRINK > self.slots else max(FIRST_SLOTS, 2 * len(self.owners))
        room = self.room if longest * SHRINK > self.room else max(FIRST_ROOM, 2 * longest)
        if (slots, room) != (self.slots, self.room):
            self.resize(slots, room)

    def clear(self) -> None:
        """Every row gone (the last has left, or a failed step ended them all): their slots freed,
        an empty batch holds nothing, and what rows now gone cost the sorter says nothing of the
        next ones."""
        for owner in self.owners:
            owner.slot = None
        self.owners, self.keys, self.values = [], {}, {}
        self.slots, self.room, self.layout = FIRST_SLOTS, FIRST_ROOM, None  # (a failed step's layout too)
        self.sorter.spent = 0.0

    def settle(self) -> None:
        """Between steps: sort the slots by length where the sorter says it pays (blocks.py)."""
        order = self.sorter.due([o.length for o in self.owners])
        if order is None:
            return
        moved = [s for s, i in enumerate(order) if s != i]
        n = max(self.owners[order[s]].length for s in moved)
        to, source = (torch.tensor(x, device=self.device) for x in (moved, [order[s] for s in moved]))
        for store in (*self.keys.values(), *self.values.values()):
            held = store[:, :, :n]
            held.index_copy_(0, to, held.index_select(0, source))
        self.owners = [self.owners[i] for i in order]
        for s, owner in enumerate(self.owners):
            owner.slot = s
        self.sorts += 1

    def put(self, slot: int, layers: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Copy the first n keys and values of a one-row cache (a kept shared prefix) into a slot."""
        self.fit(len(self.owners), n, most=n)  # (not doubled: the step's own fit grows it, within its bound)
        for layer, (k, v) in enumerate(layers):
            keys, values = self.store(layer, k, v)
            keys[slot, :, :n] = k[0, :, :n]
            values[slot, :, :n] = v[0, :, :n]

    def copy(self, source: int, slot: int, n: int) -> None:
        """Copy the first n keys and values of one slot into another (a row moving into a freed
        slot; a prompt beginning shared with a row in the batch: sharing.py)."""
        for store in (*self.keys.values(), *self.values.values()):
            store[slot, :, :n] = store[source, :, :n]

    def taken(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the first n keys and values of a slot, each layer's (1, heads, n, dim): what
        `put` copies back (prefixes.Prefixes.retain)."""
        return [
            (self.keys[i][slot : slot + 1, :, :n].clone(), self.values[i][slot : slot + 1, :, :n].clone())
            for i in sorted(self.keys)
        ]

    def token_bytes(self) -> int:
        """Bytes one token's keys and values take in every layer (0 before the first is stored)."""
        return sum(2 * k.shape[1] * k.shape[3] * k.element_size() for k in self.keys.values())

    # --- memory --------------------------------------------------------------------------------

    def fit(self, slots: int, room: int, most: int | None = None) -> None:
        """Make room for `slots` slots of `room` tokens: the room doubled (a row grows a token a
        step), but never past `most`, the longest any row can grow (admission, `fits`, counted
        every slot at that: doubled past it, two rows of 4,200 tokens took 3 slots of 8,192, 2.9x
        the budget), and a few spare slots (every slot holds the whole room: fewer, the longer it is)."""
        if slots > self.slots or room > self.room:
            grown = 2 * self.room if most is None else max(room, min(2 * self.room, most))
            room = self.room if room <= self.room else max(room, grown)
            self.resize(max(slots, len(self.owners)) + min(FIRST_SLOTS - 1, SPARE_ROOM // room), room)

    def resize(self, slots: int, room: int) -> None:
        n = min(len(self.owners), self.slots, slots)  # (a slot just taken has nothing to keep yet)
        used = min(max((o.length for o in self.owners), default=0), self.room, room)
        for stores in (self.keys, self.values):
            for layer, old in stores.items():
                new = old.new_zeros(slots, old.shape[1], room, old.shape[3])
                new[:n, :, :used] = old[:n, :, :used]
                stores[layer] = new
        self.slots, self.room = slots, room

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values, allocated on its first use like `k` and `v` ((1, heads, n, dim))."""
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros(self.slots, k.shape[1], self.room, k.shape[3])
            self.values[layer] = v.new_zeros(self.slots, v.shape[1], self.room, v.shape[3])
        return self.keys[layer], self.values[layer]

    # --- the model's cache ---------------------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any) -> Any:
        """A layer's keys and values for the step's tokens ((1, heads, T, dim)): each into its slot."""
        layout = self.layout
        assert layout is not None, "a step's layout is set before the forward pass"
        keys, values = self.store(layer_idx, key_states, value_states)
        keys[layout.slot_of, :, layout.position_of] = key_states[0].transpose(0, 1)
        values[layout.slot_of, :, layout.position_of] = value_states[0].transpose(0, 1)
        return key_states, value_states

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]


def fits(rooms: list[int], m: Any, memory: int) -> bool:
    """Whether a batch whose rows need `rooms` tokens each (the last a newcomer) stays within
    `memory` bytes of KV once every row has its whole answer (every slot holds the longest row's
    room). A newcomer to an empty batch fits whatever it needs: it must be served, and alone it is
    bounded by its context and max_tokens."""
    return len(rooms) <= 1 or len(rooms) * max(rooms) * token_bytes(m) <= memory


def token_bytes(m: Any) -> int:
    """Bytes of keys and values one token takes in a model's cache, from its config and dtype."""
    c = m.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = next(m.parameters()).dtype
    return int(c.num_hidden_layers * 2 * heads * dim * dtype.itemsize)


class Layout:
    """Where one step's tokens go, and what attention needs to read them back.

    `decode`: (slot, position) of each decoding row's token, in slot order; `pieces`: (slot,
    start, n) of each prompt piece, whose n tokens follow the decode tokens in order. `lengths`:
    the tokens in each slot in use before the step."""

    def __init__(
        self,
        kv: SlotKV,
        decode: list[tuple[int, int]],
        pieces: list[tuple[int, int, int]],
        lengths: list[int],
    ) -> None:
        device = kv.device
        self.kv, self.used = kv, len(lengths)
        self.tokens = list(decode) + [(s, p) for s, start, n in pieces for p in range(start, start + n)]
        self.slot_of = torch.tensor([s for s, _ in self.tokens], device=device)
        self.position_of = torch.tensor([p for _, p in self.tokens], device=device)
        self.decoding = len(decode)
        slots = [s for s, _ in decode]
        assert slots == sorted(slots), "decode tokens come in slot order"
        self.every_slot = slots == list(range(self.used))
        lengths, reads = list(lengths), [0] * self.used
        for s, p in decode:
            lengths[s] = reads[s] = p + 1
        # Decode tokens attend in blocks of slots, each to its own longest row (blocks.py).
        self.blocks = [Block(a, b, top, slots, lengths, device) for a, b, top in cuts(reads, kv.call)[0]]
        # Each piece attends causally to its slot up to its own end: (slot, start, n, offset, mask).
        self.pieces: list[tuple[int, int, int, int, torch.Tensor | None]] = []
        offset = self.decoding
        for s, start, n in pieces:
            mask = None  # a whole prompt from its start: SDPA's own causal mask
            if start and n > 1:
                rows, columns = torch.arange(n, device=device), torch.arange(start + n, device=device)
                mask = (columns[None, :] <= start + rows[:, None]).view(1, 1, n, start + n)
            self.pieces.append((s, start, n, offset, mask))
            offset += n

    def room(self) -> int:
        """Tokens of room the step's slots need."""
        return int(self.position_of.max()) + 1 if self.tokens else 0


class Block:
    """Slots start..end-1 of one step's decode attention, read to `longest` tokens in one call:
    its decode tokens are first..last-1 of the step's (they come in slot order); a slot among them
    that does not run gets a zero query whose answer is dropped (`index`: the running ones'
    places in the block; None when all run). `mask`: (slots, 1, 1, longest) bool, each slot to
    its own length; None when every slot has them all."""

    def __init__(self, start: int, end: int, longest: int, slots: list[int], lengths: list[int], device: str) -> None:
        self.start, self.end, self.longest = start, end, longest
        self.first, self.last = bisect.bisect_left(slots, start), bisect.bisect_left(slots, end)
        mine = slots[self.first : self.last]
        self.index = None if mine == list(range(start, end)) else torch.tensor(mine, device=device) - start
        seen = [min(max(1, n), longest) for n in lengths[start:end]]  # at least one column: no empty softmax
        self.mask: torch.Tensor | None = None
        if any(n != longest for n in seen):
            columns = torch.arange(longest, device=device)
            self.mask = (columns[None, :] < torch.tensor(seen, device=device)[:, None]).view(end - start, 1, 1, -1)
