"""A resumable stream's generating side: its job's pieces into its recording, whoever reads it
(or nobody, for a while), as one Answer (streaming/server/answer.py), then its end: `[DONE]`, or
an error event (the job's failure, or the shutdown's cut). A job handed off to another replica
(shutdown, or a stream taken over) ends without an end event: its readers reconnect, and the
replica that takes it over writes the rest."""

from __future__ import annotations

import json

from streaming.generation.job import Piece
from streaming.server.answer import Answer, Answers, Early
from streaming.server.resumable.recordings import Recording
from streaming.wire.errors import ProtocolError, error_body


async def pump(answers: Answers, rec: Recording) -> None:
    job = rec.job
    assert job is not None, "a view has no job to pump"
    try:
        async with Answer(answers, job, "/stream", early=Early.STOPPED) as answer:
            async for piece in answer.pieces():
                rec.add(json.dumps({"text": piece}), ids=piece.ids if isinstance(piece, Piece) else ())
    except ProtocolError as e:
        rec.add(json.dumps(error_body(e)), event="error", last=True)
    else:
        if not job.handed_off:
            rec.add("[DONE]", last=True)
    finally:
        rec.end()
