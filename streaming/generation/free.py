"""`--engine free`, for measuring the server alone: no model, every piece ' x' at once (as fast
as the reader takes them), so what costs time is the server's own work per event; with
--token-delay S, one piece every S seconds instead, paced as a model's steps are. Leaves out
everything about a model: the prompt is ignored and no detokenizer runs."""

from __future__ import annotations

import asyncio

from streaming.generation.job import Job

PIECE = " x"
AHEAD = 64  # pieces queued before letting the reader catch up, as a bounded queue would
CAUGHT_UP = 16


class FreeJob(Job):
    def start(self) -> FreeJob:
        super().start()
        self.loop.create_task(self.feed())
        return self

    async def feed(self) -> None:
        delay = self.options.token_delay
        for _ in range(self.params.max_tokens):
            if self.stop.is_set():
                break
            self.produced += 1
            self.out.put_nowait(PIECE)
            if delay:
                await asyncio.sleep(delay)
            elif self.out.qsize() > AHEAD:
                await asyncio.sleep(0)
                while self.out.qsize() > CAUGHT_UP and not self.stop.is_set():
                    await asyncio.sleep(0.001)
        self.reason = "stopped" if self.stop.is_set() else "length"
        self.out.put_nowait(None)
        self.ended.set()
        self.finish(self.produced)
