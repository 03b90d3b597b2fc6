"""The engine process's own side (`--engine process`): the batched engine, run in a child process.

vLLM V1 moved its scheduler and model (EngineCore) out of the API server's process, so that the
model's Python between kernels never waits for the GIL behind HTTP, SSE and JSON. `main` is that
process: it loads the model, warms it (warm.py), and runs a BatchEngine exactly as the server's
own `--engine batched` does; a request arrives as its prompt's ids and parameters, runs as a
BatchedJob (its stop flag checked before every step, its text detokenized here), and what a step
made (pieces with their ids, ends) goes back in one message from the engine's thread once the step
is done (one send a step, not one a reader: measured below in the README) on one pipe (process.py,
the server's side, holds the other end):

    server -> engine   ("submit", jid, ids, params, prior)   ("stop", jid, handed_off)
                       ("orphaned", jid, whether)   ("exit",)
    engine -> server   ("ready", said, context, facts)   ("failed", message)
                       ("metrics", {...})   ("batch", [a step's messages]), each of them
                       ("piece", jid, text, ids, produced)   ("end", jid, reason, stopped_at, produced)
                       ("fail", jid, message, stopped_at, invalid, produced)   ("metrics", {...}) first if one ended

A "fail"'s `invalid` is None for a failure of the engine (a RuntimeError on the server's side: a
500), or the (param, status) of a request refused at admission (Job.begin: an id past the model's
vocabulary), which the server's side gives as the InvalidRequest it was (the endpoint's own 4xx).

A receiving thread reads the pipe and hands each message to this process's event loop, so a stop
reaches the engine thread between two of its steps, as in one process. The pipe's end is the
server's end: this process exits when told to, or when it reads end-of-file (the server died).

Leaves out: HTTP (the server's side), and restarting (the server starts a new one).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.job import Item, JobOptions, Stats
from streaming.generation.policy import Fifo, Qoe
from streaming.generation.warm import warm
from streaming.lossy import outlive_readers
from streaming.model.choice import Choice
from streaming.model.loading import Model, load_and_say
from streaming.wire.errors import InvalidRequest

METRICS_EVERY = 0.25  # seconds between the engine's counts sent while it has work (/metrics.json's age)
ENGINE_THREAD_ENDED = 70  # the exit code when the engine's thread has died (EX_SOFTWARE)


@dataclass(frozen=True)
class EngineSettings:
    """What the engine process is made from (pickled across, once)."""

    choice: Choice
    options: JobOptions
    policy: Fifo | Qoe
    max_batch: int
    prefill_chunk: int
    max_waiting: int
    kv_memory: int | None  # None: sized for the device (kv.default_kv_memory), there
    retain_memory: int  # bytes of ended rows' keys and values kept (prefixes.py)


def relay(conn: Connection, loop: asyncio.AbstractEventLoop, handle: Callable[[Any], None]) -> Exception | None:
    """A receiving thread's loop, on both sides of the pipe: every message to `handle` on `loop`,
    in order, until end-of-file or the loop's close (None), or what cannot be read: a message that
    does not unpickle, a length past memory (the error; the pipe's stream is lost with it)."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return None
        except Exception as e:  # noqa: BLE001 - returned: the receiving side ends the pipe
            return e
        try:
            loop.call_soon_threadsafe(handle, msg)
        except RuntimeError:  # the loop has closed
            return None


def send(conn: Connection, lock: threading.Lock, msg: tuple[Any, ...]) -> None:
    """Send from any thread, on both sides; a pipe whose other side is gone drops it (its
    receiving thread has seen the end and says so)."""
    with lock:
        try:
            conn.send(msg)
        except (OSError, ValueError):
            pass


def main(conn: Connection, settings: EngineSettings) -> None:
    """The child process's entry (multiprocessing, spawned)."""
    # Ctrl-C and a SIGTERM to the server's process group are the server's to handle: it drains its
    # answers, then says exit (or kills this process past EXIT_WAIT). A SIGTERM to this process
    # itself still ends it (multiprocessing's own clean-up at the server's exit sends one).
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    outlive_readers()  # it writes to the server's stdout and stderr, whose reader may go away
    asyncio.run(Child(conn, settings).run())


class Child:
    def __init__(self, conn: Connection, settings: EngineSettings) -> None:
        self.conn, self.settings = conn, settings
        self.model = Model(settings.choice)
        self.engine = BatchEngine(
            self.model,
            settings.max_batch,
            settings.prefill_chunk,
            settings.options.token_delay,
            policy=settings.policy,
            max_waiting=settings.max_waiting,
            kv_memory=settings.kv_memory,
            after_step=self.flush,
            retain_memory=settings.retain_memory,
        )
        self.stats = Stats()
        self.jobs: dict[int, ChildJob] = {}
        self.submitted = 0  # submit messages taken: the server counts those it sent and we have not seen
        self.send_lock = threading.Lock()  # the engine's thread and the loop both send
        self.outbox: list[tuple[Any, ...]] = []  # the step's pieces and ends, sent in one message after it
        self.out_lock = threading.Lock()
        self.flush_lock = threading.Lock()

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.closed = asyncio.Event()
        threading.Thread(target=self.receive, name="engine pipe", daemon=True).start()
        try:
            said = await asyncio.wrap_future(self.engine.call(self.load))
            t0 = time.perf_counter()
            tokens = await warm(self.engine, len(self.model.tokenizer))
            said += f"; memory warmed ({tokens} tokens) in {time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 - told to the server in one line, which exits
            self.send(("failed", str(e) or type(e).__name__))
            return
        self.send(("ready", said, self.model.context(), self.model.facts()))
        while not self.closed.is_set():
            if self.engine.thread is not None and not self.engine.thread.is_alive():
                # (its traceback is printed): the server takes the exit for a death and starts anew
                print("engine process: its engine thread ended; exiting", flush=True)
                os._exit(ENGINE_THREAD_ENDED)
            self.flush()
            if self.jobs:
                self.send(("metrics", self.metrics()))
            try:
                await asyncio.wait_for(self.closed.wait(), METRICS_EVERY)
            except asyncio.TimeoutError:  # (not TimeoutError before Python 3.11)
                pass
        for job in list(self.jobs.values()):  # the server is gone: nobody reads
            job.stop.set()

    def load(self) -> str:
        """On the engine's thread (its kernels run faster where they were loaded and timed)."""
        return load_and_say(self.model, " (engine process)")

    # --- the pipe ------------------------------------------------------------------------------

    def receive(self) -> None:
        """The receiving thread: every message to the loop; the pipe's end (the server is gone, or
        sent what cannot be read) ends us."""
        if (broken := relay(self.conn, self.loop, self.handle)) is not None:
            print(f"engine process: the server sent what cannot be read ({broken!r}): exiting", flush=True)
        try:
            self.loop.call_soon_threadsafe(self.closed.set)
        except RuntimeError:  # the loop has closed already
            pass

    def send(self, msg: tuple[Any, ...]) -> None:
        send(self.conn, self.send_lock, msg)

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "exit":
            self.closed.set()
        elif msg[0] == "submit":
            _, jid, ids, params, prior = msg
            self.submitted += 1
            job = self.jobs[jid] = ChildJob(self, jid, ids, params, self.settings.options, self.stats, prior)
            job.start()  # (listed first: its end, on the engine's thread, takes it out)
        elif (found := self.jobs.get(msg[1])) is None:  # it has ended here already
            return
        elif msg[0] == "stop":
            found.handed_off = msg[2]
            found.stop.set()
        elif msg[0] == "orphaned":
            found.orphaned = msg[2]

    def post(self, job: ChildJob, item: Item) -> None:
        """A job's piece, end or failure (on the engine's thread), into the step's outbox."""
        if item is None:
            msg: tuple[Any, ...] = ("end", job.jid, job.reason, job.stop.at, job.produced)
        elif isinstance(item, InvalidRequest):  # the server says it as the request's error (a 4xx), not a 500
            msg = ("fail", job.jid, item.message, job.stop.at, (item.param, item.status), job.produced)
        elif isinstance(item, BaseException):
            msg = ("fail", job.jid, str(item) or type(item).__name__, job.stop.at, None, job.produced)
        else:
            msg = ("piece", job.jid, str(item), getattr(item, "ids", ()), job.produced)
        if msg[0] != "piece":
            self.jobs.pop(job.jid, None)
        with self.out_lock:
            self.outbox.append(msg)

    def flush(self) -> None:
        """After each step (on the engine's thread; and from the loop, for what ends between
        steps): the outbox in one message, after the counts when an answer ended (a client that
        reads /metrics.json after its answer sees it)."""
        with self.flush_lock:  # two flushes at once (the loop's, the engine's) keep their order
            with self.out_lock:
                msgs, self.outbox = self.outbox, []
            if msgs:
                if any(m[0] != "piece" for m in msgs):
                    msgs.insert(0, ("metrics", self.metrics()))
                self.send(("batch", msgs))

    def metrics(self) -> dict[str, Any]:
        m = self.engine.metrics()
        with self.engine.lock:  # the places of those waiting, in one pass
            order = [row.job for row in self.engine.waiting.rows]
        jids = {id(job): jid for jid, job in list(self.jobs.items())}  # (the engine's thread pops ends)
        m["positions"] = {jids[id(job)]: k for k, job in enumerate(order) if id(job) in jids}
        m["refusal"] = self.engine.refusal()
        m["submitted"] = self.submitted
        return m


class ChildJob(BatchedJob):
    """A BatchedJob whose pieces go to the server: into the step's outbox, not to a queue here."""

    def __init__(self, child: Child, jid: int, *args: Any) -> None:
        super().__init__(child.engine, *args)
        self.child, self.jid = child, jid

    def put(self, item: Item) -> None:
        self.child.post(self, item)
