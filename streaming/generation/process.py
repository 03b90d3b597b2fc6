"""`--engine process`: the batched engine in a process of its own, and the server's side of its pipe.

`EngineProcess` starts the engine process (process_child.py, spawned: a fresh interpreter, no
copy of this one's threads), sends it each request's prompt ids and stop flags, and turns what it
sends back into the same Job a thread engine gives: pieces of text with their token ids, the end
and its reason, the counts. The event loop never runs the model's Python, and the model's thread
never waits for the GIL behind HTTP, SSE and JSON.

A death of the engine process (killed, out of memory, a crash in a kernel) is an error to every
reader it was serving (503 `engine_restarting`, close 1011 mid-stream), and a new one is started
at once; until it is ready /ready says 503 and new requests are refused with Retry-After, as while
the model first loads. A process that dies before it was ever ready (the model failed to load)
is not restarted: the server exits, as in one process.

/metrics.json's engine counts, the places in the queue and the refusal past --max-waiting come
from the engine's last report (every METRICS_EVERY while it has work, and before every end).

A message to the engine process goes through a sending thread of its own, so the event loop never
waits on the pipe, even while that process is stopped (SIGSTOP) or frozen. An engine process that
has said nothing for STALL seconds while it has requests is taken for dead: it is killed, which
fails its requests and starts a new one, as any death does. So is one that sends what cannot be
read (the pipe's stream is then lost): nobody waits on a pipe that will never say more. (Its
reports come from its own loop, so an engine thread stuck in one kernel while that loop still
runs is not caught here; one whose thread has died exits, process_child.py.)

Leaves out: the thread engine's `--queue`, and more than one engine process.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import queue
import threading
import time
from typing import Any

from streaming.generation.job import Job, Piece, StopFlag
from streaming.generation.process_child import EngineSettings, relay
from streaming.generation.process_child import main as engine_main
from streaming.model.loading import Model
from streaming.wire.errors import InvalidRequest, ProtocolError

RESTART_RETRY = 5  # seconds a refused request is told to wait while the engine process restarts
EXIT_WAIT = 10.0  # seconds the engine process has to exit when told to at shutdown: then it is killed
# Seconds of silence from an engine process with requests before it is killed as stuck: it reports
# every METRICS_EVERY (0.25 s) while it has work, from its own loop, even during a long step.
STALL = 30.0
WATCH_EVERY = 1.0  # seconds between looks for that silence
JOIN_WAIT = 5.0  # seconds for a process whose pipe has ended to exit, before it is killed


class EngineProcess:
    def __init__(self, model: Model, settings: EngineSettings) -> None:
        self.model, self.settings = model, settings
        self.jobs: dict[int, ProcessJob] = {}
        self.ids = itertools.count(1)
        self.sent = 0  # submits sent to the current process
        self.snapshot: dict[str, Any] = {"active": 0, "waiting": 0, "steps": 0, "tokens_generated": 0}
        self.ready = False
        self.facts: dict[str, Any] = {}  # the model's, as the engine process loaded it (/metrics.json)
        self.closing = False
        self.restarts = 0
        self.outbox: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self.heard = time.monotonic()  # the engine process's last message (or the first request after quiet)
        self.proc: Any = None
        self.live = False  # a process is up (loading or ready): a job sent now will be run
        self.given_up = False  # the first process never got ready: no other is started

    async def start(self) -> str:
        """Start the engine process; what it says once loaded and warmed (its error if it failed)."""
        self.loop = asyncio.get_running_loop()
        self.first: asyncio.Future[str] = self.loop.create_future()
        self.spawn()
        self.loop.call_later(WATCH_EVERY, self.watch)
        return await self.first

    def spawn(self) -> None:
        if self.closing:
            return
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=engine_main, args=(theirs, self.settings), name="engine", daemon=True)
        proc.start()
        theirs.close()  # ours alone: its end-of-file is the child's death
        self.outbox.put(None)  # the last process's sending thread ends (what it still held is for nobody)
        self.outbox = queue.SimpleQueue()
        self.proc, self.sent, self.live = proc, 0, True
        self.snapshot.update(active=0, waiting=0, refusal=None, positions={}, submitted=0)
        threading.Thread(target=self.receive, args=(ours, proc), name="engine pipe", daemon=True).start()
        threading.Thread(target=sending, args=(ours, self.outbox, proc), name="engine sends", daemon=True).start()

    def receive(self, conn: Any, proc: Any) -> None:
        """The receiving thread: every message to the loop. The pipe's end (end-of-file, or what
        cannot be read) is the process's death: killed if it has not exited by JOIN_WAIT."""
        broken = relay(conn, self.loop, self.handle)
        if broken is not None:
            print(f"engine process sent what cannot be read ({broken!r}): stopping it", flush=True)
            proc.kill()
        proc.join(JOIN_WAIT)
        if proc.exitcode is None:  # its pipe is gone, so it is of no use: a new one must not run beside it
            proc.kill()
            proc.join()
        try:
            self.loop.call_soon_threadsafe(self.died, proc, proc.exitcode)
        except RuntimeError:  # the loop has closed: the server is gone
            pass

    def send(self, msg: tuple[Any, ...]) -> None:
        self.outbox.put(msg)  # (to a dead one: dropped; died() fails its jobs)

    def watch(self) -> None:
        """Every WATCH_EVERY s on the loop: kill an engine process silent for STALL s with requests."""
        if self.closing:
            return
        silent = time.monotonic() - self.heard
        if self.ready and self.jobs and silent > STALL and self.proc.is_alive():
            print(
                f"engine process said nothing for {silent:.0f} s with {len(self.jobs)} requests: stopping it",
                flush=True,
            )
            self.proc.kill()  # its pipe ends: died() fails its requests and starts a new one
        self.loop.call_later(WATCH_EVERY, self.watch)

    # --- on the loop ---------------------------------------------------------------------------

    def handle(self, msg: tuple[Any, ...]) -> None:
        self.heard = time.monotonic()
        try:
            self.take(msg)
        except Exception as e:  # noqa: BLE001 - a message not of the protocol: the process is not to be trusted
            print(f"engine process sent a message that is not of the protocol ({e!r}): stopping it", flush=True)
            self.proc.kill()  # its pipe ends: died() fails every request, the rest of this one's included

    def take(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "batch":
            for each in msg[1]:
                self.take(each)
        elif kind == "metrics":
            self.snapshot.update(msg[1])
        elif kind == "ready":
            self.ready, said = True, msg[1]
            self.model.known_context, self.model.context_told, self.facts = msg[2], True, msg[3]
            if not self.first.done():
                self.first.set_result(said)
            else:
                print(f"engine process restarted: {said}", flush=True)
        elif kind == "failed":
            if not self.first.done():
                self.given_up = True
                self.first.set_exception(RuntimeError(msg[1]))
            else:
                print(f"engine process failed to restart: {msg[1]}", flush=True)
        elif (job := self.jobs.get(msg[1])) is not None:
            job.produced = msg[-1]
            if kind == "piece":
                job.out.put_nowait(Piece.of(msg[2], msg[3]))
            else:
                if msg[3] is not None:  # the engine's count when the stop reached it: tokens after it are for nobody
                    job.stop.at = msg[3]
                if kind == "end":
                    job.reason = msg[2]
                    job.out.put_nowait(None)
                elif msg[4] is None:
                    job.out.put_nowait(RuntimeError(msg[2]))
                else:  # refused at admission: the request's own error, as the engine in this process gives it
                    job.out.put_nowait(InvalidRequest(msg[2], *msg[4]))
                self.release(job)

    def died(self, proc: Any, code: int | None) -> None:
        if proc is not self.proc:
            return
        was_ready, self.ready, self.live = self.ready, False, False
        for job in list(self.jobs.values()):
            self.refuse(job, f"the engine process exited (code {code}); a new one is starting")
        if self.closing or self.given_up:
            return
        if not self.first.done():  # never ready: the model cannot load; the server exits
            self.given_up = True
            self.first.set_exception(RuntimeError(f"the engine process exited (code {code}) while loading"))
            return
        self.restarts += 1
        print(f"engine process exited (code {code}): starting a new one", flush=True)
        if was_ready:
            self.spawn()
        else:  # it died again while loading: not in a tight loop
            self.loop.call_later(RESTART_RETRY, self.spawn)

    def release(self, job: ProcessJob) -> None:
        self.jobs.pop(job.jid, None)
        job.close()

    def refuse(self, job: ProcessJob, message: str) -> None:
        """End a job with the error every reader of a dead engine process gets."""
        job.out.put_nowait(
            ProtocolError(
                message, 503, close_code=1011, kind="engine_restarting", headers=[("Retry-After", str(RESTART_RETRY))]
            )
        )
        self.release(job)

    def submit(self, job: ProcessJob) -> None:
        if not self.live:  # between a death and the next start (a stream taken over needs no /ready)
            self.refuse(job, "the engine process is restarting")
            return
        if not self.jobs:  # its silence until now was an idle engine's
            self.heard = time.monotonic()
        self.jobs[job.jid] = job
        self.sent += 1
        self.send(("submit", job.jid, job.ids, job.params, tuple(job.prior)))

    def close(self) -> None:
        """At shutdown (in a thread: it waits): tell the engine process to exit, kill it past EXIT_WAIT."""
        self.closing = True
        if self.proc is None:
            return
        proc = self.proc
        self.send(("exit",))
        proc.join(EXIT_WAIT)
        if proc.is_alive():
            proc.kill()
            proc.join()
        self.outbox.put(None)  # the sending thread ends; the pipe closes with the threads that held it

    # --- what the server asks ------------------------------------------------------------------

    def refusal(self) -> tuple[int, int] | None:
        """As the batched engine's (waiting.py), from the engine's last report and the requests
        sent since; while a new process starts, every request waits for it."""
        if not self.ready:
            return len(self.jobs), RESTART_RETRY
        s = self.snapshot
        unseen = max(0, self.sent - s.get("submitted", 0))
        free = max(0, self.settings.max_batch - s.get("active", 0))
        if s.get("waiting", 0) + unseen - free < self.settings.max_waiting:
            return None
        refused = s.get("refusal")
        return s.get("waiting", 0) + unseen, (refused[1] if refused else 1)

    def position(self, job: Job) -> int | None:
        jid = getattr(job, "jid", None)
        positions = self.snapshot.get("positions") or {}
        return positions.get(jid)

    def metrics(self) -> dict[str, Any]:
        m = {k: v for k, v in self.snapshot.items() if k not in ("positions", "refusal", "submitted")}
        m.update(engine="process", schedule=self.settings.policy.name, max_batch=self.settings.max_batch)
        m.update(engine_restarts=self.restarts, engine_pid=self.proc.pid if self.proc is not None else None)
        return m


def sending(conn: Any, outbox: queue.SimpleQueue[tuple[Any, ...] | None], proc: Any) -> None:
    """A sending thread: `outbox`'s messages down the pipe, until None. A send waits while the
    engine process is stopped (the watch kills it past STALL); to a dead one, it is dropped. One
    that cannot be sent at all (it does not pickle) would leave its request waiting for good: the
    process is stopped, which fails every request it has, and a new one starts."""
    while (msg := outbox.get()) is not None:
        try:
            conn.send(msg)
        except (OSError, ValueError):
            pass
        except Exception as e:  # noqa: BLE001 - said, and the process replaced: never a thread gone quiet
            print(f"a message to the engine process could not be sent ({e!r}): stopping it", flush=True)
            proc.kill()


class RemoteStop(StopFlag):
    """A stop flag whose first set() is sent to the engine process."""

    job: ProcessJob

    def set(self) -> None:
        first = not self.is_set()
        super().set()
        if first:
            self.job.engine.send(("stop", self.job.jid, self.job.handed_off))


class ProcessJob(Job):
    """A Job the engine process runs; its pieces, end and counts arrive through EngineProcess."""

    def __init__(self, engine: EngineProcess, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.engine, self.jid = engine, next(engine.ids)
        self.stop = RemoteStop(self)

    def start(self) -> ProcessJob:
        super().start()
        self.engine.submit(self)
        return self

    def hand_off(self) -> None:
        """Sent even after a stop: the engine process must then end it without flushing."""
        already = self.stop.is_set()
        super().hand_off()
        if already:
            self.engine.send(("stop", self.jid, True))

    @property  # type: ignore[override]
    def orphaned(self) -> bool:
        return self._orphaned

    @orphaned.setter
    def orphaned(self, value: bool) -> None:
        """Nobody reads it now (a resumable stream between readers): the engine serves it last."""
        changed = value != getattr(self, "_orphaned", False)
        self._orphaned = value
        if changed and hasattr(self, "jid"):
            self.engine.send(("orphaned", self.jid, value))
