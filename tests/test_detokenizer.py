"""Both detokenizers: every split point, flush, the same text, no U+FFFD unless produced."""

import pytest

import lm
from detokenizer import REPLACEMENT, Detokenizer, StreamDetokenizer
from lm import tok

TEXTS = [
    "Con vẹt 🦜 nói: mô hình sinh văn bản từng token một 🫠",
    "日本語のテキストと中文文本，한국어 문장도 있습니다。",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ქართული, ᚠᚢᚦᚨᚱᚲ, 𓀀𓁐 and 👩🏽‍🚀👨‍👩‍👧",
    "  leading spaces, tabs\tand\nnewlines\n\n, café naïve Zoë; ∑∫√ ≠ ≤ ⊂ ℵ₀",
]
CLASSES = [Detokenizer, StreamDetokenizer]


def run(cls, ids):
    d = cls()
    pieces = [d.push(i) for i in ids]
    return pieces, d.flush()


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("text", TEXTS)
def test_joined_pieces_equal_the_text_and_no_piece_is_broken(cls, text):
    ids = tok(text).input_ids
    pieces, rest = run(cls, ids)
    assert "".join(pieces) + rest == text
    assert rest == ""  # valid text: nothing is held back at the end
    assert not any(REPLACEMENT in p for p in pieces)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("text", TEXTS)
def test_every_split_point_holds_back_half_characters_and_flush_returns_them(cls, text):
    """Stop after every prefix of the ids: what was sent is whole characters; flush gives the rest."""
    ids = tok(text).input_ids
    for cut in range(len(ids) + 1):
        pieces, rest = run(cls, ids[:cut])
        sent = "".join(pieces)
        assert REPLACEMENT not in sent
        assert sent + rest == tok.decode(ids[:cut])
        assert text.startswith(sent)


@pytest.mark.parametrize("text", TEXTS)
def test_the_two_give_the_same_pieces(text):
    ids = tok(text).input_ids
    assert run(Detokenizer, ids) == run(StreamDetokenizer, ids)


@pytest.mark.parametrize("cls", CLASSES)
def test_an_invalid_byte_sequence_from_the_model_is_sent_as_replacement(cls):
    """A model can produce bytes that are not UTF-8 (a lead byte followed by an ASCII word):
    then, and only then, U+FFFD is the honest text."""
    parrot = tok("🦜").input_ids
    assert len(parrot) > 1
    word = tok(" hello").input_ids
    ids = parrot[:1] + word
    pieces, rest = run(cls, ids)
    assert "".join(pieces) + rest == tok.decode(ids)
    assert REPLACEMENT in "".join(pieces) + rest


@pytest.mark.parametrize("cls", CLASSES)
def test_flush_of_a_dangling_half_character(cls):
    ids = tok("ok 🦜").input_ids[:-1]
    pieces, rest = run(cls, ids)
    assert "".join(pieces) == "ok"
    assert rest == tok.decode(ids)[2:] and REPLACEMENT in rest


def test_special_tokens_are_kept_or_skipped_alike():
    ids = tok("hi").input_ids + [tok.convert_tokens_to_ids("<|im_start|>")] + tok(" there").input_ids
    for skip in (False, True):
        a = "".join(Detokenizer(skip_special_tokens=skip).push(i) for i in ids)
        b = "".join(StreamDetokenizer(skip_special_tokens=skip).push(i) for i in ids)
        assert a == b == tok.decode(ids, skip_special_tokens=skip)


def test_a_jobs_text_leaves_special_tokens_out_and_counts_them():
    """With ignore_eos the model goes on past <|im_end|>: its text skips the special tokens (as
    vLLM's skip_special_tokens does by default), each still counted as a token."""
    import asyncio

    from streaming.generation.job import Job
    from streaming.wire.params import GenerationParams

    ends = [tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    ids = tok("Yes").input_ids + ends[:1] + tok("\n").input_ids + ends[1:] + tok("I'm sorry").input_ids

    async def run():
        job = Job([1, 2], GenerationParams(max_tokens=len(ids), ignore_eos=True))
        job.begin(lm.handle())
        for i in ids:
            job.on_token(i)
        await asyncio.sleep(0)
        pieces = []
        while (item := job.out.get_nowait()) is not None:
            pieces.append(item)
        return "".join(pieces), job.produced

    text, produced = asyncio.run(run())
    assert text == "Yes\nI'm sorry" and produced == len(ids)
