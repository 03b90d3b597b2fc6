"""A resumable stream's generating side: its job's pieces into its recording, whoever reads it
(or nobody, for a while), as one Answer (streaming/server/answer.py), then its end: `[DONE]`, or
an error event (the job's failure, a request refused at admission, or the shutdown's cut), in the
recording's own wire format (encodings.py). A job handed off to another replica (shutdown, or a
stream taken over) ends without an end event: its readers reconnect, and the replica that takes
it over writes the rest.

While more than UNREAD events are in the recording that no reader has been sent (here, or on
another replica: its "read" notes say how far), the pump takes no more pieces from its job
(until a reader catches up, or the job is stopped or ends): an
upstream relay then stops reading its upstream (relay.AHEAD), so a stream whose reader left
costs a bounded amount until its grace runs out. A local engine's job queues its tokens
meanwhile (at most max_tokens of them).
"""

from __future__ import annotations

import asyncio

from streaming.generation.job import Job
from streaming.server.answer import Answer, Answers, Early
from streaming.server.resumable.encodings import Encoding
from streaming.server.resumable.recordings import Recording
from streaming.wire.errors import InvalidRequest, ProtocolError

UNREAD = 256  # events recorded ahead of every reader before the pump waits for one
RECHECK = 0.5  # seconds between looks at the job's stop flag while waiting (a thread sets it)


async def pump(answers: Answers, rec: Recording, enc: Encoding, path: str = "/stream") -> None:
    job = rec.job
    assert job is not None, "a view has no job to pump"
    try:
        async with Answer(answers, job, path, early=Early.STOPPED) as answer:
            async for piece in answer.pieces():
                enc.piece(rec, piece)
                if not answers.naive:  # (the naive server generates every token for nobody)
                    await room(rec, job)
    except ProtocolError as e:
        enc.failed(rec, e)
    except InvalidRequest as e:  # refused at admission (an id past the vocabulary in a store's answer)
        enc.failed(rec, e.problem())
    else:
        if not job.handed_off:
            enc.done(rec, job.reason, job.prompt_tokens, answer.produced)
    finally:
        rec.end()
        if job.ended.is_set():  # (the engine is done with it; the mirror took what it writes at the start)
            job.forget()


async def room(rec: Recording, job: Job) -> None:
    """Wait while the recording is UNREAD events ahead of its readers and its job goes on."""
    while rec.unread > UNREAD and not job.stop.is_set() and not job.ended.is_set():
        try:
            await asyncio.wait_for(rec.moved.wait(), RECHECK)
        except asyncio.TimeoutError:
            pass
