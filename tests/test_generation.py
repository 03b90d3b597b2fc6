"""The generation thread in process: the bounded queue makes it wait, the stop flag ends it."""

import asyncio

import lm
from streaming.generation.job import JobOptions
from streaming.generation.prompts import encode_prompt
from streaming.generation.thread import ThreadJob
from streaming.wire.params import plain_request

model = lm.handle()


def test_a_bounded_queue_makes_the_generator_wait_for_the_reader():
    async def main():
        prompt, params = plain_request({"prompt": "Hello", "max_tokens": 200})
        job = ThreadJob(encode_prompt(model, prompt, params), params, JobOptions(queue_size=3), model=model).start()
        await asyncio.sleep(1.0)  # nobody reads
        waiting = job.out.qsize()
        assert not job.done.done() and waiting <= 3
        got = [await job.get() for _ in range(5)]  # reading frees room, it goes on
        assert all(isinstance(p, str) for p in got)
        job.stop.set()
        return waiting, await asyncio.wait_for(job.done, 10)

    waiting, produced = asyncio.run(main())
    assert waiting == 3 and produced < 200


def test_an_unbounded_queue_runs_ahead_of_the_reader():
    async def main():
        prompt, params = plain_request({"prompt": "Hello", "max_tokens": 30})
        job = ThreadJob(encode_prompt(model, prompt, params), params, model=model).start()
        produced = await asyncio.wait_for(job.done, 30)
        return produced, job.out.qsize()

    produced, queued = asyncio.run(main())
    assert produced == 30 and queued > 20  # all pieces (and the end) waiting for a reader
