"""The batched engine's own pass through a decoder (streaming/generation/decoder.py) against the
model's forward: at every step of a real batch (prompts joining whole and in chunks, rows
decoding, sitting out and leaving, guessed tokens), both passes run on the same layout and slots
and their logits must be equal, bit for bit: a tiny Qwen2 model in both dtypes, its products plain
and fused (fusing.py); a tiny Llama model, which only this pass runs batched, against the thread
engine; which models it takes, and --forward."""

import asyncio

import pytest
import torch
from helpers import job_text, model_of

import lm
import server
from streaming.generation import decoder, speculation
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.policy import Qoe
from streaming.generation.thread import ThreadJob
from streaming.model import fusing, quant, smooth
from streaming.model.choice import Choice, ModelError
from streaming.model.testing import ExactModel, tiny_model
from streaming.wire.params import GenerationParams

PROMPTS = [
    "one two three, one two four, one two three, one two four, and one two five",
    "The keeper wrote in his log: wind from the west. " * 6,  # longer than the chunk: joins in pieces
    "abc abc abd abc abc abd abc",
    "Why is the sky blue?",
]


def net_of(kind, dtype, fused):
    tok = lm.load_tokenizer()
    net = tiny_model(tok, kind).to(dtype).eval()
    if fused:
        assert fusing.fuse(net) == 2 * len(net.model.layers)
    return net


def both_passes_at_every_step(monkeypatch, net):
    """Run a batch through the engine with every step computed by both passes on the same layout
    and slots (the logits must be equal); returns the tokens and whether every slot ran, by step."""
    assert decoder.own(net)
    real, steps = decoder.step, []

    def both(m, by, layout, kv, ids, positions, keep):
        assert by == "own"  # the default
        ours = real(m, "own", layout, kv, ids, positions, keep)
        theirs = real(m, "transformers", layout, kv, ids, positions, keep)  # writes the same keys and values again
        assert ours.shape == (len(keep), net.config.vocab_size) and torch.equal(ours, theirs)
        steps.append((len(ids), layout.every_slot))
        return ours

    monkeypatch.setattr(decoder, "step", both)
    # a random model's text rarely repeats: every row proposes its last ids again, so guesses ride
    monkeypatch.setattr(speculation.Lookup, "propose", lambda self, k: (3, self.ids[-k:]) if k > 0 else (0, []))
    tok = lm.load_tokenizer()
    params = [
        GenerationParams(max_tokens=24 + 4 * i, seed=i, temperature=0.8, top_p=0.9, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]

    async def run():
        engine = BatchEngine(model_of(net), max_batch=8, prefill_chunk=16, policy=Qoe())
        alone = await job_text(BatchedJob(engine, tok(PROMPTS[2]).input_ids, params[2]).start())
        jobs = [BatchedJob(engine, tok(p).input_ids, q).start() for p, q in zip(PROMPTS, params, strict=True)]
        together = await asyncio.gather(*map(job_text, jobs))
        return alone, together, engine.metrics()

    alone, together, m = asyncio.run(run())
    assert alone and all(together) and m["tokens_guessed"] > 0 and m["forward"] == "own"
    tokens = [n for n, _ in steps]
    assert max(tokens) > 16 and 1 in tokens  # steps with prompt pieces, and a lone row's
    return steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_every_step_of_a_batch_gives_the_logits_of_the_models_own_forward(monkeypatch, fused, dtype):
    steps = both_passes_at_every_step(monkeypatch, net_of("qwen2", dtype, fused))
    assert not all(every for _, every in steps)  # some rows sat a step out (qoe: their readers were ahead)


@pytest.mark.skipif(not quant.fbgemm_available(), reason="fp16 and w8a8 run fbgemm's kernels (x86 builds of torch)")
@pytest.mark.parametrize("mode", ["fp16", "w8a8"])
def test_the_quantized_layers_give_the_same_logits_through_both_passes(monkeypatch, mode):
    """The products fused then quantized, as a server loads the bundled model (loading.py), every
    product through the quantized kernel."""
    tok = lm.load_tokenizer()
    net = net_of("qwen2", torch.float32, fused=True)
    calibration = smooth.calibration_ids(tok) if mode == "w8a8" else None
    net = quant.quantize(net, mode, 1 << 30, calibration)
    assert isinstance(net.model.layers[0].self_attn.q_proj.shared.linear, quant.QuantLinear)
    both_passes_at_every_step(monkeypatch, net)


def test_a_llama_model_runs_batched_and_writes_each_prompts_text_alone():
    """transformers' Llama makes its own masks and refuses the step's layout, so the engine ran a
    Llama model only through this pass: its batch's texts are each prompt's alone through the
    thread engine (the model's own forward over its own cache), greedy and seeded, float32; and
    so with --forward transformers too."""
    net = net_of("llama", torch.float32, fused=False)
    tok = lm.load_tokenizer()
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = [
        GenerationParams(max_tokens=16, seed=i, temperature=0.8 if i % 2 else 0, ignore_eos=True) for i in range(4)
    ]

    async def run():
        alone = [
            await job_text(ThreadJob(p, q, model=model_of(net)).start()) for p, q in zip(prompts, params, strict=True)
        ]
        out = []
        for forward in ("own", "transformers"):  # told to take the model's forward: it takes this pass
            model = model_of(net)
            model.choice.update(forward=forward)
            engine = BatchEngine(model, max_batch=8, prefill_chunk=16, policy=Qoe())
            together = await asyncio.gather(
                *(job_text(BatchedJob(engine, p, q).start()) for p, q in zip(prompts, params, strict=True))
            )
            out.append(list(together))
            assert engine.metrics()["forward"] == "own"
        return alone, out

    alone, (own, told) = asyncio.run(run())
    assert all(alone) and own == alone and told == alone


def test_the_pass_takes_the_layers_it_knows_and_leaves_the_rest_to_their_forward():
    tok = lm.load_tokenizer()
    assert decoder.own(tiny_model(tok)) and decoder.own(tiny_model(tok, "llama"))
    assert not decoder.own(ExactModel(tok))  # a test model reading its slots itself
    sliding = tiny_model(tok)
    sliding.config.layer_types = ["sliding_attention"] * 2
    assert not decoder.own(sliding)
    replaced = tiny_model(tok)  # an MLP of another class (a fused or quantized library's, say)
    replaced.model.layers[1].mlp = torch.nn.Identity()
    assert not decoder.own(replaced)
    cut = tiny_model(tok)  # more layers than the config walks
    cut.config.num_hidden_layers = 1
    assert not decoder.own(cut)


def test_forward_is_a_model_option():
    assert Choice().forward == "own"
    choice = Choice()
    choice.update(forward="transformers")
    assert choice.forward == "transformers"
    with pytest.raises(ModelError, match="unknown forward 'mine': choose one of own, transformers"):
        Choice().update(forward="mine")
    assert server.parse_args(["--forward", "transformers"]).forward == "transformers"
    net, tok = net_of("qwen2", torch.float32, fused=False), lm.load_tokenizer()

    async def run(forward):
        model = model_of(net)
        model.choice.update(forward=forward)
        engine = BatchEngine(model, max_batch=4, policy=Qoe())
        before = engine.metrics()["forward"]
        text = await job_text(BatchedJob(engine, tok(PROMPTS[3]).input_ids, GenerationParams(max_tokens=12)).start())
        return text, before, engine.metrics()["forward"]

    own, theirs = asyncio.run(run("own")), asyncio.run(run("transformers"))
    assert own[1:] == (None, "own") and theirs[1:] == (None, "transformers") and own[0] == theirs[0]
