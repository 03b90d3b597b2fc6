"""Touch the batched engine's working memory before the first request.

A process's memory costs a page fault the first time each 4 KiB page is written; on these
virtual machines about 9 us each (a burst's prefill in the engine, in process: 71,738 faults and
2.26 s the first time, 30 faults and 1.59 s the same burst again). So a fresh server's first burst
paid for every page its KV slots, its 512-token steps' activations and its logits need: a burst
of 48 chat prompts faulted 185,000-442,000 pages and its last first text came 2.56-3.17 s after
the request (three fresh servers), against 1.82-1.99 s for the same burst again in the same server.

So, as vLLM's start-up profile run does with its largest batch: once the model is loaded, `warm()`
runs WARM_ROWS synthetic requests through the engine (one step at the most prompt tokens a step
takes, steps of every row, sampling with top_p) and ends them. glibc keeps what they freed for the
next allocations of those sizes: the first burst of 48 after it faulted 41,000 pages and got its
last first text in 1.98-2.18 s (two fresh servers). About 2 s at start with the bundled model.

Leaves out: telling glibc to keep more (mallopt): any threshold set by hand turns off glibc's own
adjustment of them, and a burst then faulted 0.9-4.8 million pages (measured with M_TRIM_THRESHOLD
alone, and with M_MMAP_THRESHOLD too). Nor transparent huge pages for torch's tensors
(THP_MEM_ALLOC_ENABLE=1): fewer faults (17,654 on that burst), no sooner first text.
"""

from __future__ import annotations

import asyncio

from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.job import Stats
from streaming.generation.policy import MAX_PREFILL
from streaming.wire.params import GenerationParams

WARM_ROWS = 64  # synthetic requests: --max-batch's default on most CPUs (rows past it fault their pages once)
WARM_TOKENS = 3  # each: its prompt's first token, then steps of every row


def prompts(rows: int, length: int, vocab: int) -> list[list[int]]:
    """`rows` prompts of `length` ids, no two beginning alike (nothing for the shared-prefix cache
    to keep: every row's prefill is real work)."""
    low = min(1000, vocab // 4)  # past the special and byte tokens of a real vocabulary
    span = max(1, vocab - low)
    return [[low + (7919 * i + 104_729 * j) % span for j in range(length)] for i in range(rows)]


async def warm(engine: BatchEngine, vocab: int, rows: int = WARM_ROWS) -> int:
    """Run `rows` synthetic requests through the engine to their end, outside the server's counts;
    the tokens they generated."""
    rows = min(rows, engine.max_batch)
    length = max(1, MAX_PREFILL // rows)
    params = GenerationParams(max_tokens=WARM_TOKENS, seed=0, temperature=0.7, top_p=0.9, ignore_eos=True)
    stats = Stats()  # not the server's: nobody asked for these
    jobs = [BatchedJob(engine, ids, params, stats=stats).start() for ids in prompts(rows, length, vocab)]
    for job in jobs:
        while (item := await job.get()) is not None:
            if isinstance(item, BaseException):
                raise item
    await asyncio.wrap_future(engine.call(lambda: None))  # after the step that ended them (its rows gone)
    return sum(job.produced for job in jobs)
