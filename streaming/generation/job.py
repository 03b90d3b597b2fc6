"""One request's generation as every engine runs it: `Job`, and `Stats` of the jobs of a server.

A job is what the asyncio side holds: `stop` (a threading.Event the engine checks before every
token), `get()` for the next text piece (None at the end; the exception that ended it, if one
did), `done` (a future of the number of tokens generated), `reason` ("eos", "length" or
"stopped") and `wait()` (for the producing side to be finished, at shutdown). The producing side
(a thread, the batched engine's thread, or a coroutine) calls `take(token)` for each sampled
token: the one per-token routine of every engine, which counts it, ends on end-of-sequence or
max_tokens, passes it through the request's own incremental detokenizer and hands the text to the
loop with `call_soon_threadsafe`; then `end(reason)` or `fail(error)` once.

Leaves out: the sampling and the model (the engines' business).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from streaming.wire.params import GenerationParams


@dataclass
class Stats:
    """The jobs of one server: those running, and those stopped early (the reader left or said
    stop) with the tokens generated after their stop (for nobody)."""

    active: set[Job] = field(default_factory=set)
    stopped: int = 0
    tokens_after_stop: int = 0


@dataclass(frozen=True)
class Settings:
    """How jobs run, beyond their request's parameters (the server's testing options)."""

    queue_size: int = 0  # thread engine: a thread this many pieces ahead waits for its reader
    token_delay: float = 0.0  # testing: seconds after each token (or step)
    fail_after: int | None = None  # testing: fail after this many tokens
    first_delay: float = 0.0  # testing: seconds of silence before the first token, as a long prefill


class StopFlag(threading.Event):
    """A request's stop flag, which remembers how many tokens its job had generated when it was
    set: the tokens after that are the ones generated for nobody (the article's claim is at most
    one, the token being computed when the flag went up)."""

    def __init__(self, job: Job) -> None:
        super().__init__()
        self.job = job
        self.at: int | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = self.job.produced
        super().set()


class Job:
    def __init__(
        self, ids: list[int], params: GenerationParams, settings: Settings | None = None, stats: Stats | None = None
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.ids, self.params, self.settings = ids, params, settings or Settings()
        self.stats = stats if stats is not None else Stats()
        self.stop = StopFlag(self)
        self.produced = 0  # tokens so far, written by the producing side
        self.out: asyncio.Queue = asyncio.Queue()
        self.done = self.loop.create_future()  # the number of tokens generated, EOS included
        self.reason: str | None = None  # why it ended: "eos", "length" (max_tokens) or "stopped" (the flag)
        self.ended = threading.Event()  # the producing side has finished with this job
        self.detok: Any = None  # the job's own incremental detokenizer, made on the producing side
        self.ends: set[int] = set()  # token ids that end an answer (lm.stop_ids())
        self.orphaned = False  # nobody reads it now (a resumable stream between readers): served last
        self.created = time.monotonic()  # for the metrics: when the request asked
        self.first_at: float | None = None  # when its first and its latest piece reached the server's loop
        self.last_at: float | None = None
        self.arrivals: list[float] = []  # when each piece reached the server's loop, since `created`

    def start(self) -> Job:
        """Begin producing (in a subclass), counted as active until it ends."""
        self.stats.active.add(self)
        return self

    async def get(self):
        """The next piece of text (str), None at the end, or the exception that ended it."""
        return await self.out.get()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the producing side has finished with this job (at shutdown)."""
        return self.ended.wait(timeout)

    # --- from the producing side ---------------------------------------------------------------

    def begin(self) -> None:
        """Before the first token, on the producing side: the detokenizer and the end ids."""
        import lm
        from detokenizer import StreamDetokenizer

        self.detok, self.ends = StreamDetokenizer(), lm.stop_ids()

    def take(self, token: int) -> bool:
        """The per-token routine of every engine: count the token; end at end-of-sequence (unless
        ignore_eos); hand its text on; fail if told to (--fail-after); end at max_tokens. Returns
        whether the job goes on."""
        self.produced += 1
        if token in self.ends and not self.params.ignore_eos:
            self.end("eos")
            return False
        if piece := self.detok.push(token):
            self.put(piece)
        if self.settings.fail_after is not None and self.produced >= self.settings.fail_after:
            self.fail(RuntimeError(f"injected failure after {self.produced} tokens (--fail-after)"))
            return False
        if self.produced >= self.params.max_tokens:
            self.end("length")
            return False
        return True

    def end(self, reason: str) -> None:
        """The answer is over: what the detokenizer still holds, then the end."""
        if self.detok is not None and (rest := self.detok.flush()):
            self.put(rest)
        self.reason = reason
        self.put(None)
        self.close()

    def fail(self, error: BaseException) -> None:
        self.put(error)
        self.close()

    def put(self, item) -> None:
        """Hand an item (a piece, None, or an exception) to the loop."""
        self.call(self.out.put_nowait, item)

    def call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed (shutdown): nobody is waiting any more
            pass

    def close(self) -> None:
        self.call(self.finish, self.produced)
        self.ended.set()

    def finish(self, produced: int) -> None:
        """On the loop: no longer active; count a stop and the tokens generated after it."""
        self.stats.active.discard(self)
        if self.reason == "stopped" and self.stop.at is not None:
            self.stats.stopped += 1
            self.stats.tokens_after_stop += produced - self.stop.at
        if not self.done.done():
            self.done.set_result(produced)
