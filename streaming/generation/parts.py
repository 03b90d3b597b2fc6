"""Where the batched engine's step time goes: seconds summed by part (the forward pass of the
decode and the joining prompts, "prefill" for a shared beginning's own pass, sampling, the KV
cache's bookkeeping, the hand-off of each token to its job: its detokenizer and its queue to the
event loop), read by /metrics.json and `scripts/bench.py profile`; and what the steps carried
(`StepCounts`: the rows they ran, the prompt tokens that joined, and the passes of the steps that
prompts joined), by which `bench.py qoe` sets a steady load's steps against a burst's.

A `with parts.timed("forward"):` costs two perf_counter calls; on a GPU, also a wait for the
kernels the part launched (`sync`): its calls return before the work is done, and the policy's
step costs (costs.py) read the forward pass's time. Leaves out: per-layer detail
(torch.profiler's business, which the profile also prints).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

PARTS = ("forward", "prefill", "sampling", "kv", "hand_off")


class StepParts:
    def __init__(self, device: str = "cpu") -> None:
        self.sync = device_sync(device)
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.last = dict.fromkeys(PARTS, 0.0)  # each part's latest timing (the policy's step costs read it)

    @contextmanager
    def timed(self, part: str) -> Iterator[None]:
        t0 = time.perf_counter()
        done = False
        try:
            yield
            done = True
        finally:
            if done and self.sync is not None:  # (after a failed part, the part's own error stands)
                self.sync()
            self.last[part] = time.perf_counter() - t0
            self.seconds[part] += self.last[part]

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)


@dataclass
class StepCounts:
    """Summed over the steps (the engine reads them under its lock)."""

    ran: int = 0  # decode row-steps run
    prefilled: int = 0  # prompt tokens through a step's pass
    join_steps: int = 0  # steps that prompts joined
    join_seconds: float = 0.0  # their forward passes' seconds

    def step(self, rows: int, pieces: list[int], forward: float) -> None:
        """One step: its decode rows, its prompt pieces' tokens, its forward pass's seconds."""
        self.ran += rows
        if pieces:
            self.prefilled += sum(pieces)
            self.join_steps += 1
            self.join_seconds += forward

    def metrics(self) -> dict[str, float]:
        return {
            "rows_run": self.ran,
            "prompt_tokens_computed": self.prefilled,
            "join_steps": self.join_steps,
            "join_forward_seconds": round(self.join_seconds, 3),
        }


def device_sync(device: str) -> Callable[[], object] | None:
    """What waits for a device's queued kernels (None on a CPU, whose calls return when done)."""
    if device.startswith("cuda"):
        return functools.partial(torch.cuda.synchronize, device)
    if device.startswith("mps"):
        return torch.mps.synchronize
    return None
