"""Prompt beginnings shared with a row in the batch (sharing.py) or with a row that has ended
(prefixes.py's retained texts): found exactly (fuzzed against the plain definition), copied from
the donor's slot or the retained keys instead of computed, a duplicate in the same step joining
in that step on its twin's keys and logits, the retained bytes bounded, requests of another cache_salt kept
apart, and every text still that of the request alone: with the `exact` model in both dtypes, and
the tiny real model in float32.

Leaves out: speed (scripts/bench.py qoe: the burst of 48's first text)."""

import asyncio

import pytest
import torch
from helpers import job_text, model_of
from hypothesis import given
from hypothesis import strategies as st
from test_schedule import DTYPES, Clock

import lm
from streaming.generation import batch
from streaming.generation.batch import Row
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.policy import Fifo
from streaming.generation.prefixes import PREFIX_MIN, RETAIN_TEXTS, common_prefix
from streaming.generation.sharing import shared_beginning, to_prefill
from streaming.generation.thread import ThreadJob
from streaming.model.testing import ExactModel, tiny_model
from streaming.wire.errors import InvalidRequest
from streaming.wire.params import plain_request, query_body

SYSTEM = "You are a careful assistant. You answer briefly and exactly, in plain words, and you never guess. "
QUESTIONS = [
    "Tell me, in a few short sentences, how a lighthouse keeper spent the long winter nights alone.",
    "Explain why the sky looks blue at noon and red at sunset, as you would to a curious child.",
    "Write a short poem about a cat that watches the rain from a kitchen window all afternoon.",
]


def naive(ids, others, at_least):
    best, most = None, 0
    for key, other in others:
        n = 0
        while n < min(len(ids) - 1, len(other)) and ids[n] == other[n]:
            n += 1
        if n >= max(1, at_least) and n > most:
            best, most = key, n
    return best, most


def test_shared_beginning_is_the_longest_and_leaves_the_prompt_its_last_token():
    ids = [1, 2, 3, 4, 5, 6]
    others = [("a", [1, 2, 9]), ("b", [1, 2, 3, 4, 5, 6, 7]), ("c", [1, 2, 3, 4, 8])]
    assert shared_beginning(ids, others, 2) == ("b", 5)  # all but the last token
    assert shared_beginning(ids, others[:1], 2) == ("a", 2)
    assert shared_beginning(ids, others[:1], 3) == (None, 0)  # too short to be worth it
    assert shared_beginning(ids, [], 1) == (None, 0)


@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=30),
    st.lists(st.lists(st.integers(0, 3), max_size=30), max_size=6),
    st.integers(0, 8),
)
def test_shared_beginning_fuzzed_against_the_plain_definition(ids, others, at_least):
    keyed = list(enumerate(others))
    best, n = shared_beginning(ids, keyed, at_least)
    want_best, want_n = naive(ids, keyed, at_least)
    assert n == want_n
    if best is not None:  # ties: any of the longest
        assert others[best][:n] == ids[:n] and n >= max(1, at_least)
    else:
        assert want_best is None


def params(i, n, salt=None):
    body = {"prompt": "x", "max_tokens": n, "seed": i, "temperature": 0 if i % 2 else 1.0}
    if salt is not None:
        body["cache_salt"] = salt
    return plain_request(body).params


def prompts():
    long = " ".join(QUESTIONS * 4)  # past the engine's prefill chunk (128 tokens): joins a chunk a step
    return [lm.tok(SYSTEM + q).input_ids for q in [*QUESTIONS, long]]


def engine(net, tokens, order, late=(), salts=None):
    """Requests for the prompts at `order` (indices of prompts()) queued at once, those at the
    indices in `late` admitted after the others have their first token; stepped by hand. `tokens`:
    each answer's length, or one for all; `salts`: each request's cache_salt."""
    clock = Clock()
    e = BatchEngine(max_batch=16, model=net, policy=Fifo(10_000), clock=clock)
    ps = prompts()
    lengths = tokens if isinstance(tokens, list) else [tokens] * len(order)
    steps_to_first = {}

    async def run():
        salt = salts or [None] * len(order)
        jobs = [BatchedJob(e, ps[k], params(i, lengths[i], salt[i])) for i, k in enumerate(order)]
        for i, job in enumerate(jobs):
            job.stats.active.add(job)
            if i not in late:
                e.waiting.append(Row(job, clock()))
        e.batch.admit(e.max_batch)
        steps = 0
        with torch.inference_mode():
            while e.batch.rows or e.batch.joining:
                e.batch.step()
                steps += 1
                clock.now += 0.2
                for i, job in enumerate(jobs):
                    if job.produced and i not in steps_to_first:
                        steps_to_first[i] = steps
                if steps == 2 and late:
                    for i in late:
                        e.waiting.append(Row(jobs[i], clock()))
                    e.batch.admit(e.max_batch)
        return [await job_text(j) for j in jobs]

    return e, asyncio.run(run()), steps_to_first


def each_alone(net, tokens, order):
    ps = prompts()
    lengths = tokens if isinstance(tokens, list) else [tokens] * len(order)

    async def run():
        return [await job_text(ThreadJob(ps[k], params(i, lengths[i]), model=net).start()) for i, k in enumerate(order)]

    return asyncio.run(run())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_duplicate_joins_in_its_twins_step_on_its_keys_and_logits_and_keeps_its_own_text(dtype):
    net = model_of(ExactModel(lm.load_tokenizer()).to(dtype))
    order = [0, 1, 0, 2, 1, 0]
    e, texts, first = engine(net, 10, order)
    ps = prompts()
    # each prompt computed once: the three repeats copy all of it, their twin's last token's logits too
    assert e.batch.shared == sum(len(ps[k]) for k in (0, 1, 0))
    assert [first[i] for i in range(len(order))] == [1] * 6  # a repeat: in its twin's step, not one after
    assert texts == each_alone(net, 10, order)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_prompt_arriving_while_its_twin_decodes_copies_at_once_and_keeps_its_own_text(dtype):
    net = model_of(ExactModel(lm.load_tokenizer()).to(dtype))
    order = [0, 1, 0]
    e, texts, first = engine(net, 10, order, late=(2,))
    assert e.batch.shared == len(prompts()[0]) - 1
    assert first[2] == 3  # admitted after step 2, first token from step 3: no wait for a donor
    assert texts == each_alone(net, 10, order)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repeats_of_one_prompt_copy_it_and_learn_no_prefix_of_their_own(dtype):
    net = model_of(ExactModel(lm.load_tokenizer()).to(dtype))
    order = [0, 1, 0, 0]
    e, texts, first = engine(net, 10, order)
    assert e.batch.shared == 2 * len(prompts()[0])  # not a kept prefix learned from the two repeats
    assert len(e.batch.prefixes.known) == 1  # the system prompt, from the first step's two prompts
    assert [first[i] for i in range(4)] == [1, 1, 1, 1]
    assert texts == each_alone(net, 10, order)


def test_a_twin_that_ends_at_its_first_token_leaves_its_keys_to_its_repeats():
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    order = [0, 0, 0]
    e, texts, first = engine(net, [1, 10, 10], order)
    assert e.batch.shared == 2 * len(prompts()[0])
    assert [first[i] for i in range(3)] == [1, 1, 1]
    assert texts == each_alone(net, [1, 10, 10], order)


def test_a_repeat_of_a_long_prompt_waits_for_its_chunks_and_copies_it_whole():
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    order = [3, 3]
    long = len(prompts()[3])
    assert long > 2 * 128
    e, texts, first = engine(net, 6, order)
    assert e.batch.shared == long
    chunks = -(-long // 128)
    assert [first[0], first[1]] == [chunks, chunks]  # joined at its twin's last chunk
    assert texts == each_alone(net, 6, order)


def test_what_waits_to_prefill_counts_a_repeat_once():
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    clock = Clock()
    e = BatchEngine(max_batch=16, model=net, policy=Fifo(10_000), clock=clock)
    ps = prompts()

    async def run():
        for i, k in enumerate([0, 1, 0, 0]):
            e.waiting.append(Row(BatchedJob(e, ps[k], params(i, 4)), clock()))
        e.batch.admit(e.max_batch)
        return to_prefill(e.batch.joining, e.batch.holders(), e.batch.prefixes)

    system = len(common_prefix(ps[:2]))  # no prefix kept yet: the second copies the first's system prompt
    assert system >= PREFIX_MIN
    assert asyncio.run(run()) == len(ps[0]) + len(ps[1]) - system  # a repeat: nothing, it rides on its twin


def test_a_copied_beginning_in_the_tiny_real_model_gives_the_text_alone_in_float32():
    net = model_of(tiny_model(lm.load_tokenizer()).to(torch.float32))
    order = [0, 2, 0, 2]
    e, texts, _ = engine(net, 12, order)
    assert e.batch.shared >= 2 * PREFIX_MIN
    assert texts == each_alone(net, 12, order)


def turns(net, retain_memory, first, follow, salts=(None, None)):
    """A request for `first`, run to its end, then one for `follow` (or `follow(the text its slot
    held)`), in one engine that retains `retain_memory` bytes of ended rows; (engine, texts, the
    retained text). `salts`: the two requests' cache_salt."""
    clock = Clock()
    e = BatchEngine(max_batch=16, model=net, policy=Fifo(10_000), clock=clock, retain_memory=retain_memory)

    async def one(ids, i):
        job = BatchedJob(e, ids, params(i, 10, salts[i]))
        job.stats.active.add(job)
        e.waiting.append(Row(job, clock()))
        e.batch.admit(e.max_batch)
        with torch.inference_mode():
            while e.batch.rows or e.batch.joining:
                e.batch.step()
                clock.now += 0.2
        return job, await job_text(job)

    async def run():
        _, a = await one(first, 0)
        held = list(next(iter(e.batch.prefixes.retained), (None, ()))[1])
        _, b = await one(follow(held) if callable(follow) else follow, 1)
        return [a, b], held

    texts, held = asyncio.run(run())
    return e, texts, held


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_next_turn_copies_the_ended_turns_keys_and_keeps_its_own_text(dtype):
    """A conversation's next turn resends the last one's prompt and answer: it copies their keys
    and values from what the ended row left (prefixes.Prefixes.retain) and computes only the rest,
    and its text is the one it gets alone."""
    net = model_of(ExactModel(lm.load_tokenizer()).to(dtype))
    ps = prompts()
    follow = lambda held: held + ps[1][-12:]  # noqa: E731 - the last turn, then a new question
    e, texts, held = turns(net, 1 << 30, ps[0], follow)
    # the slot held the prompt and every answer token but the last (sampled, never fed)
    assert held[: len(ps[0])] == ps[0] and len(held) == len(ps[0]) + 10 - 1
    assert e.batch.prefixes.retained_hits == 1 and e.batch.prefixes.retained_tokens == len(held)
    assert texts == [each_alone(net, 10, [0])[0], alone_text(net, follow(held), 1)]
    # the next turn's own text begins with the last one's: it replaced it
    ((salt, kept),) = e.batch.prefixes.retained
    assert salt is None and kept[: len(held)] == tuple(held) and len(kept) == len(follow(held)) + 10 - 1
    assert e.batch.prefixes.retained_bytes == sum(k.nbytes + v.nbytes for k, v in e.batch.prefixes.retained[None, kept])
    # a beginning shared only in part is copied as far as it goes
    part = lambda held: held[:-3] + ps[2][-12:]  # noqa: E731
    e, texts, held = turns(net, 1 << 30, ps[0], part)
    assert e.batch.prefixes.retained_tokens == len(held) - 3
    assert texts[1] == alone_text(net, part(held), 1)


def test_none_is_retained_at_0_bytes_and_the_least_recently_used_goes_first():
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    ps = prompts()
    follow = ps[0] + ps[1][-12:]
    e, texts, held = turns(net, 0, ps[0], follow)
    assert held == [] and e.batch.prefixes.retained_hits == 0 and e.batch.prefixes.retained_bytes == 0
    assert texts[1] == alone_text(net, follow, 1)
    # two unrelated answers are both kept where there is room; with a byte less than both take,
    # the second ended row's text pushes the first out
    e, _, held = turns(net, 1 << 30, ps[0], ps[2])
    size = e.batch.prefixes.retained_bytes
    assert len(e.batch.prefixes.retained) == 2
    assert e.batch.prefixes.retained_tokens == len(common_prefix([ps[0], ps[2]]))  # the system prompt, copied
    e, _, held = turns(net, size - 1, ps[0], ps[2])
    kept = list(e.batch.prefixes.retained)
    assert len(kept) == 1 and list(kept[0][1][: len(ps[2])]) == ps[2]  # the latest only
    assert e.batch.prefixes.retained_bytes <= size - 1


def test_requests_share_keys_only_with_requests_of_the_same_cache_salt():
    """Tenants apart (prefixes.py): a request with a cache_salt copies keys only from requests with
    the same salt, in the batch and after they ended; one without copies only from others
    without; a system prompt is learned per salt. Every text is the request's own alone."""
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    ps = prompts()
    order, salts = [0, 0, 0, 0, 1, 1], [None, "a", "b", "a", "b", None]
    e, texts, first = engine(net, 10, order, salts=salts)
    assert e.batch.shared == len(ps[0])  # only the second "a" copied (the repeat of its own salt)
    assert [first[i] for i in range(len(order))] == [1] * 6
    # the system prompt, learned once for the two of no salt and once for the two of "b", not for "a"
    assert {salt for salt, _ in e.batch.prefixes.known} == {None, "b"}
    assert len(e.batch.prefixes.known) == 2
    assert e.batch.prefixes.hits == 4  # the kept prefixes copied by both of None and both of "b", none by "a"
    assert texts == each_alone(net, 10, order)
    # an ended conversation's keys go to the next turn of its own salt only
    follow = lambda held: held + ps[1][-12:]  # noqa: E731
    cases = ((None, None), True), (("a", "a"), True), (("a", "b"), False), (("a", None), False), ((None, "a"), False)
    for salts, copied in cases:
        e, texts, held = turns(net, 1 << 30, ps[0], follow, salts)
        assert e.batch.prefixes.retained_hits == (1 if copied else 0), salts
        assert e.batch.prefixes.retained_tokens == (len(held) if copied else 0), salts
        assert texts[1] == alone_text(net, follow(held), 1)


def test_a_cache_salt_is_checked_and_a_query_strings_salt_is_text():
    assert params(0, 4).cache_salt is None and params(0, 4, "x" * 1024).cache_salt == "x" * 1024
    for salt in ("12345678", "true", "null", '"a"'):  # not read as JSON, as the query's numbers are
        assert plain_request(query_body({"prompt": "x", "cache_salt": salt})).params.cache_salt == salt
    for bad in ("", 7, ["a"], "x" * 1025, "\ud800"):
        with pytest.raises(InvalidRequest) as e:
            plain_request({"prompt": "x", "cache_salt": bad})
        assert e.value.param == "cache_salt"


def alone_text(net, ids, i):
    async def run():
        return await job_text(ThreadJob(ids, params(i, 10), model=net).start())

    return asyncio.run(run())


def test_at_most_retain_texts_are_kept_however_small():
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    e = BatchEngine(max_batch=4, model=net, policy=Fifo(10_000), clock=Clock())
    kv = e.batch.kv
    holder = type("Holder", (), {"slot": None, "length": 0})()
    kv.take(holder)
    kv.fit(1, 40)
    kv.store(0, torch.zeros(1, 1, 40, 4), torch.zeros(1, 1, 40, 4))  # one layer's slots, as a step makes them
    for i in range(RETAIN_TEXTS + 5):
        e.batch.prefixes.retain([i, *range(1000, 1000 + PREFIX_MIN)], kv, 0, None)
    kept = list(e.batch.prefixes.retained)
    assert len(kept) == RETAIN_TEXTS and kept[0][1][0] == 5  # the first five, least recently used, went


def test_rows_ending_in_one_step_leave_at_most_retain_step_tokens(monkeypatch):
    """Copying what ended rows leave happens inside the step: a step's leaving rows leave at most
    RETAIN_STEP tokens in all (a burst ending together would stall every stream otherwise)."""
    net = model_of(ExactModel(lm.load_tokenizer()).to(torch.float32))
    ps = prompts()
    monkeypatch.setattr(
        batch, "RETAIN_STEP", len(ps[0]) + 9 + min(map(len, ps[1:3]))
    )  # the first and less than one more
    e, texts, _ = engine(net, 10, [0, 1, 2])  # joined together, ending together
    assert [len(t) for _, t in e.batch.prefixes.retained] == [len(ps[0]) + 9]  # the prompt and 9 of its 10 tokens
    assert texts == each_alone(net, 10, [0, 1, 2])
