"""The article's engine: a thread per request feeding the request's queue.

As the article's `generate`: a thread samples with `choose` (through lm.tokens), checks the stop
flag before every token, and hands text through the incremental detokenizer (flushed at the end)
to the request's asyncio queue with `call_soon_threadsafe`. The event loop never waits on the
model. One thread, one sequence: engine.py batches.

The queue is unbounded by default, as the article's: a slow reader makes it grow while the model
runs at full speed. With `queue_size`, a thread that is that many pieces ahead waits (checking
its stop flag) until the reader catches up.
"""

from __future__ import annotations

import threading
import time

import lm
from streaming.generation.job import Job


class ThreadJob(Job):
    def __init__(self, *args, model=None, **kw) -> None:
        super().__init__(*args, **kw)
        self.model = model  # None: lm.model(), the process's model
        size = self.settings.queue_size
        self.slots = threading.Semaphore(size) if size else None
        self.thread = threading.Thread(target=self.run, name="generate", daemon=True)

    def start(self) -> ThreadJob:
        super().start()
        self.thread.start()
        return self

    async def get(self):
        item = await self.out.get()
        if self.slots is not None and isinstance(item, str):
            self.slots.release()
        return item

    def put(self, item) -> None:
        """From the thread: with a bounded queue, wait for room (checking the stop flag) first."""
        if self.slots is not None and isinstance(item, str):
            while not self.slots.acquire(timeout=0.05):
                if self.stop.is_set():
                    return
        super().put(item)

    def run(self) -> None:
        p = self.params
        try:
            self.begin()
            if self.settings.first_delay:
                self.stop.wait(self.settings.first_delay)
            for token in lm.tokens(self.context, p, stop=self.stop, net=self.model, start=len(self.prior)):
                if not self.take(token):
                    return
                if self.settings.token_delay:
                    time.sleep(self.settings.token_delay)
            self.end("stopped")  # lm.tokens returns early only when the flag is up
        except Exception as e:  # noqa: BLE001 - any failure must reach the handler as an error
            self.fail(e)
