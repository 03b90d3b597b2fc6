"""The article's engine: a thread per request feeding the request's queue, and `tokens()`, the
one-sequence loop it runs (lm.tokens is its facade).

As the article's `generate`: a thread samples with `choose` (sampling.py), checks the stop flag
before every token, and hands text through the incremental detokenizer (flushed at the end) to
the request's asyncio queue with `call_soon_threadsafe`. The event loop never waits on the
model. One thread, one sequence: batched.py batches.

The queue is unbounded by default, as the article's: a slow reader makes it grow while the model
runs at full speed. With `queue_size`, a thread that is that many pieces ahead waits (checking
its stop flag) until the reader catches up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from streaming.generation.job import Item, Job
from streaming.generation.sampling import Draws, choose
from streaming.model.loading import Model, forward_kwargs
from streaming.wire.params import GenerationParams


def tokens(
    model: Model,
    ids: list[int],
    params: GenerationParams,
    *,
    stop: threading.Event | None = None,
    start: int = 0,
    repetition_penalty: float = 1.0,
) -> Iterator[int]:
    """Yield up to max_tokens sampled token ids after the prompt's `ids`. The last may be a stop id
    (EOS), after which nothing follows (unless ignore_eos). `stop` is checked before every token:
    a set flag ends generation before the next forward pass. One prefill, then one forward pass
    per token with a KV cache. `start`: how many of the answer's tokens end `ids` already (a
    stream taken over): sampling goes on from draw `start`, and at most max_tokens - start follow."""
    from transformers import DynamicCache  # (seconds to import: only when a model runs)

    m, device, ends = model.net, model.device, model.stop_ids()
    draws = Draws(params.seed, start)
    kw = forward_kwargs(m, DynamicCache(config=m.config))
    history: list[int] = []
    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        for _ in range(start, params.max_tokens):
            if stop is not None and stop.is_set():
                return
            logits = m(input_ids=x, use_cache=True, **kw).logits[0, -1]
            token = choose(
                logits,
                history,
                draws,
                p=params.top_p,
                temperature=params.temperature,
                repetition_penalty=repetition_penalty,
            )
            history.append(token)
            yield token
            if token in ends and not params.ignore_eos:
                return
            x = torch.tensor([[token]], device=device)


class ThreadJob(Job):
    def __init__(self, *args: Any, model: Model, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.model = model
        size = self.options.queue_size
        self.slots = threading.Semaphore(size) if size else None
        self.thread = threading.Thread(target=self.run, name="generate", daemon=True)

    def start(self) -> ThreadJob:
        super().start()
        self.thread.start()
        return self

    async def get(self) -> Item:
        item = await self.out.get()
        if self.slots is not None and isinstance(item, str):
            self.slots.release()
        return item

    def put(self, item: Item) -> None:
        """From the thread: with a bounded queue, wait for room (checking the stop flag) first."""
        if self.slots is not None and isinstance(item, str):
            while not self.slots.acquire(timeout=0.05):
                if self.stop.is_set():
                    return
        super().put(item)

    def run(self) -> None:
        o = self.options
        try:
            if not self.begin(self.model):  # nothing to generate: it has ended
                return
            if o.first_delay:
                self.stop.wait(o.first_delay)
            for token in tokens(self.model, self.context, self.params, stop=self.stop, start=len(self.prior)):
                if not self.on_token(token):
                    return
                if o.token_delay:
                    time.sleep(o.token_delay)
            self.end("stopped")  # tokens() returns early only when the flag is up
        except Exception as e:  # noqa: BLE001 - any failure must reach the handler as an error
            self.fail(e)
