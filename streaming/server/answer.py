"""One answer's lifecycle, from its job to its record, for every endpoint that generates.

    async with Answer(answers, job, "/stream", watch=conn) as answer:
        await answer.relay(deliver, keep_alive)          # or: async for piece in answer.pieces()

Entering watches the reader: end-of-file on its connection stops the job at once (the article's
point), unless the server is --naive. `pieces()` yields the job's text pieces, timing each, calls
a keep-alive during silence, and raises the job's failure as a ProtocolError (a request the
engine refused at admission, an id past the vocabulary, as the InvalidRequest it is); `relay()`
hands them to a delivery function as events, as many pieces an event as its `Merging` says
(merging.py: one each by default, the first always alone; with adaptive merging, those already
waiting while the reader's socket is behind go together), and notices a reader that cannot take
one. Leaving, however it leaves, stops the job, stops watching, waits for the job's count of
tokens and records the answer (the article's log line and the metrics); an answer that the
shutdown stopped then leaves with ProtocolError 503 `shutting_down`. Every error an answer raises
reaches the one error place (exchange.py), which says it in the endpoint's shape, before the head
or after it.

`Answers` is what all answers of a server share: the log, the metrics, the --ping and --naive
settings, and the phase (the shutdown's cut). No sockets here: a watched connection is anything
with `watch(job)` and `gone`, so tests drive an Answer with a fake job and a fake connection.
Leaves out: the wire formats (the handlers' delivery functions) and where pieces go (a socket,
a recording).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol

from streaming.generation.job import Item, Job
from streaming.server.merging import Merging
from streaming.server.metrics import Metrics
from streaming.server.state import Phase, ServerState
from streaming.wire.errors import InvalidRequest, ProtocolError

SHUTTING_DOWN = "the server is shutting down"
FAILED = "generation failed (the server's log says why)"  # never the exception's own text: the log has it
# Answers /log keeps, the latest: 10,000 lines are ~250 KB of JSON, a few ms to write at each GET
# (unbounded, 40,000 requests made every GET /log a megabyte serialised on the event loop).
LOG_KEEP = 10_000
JOB_END = 10.0  # seconds a stopped job may take to end (a step, normally) before the answer is logged without it

Deliver = Callable[[str], Awaitable[bool]]  # send a piece's text; False: the reader cannot take it
KeepAlive = Callable[[], Awaitable[bool]]  # say something during silence; False: the reader is gone


class Watched(Protocol):
    """A reader's connection, as an answer watches it (connection.Connection)."""

    gone: bool

    async def watch(self, job: Job) -> None: ...


class Outlet(Protocol):
    """A reader's socket as adaptive merging sees it (exchange.Exchange, ws.WebSocket)."""

    @property
    def behind(self) -> bool: ...  # what it was sent has not yet left for the kernel (past the low mark)

    async def settle(self) -> bool: ...  # wait for it to catch up; False: it took nothing in time, dropped


class Early(enum.Enum):
    """How an answer's log line names an early end (the article's words), and what it counts as."""

    LEFT = "client left early"  # the reader went away (end-of-file, a failed write): reader_left
    SAID_STOP = "client said stop"  # a WebSocket's reader asked to stop (or closed): stopped
    STOPPED = "stopped early"  # a resumable stream ended before its end (/stop, the grace, shutdown)


def ping_note(position: int | None) -> str:
    """What a keep-alive comment says: its place in the queue while a request waits for a place
    in the batch (an honest queue: the reader, or a proxy, can see it move), else `ping`."""
    return "ping" if position is None else f"waiting for a place in the batch, {position} ahead"


class Answers:
    """The answers of one server: their log, their metrics, and what the settings say of them."""

    def __init__(self, metrics: Metrics, state: ServerState, ping: float, naive: bool, keep: int = LOG_KEEP) -> None:
        self.metrics, self.state, self.ping, self.naive = metrics, state, ping, naive
        # [path, generated tokens, ended early], one per finished answer: the last `keep` of them
        self.log: collections.deque[list[Any]] = collections.deque(maxlen=keep)
        self.logged = 0  # answers logged in all (the log keeps the latest `keep`)

    def cut(self, job: Job) -> ProtocolError | None:
        """The error an answer ends with if the shutdown stopped its job, else None (a job handed
        off to another replica ends without an end: the taker writes it)."""
        if self.state.phase is Phase.CLOSING and job.reason == "stopped" and not job.handed_off:
            return ProtocolError(SHUTTING_DOWN, 503, close_code=1001, kind="shutting_down")
        return None

    def record(self, answer: Answer, produced: int, early: bool) -> None:
        """The article's log line, and the answer's metrics."""
        job = answer.job
        self.log.append([answer.path, produced, early])
        self.logged += 1
        print(f"{answer.path}: generated {produced} tokens, {answer.early.value}: {early}", flush=True)
        if job.reason is None:
            outcome = "error"
        elif early and answer.early is Early.LEFT:
            outcome = "reader_left"
        else:
            outcome = "stopped" if job.reason == "stopped" else "finished"
        after_stop = max(0, job.produced - job.stop.at) if job.stop.at is not None else 0
        self.metrics.ended(
            answer.path, outcome, answer.arrivals, answer.whole, job.prompt_tokens, job.produced, after_stop
        )


class Answer:
    """One answer: see the module's docstring. `whole`: it goes out at once at the end (its
    metrics count every piece as arriving then); `early`: how its log line names an early end;
    `naive`: whether a reader who cannot take a piece is ignored (default: the server's --naive)."""

    def __init__(
        self,
        answers: Answers,
        job: Job,
        path: str,
        *,
        watch: Watched | None = None,
        early: Early = Early.LEFT,
        whole: bool = False,
        naive: bool | None = None,
    ) -> None:
        self.answers, self.job, self.path, self.early, self.whole = answers, job, path, early, whole
        self.naive = answers.naive if naive is None else naive
        self.watched = watch if not self.naive else None  # --naive: nobody notices the reader leave
        self.watcher: asyncio.Task[None] | None = None
        self.left = False  # the reader went away: no end is sent
        self.produced = 0  # tokens generated, once the answer is over
        self.taken = 0  # token ids of the pieces taken from the job so far (a Piece's ids)
        self.matched_at: int | None = None  # a stop string ended it: the tokens taken by then (counted())
        self.arrivals: list[float] = []  # when each piece reached the loop, seconds since the request
        self.kept: list[Item] = []  # the end or a failure that ready() took from the queue: pieces() says it

    def matched(self) -> None:
        """A stop string ended the answer: its job stops, and its usage counts the tokens of the
        pieces taken so far (the first match's count: pieces that still come are dropped). Pieces
        without ids (an upstream's, --engine free's) leave the job's count."""
        if self.matched_at is None:
            self.matched_at = self.taken or self.job.produced
        self.job.stop.set()

    def counted(self) -> int:
        """The tokens its usage counts: those generated; where a stop string ended it, those of the
        pieces through the one that completed it, as vLLM counts (of the event's pieces, where the
        reader fell behind and they went as one). Not the job's count then: the engine runs ahead
        of the loop (guessed tokens, a queue), and the tokens it made before it saw the stop were
        for nobody."""
        return self.produced if self.matched_at is None else min(self.produced, self.matched_at)

    async def __aenter__(self) -> Answer:
        if self.watched is not None:
            self.watcher = asyncio.create_task(self.watched.watch(self.job))
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        job = self.job
        self.left = self.left or (self.watched is not None and self.watched.gone)
        said_stop = job.stop.is_set()  # (before our own stop below)
        job.stop.set()  # however it ended, this answer's generation ends
        if self.watcher is not None:  # and gone before the connection reads again (its read() would clash)
            self.watcher.cancel()
            await asyncio.gather(self.watcher, return_exceptions=True)
        try:  # within a step of the stop, unless the engine is stuck: then its count so far
            self.produced = await asyncio.wait_for(asyncio.shield(job.done), JOB_END)
        except asyncio.TimeoutError:
            print(f"{self.path}: its job did not end within {JOB_END:g} s of its stop", flush=True)
            self.produced = job.produced
        early = {Early.LEFT: self.left, Early.SAID_STOP: said_stop, Early.STOPPED: job.reason == "stopped"}
        self.answers.record(self, self.produced, early[self.early])
        if kind is None and not self.left and (cut := self.answers.cut(job)):
            raise cut

    async def pieces(self, keep_alive: KeepAlive | None = None) -> AsyncIterator[str]:
        """Yield the job's text pieces until its end; raise ProtocolError (500, or an upstream's
        own) if it failed, or InvalidRequest if the engine refused it at admission (Job.begin).
        After --ping seconds without a piece, call keep_alive(); if that says the reader is gone
        (False), stop the job and return early."""
        job, ping = self.job, self.answers.ping
        while True:
            if self.kept:
                item = self.kept.pop()
            elif not job.out.empty():  # a piece is ready: take it without a task or a timer
                item = await job.get()
            else:
                getter = asyncio.ensure_future(job.get())
                while not getter.done():
                    done, _ = await asyncio.wait({getter}, timeout=ping)
                    if not done and keep_alive is not None and not await keep_alive():
                        getter.cancel()
                        self.left = True
                        job.stop.set()
                        return
                item = getter.result()
            if item is None:
                return
            if isinstance(item, (ProtocolError, InvalidRequest)):  # an upstream's failure in its own
                raise item  # words, or a request refused at admission: the exchange says it (a 4xx, 1008)
            if isinstance(item, BaseException):  # the engine's own failure: Python's words, for the log only
                print(f"{self.path}: generation failed: {item!r}", flush=True)
                raise ProtocolError(FAILED, 500, close_code=1011, kind="generation_failed")
            self.arrived(item)
            yield item  # a Piece (with its token ids), or plain text (--engine free)

    async def ready(self) -> str | None:
        """A piece that is already waiting, taken at once (no wait: the queue holds it), or None:
        nothing waits, or what waits is the end or a failure, which pieces() then gives."""
        if self.kept or self.job.out.empty():
            return None
        item = await self.job.get()  # (a job's get() of a queued item returns without suspending)
        if item is None or isinstance(item, BaseException):
            self.kept.append(item)
            return None
        self.arrived(item)
        return item

    def arrived(self, piece: str) -> None:
        """A piece reached the answer now: its time, the gap since the one before, its tokens."""
        self.taken += len(getattr(piece, "ids", ()))
        now = time.monotonic() - self.job.created
        if self.arrivals:
            self.answers.metrics.gaps.observe(now - self.arrivals[-1])
        self.arrivals.append(now)

    async def relay(
        self,
        deliver: Deliver,
        keep_alive: KeepAlive | None = None,
        merging: Merging | None = None,
        outlet: Outlet | None = None,
    ) -> None:
        """Deliver the pieces as events, with keep_alive() during silence, until the job ends.
        `merging` says how many pieces go as one event (default: one each); `outlet`, the reader's
        socket, says whether the reader is behind, for adaptive merging. Text held for an interval
        goes at a keep-alive's time instead of it. A delivery that fails means the reader is gone:
        `left`, and the job stops (with --naive it goes on, for nobody). A stop string is the
        delivery's to find (the APIs' streams, v1.py): it calls matched(), and the pieces that
        still come go nowhere."""
        merging = merging if merging is not None else Merging(adaptive=False)

        async def send() -> bool:
            """What is held, as one event; False: the answer ends here (the reader left)."""
            text = merging.take()
            if text:
                merging.sent()
                if not await deliver(text):
                    self.left = True
                    if not self.naive:
                        self.job.stop.set()
                        return False
            return True

        async def silence() -> bool:
            if merging.held and not self.left:  # held text is life on the stream: it goes instead
                await send()
            elif not self.left and keep_alive is not None and not await keep_alive():
                self.left = True
            return not self.left or self.naive

        async for piece in self.pieces(silence):
            if self.left:
                continue  # --naive: generating for nobody
            merging.add(piece)
            if outlet is not None and merging.wait_for_reader(outlet.behind) and not await outlet.settle():
                self.left = True  # (dropped: it took nothing for --write-timeout)
                if not self.naive:
                    self.job.stop.set()
                    break
                continue
            while merging.more() and (waiting := await self.ready()) is not None:
                merging.add(waiting)
            if merging.due() and not await send():
                break
        if merging.held and not self.left:  # the end of an interval cut short by the answer's end
            await send()
