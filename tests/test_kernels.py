"""The kernel choice (streaming/model/kernels.py): every kernel computes the Linear's product
(within float tolerance: its sums run in another order), a layer runs what its table names for
the call's row count, the timings are kept per machine and read back (timed again where they were
timed beside other work and the machine is quiet now), and a batch that runs a kernel gives each
row the tokens it gets alone with that kernel. With the tiny real model, in float32 and bfloat16."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from helpers import job_text, model_of

import lm
from streaming.generation.batched import BatchedJob, BatchEngine
from streaming.generation.thread import ThreadJob
from streaming.model import busy, judging, kernels, quant, smooth
from streaming.model.kernels import ROWS, ChosenLinear
from streaming.model.loading import whole_pass
from streaming.model.testing import tiny_model
from streaming.wire.params import plain_request

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the output's largest magnitude
PROMPTS = ["Hello there", "The lighthouse keeper wrote in his log every night", "Once upon a time"]


def layer(dtype, bias=True):
    torch.manual_seed(0)
    return torch.nn.Linear(96, 160, bias=bias).to(dtype)


def even(sample, rows):
    """A fake kernels.timings: every candidate as fast as `linear` (which then stays)."""
    return dict.fromkeys(sample[0].candidates(rows), 1.0)


class Clock:
    """judging's clock in the tests of whole passes: it moves only when a faked kernel "sleeps", so
    the passes rank as the sleeps say whatever else the machine runs (real sleeps of 0.5-4 ms did
    not: beside two busy processes on this 2-core machine the ranks turned around in 3 runs of 3)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    """The machine taken as quiet while the tests time (whatever else it runs meanwhile): a kept
    file marked as timed beside other work would be timed again by the next load (busy.py)."""
    monkeypatch.setattr(busy.Watch, "so_far", lambda _: 0.0)


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(judging, "time", clock)
    return clock


NO_BLOCKS = "no oneDNN blocked product for this weight here (no oneDNN, or a bfloat16 weight on an AVX2-only CPU)"


def winning(winner):
    """A fake kernels.timings where `winner(sample, rows)` takes half of the others' time."""
    return lambda sample, rows: even(sample, rows) | {winner(sample, rows): 0.5}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_every_kernel_computes_the_linear_product_at_every_row_count(dtype, name):
    plain = layer(dtype)
    chosen = ChosenLinear(plain)
    if name == "dnn" and not chosen.blockable():
        pytest.skip(f"oneDNN lays out no {dtype} weight on this CPU (AVX2 only): never a candidate here")
    for rows in (1, 2, 3, 4, 7, 16, 33, 64, 100):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            want = torch.nn.functional.linear(x, plain.weight, plain.bias)
            got = chosen.run(name, x)
        assert got.shape == want.shape and got.is_contiguous()
        assert float((got - want).abs().max()) <= TOLERANCE[dtype] * float(want.abs().max())


def test_a_layer_runs_what_its_table_names_for_the_row_count_and_the_prefills_past_it():
    chosen = ChosenLinear(layer(torch.float32, bias=False))
    chosen.table = ["linear", "wxt", "wxt", "linear", "linear", "wxt", "xwt", "linear", "wxt", "linear"]
    assert chosen.prefill == "linear"  # until measured
    chosen.prefill = "f32"
    counts = (1, 2, 3, 4, 5, 8, 17, 32, 33, 48, 49, 64, 65, 128, 129, 256, 257, 4096)
    picks = ["linear", "wxt", "wxt", "wxt", "linear", "linear", "wxt", "wxt", "xwt", "xwt", "linear", "linear"]
    assert [chosen.pick(n) for n in counts] == [*picks, "wxt", "wxt", "linear", "linear", "f32", "f32"]
    chosen.fixed = "wxt"
    assert chosen.pick(4096) == "wxt"
    x = torch.randn(3, 5, 96)  # (batch, tokens, features): rows are batch x tokens
    with torch.inference_mode():
        assert chosen(x).shape == (3, 5, 160)


def test_prefills_run_the_kernel_timed_at_their_size_and_f32_widens_a_half_weight():
    chosen = ChosenLinear(layer(torch.bfloat16, bias=True))
    dnn = ["dnn"] if chosen.blockable() else []  # oneDNN's blocked copy, where torch has it
    assert (
        chosen.candidates(kernels.PREFILL_ROWS)
        == chosen.candidates(kernels.WIDE_ROWS)
        == ["linear", "wxt", "f32", *dnn]
    )
    assert "f32" not in chosen.candidates(kernels.WIDE_ROWS // 2)  # its copy wins at prefill sizes only
    assert "f32" not in ChosenLinear(layer(torch.float32, bias=True)).candidates(kernels.PREFILL_ROWS)
    chosen.prefill = "f32"
    assert chosen.pick(ROWS[-1]) == "linear" and chosen.pick(ROWS[-1] + 1) == chosen.pick(4096) == "f32"
    x = torch.randn(300, 96).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.float(), chosen.weight.float(), chosen.bias.float())
        got = chosen(x)
    assert got.dtype == torch.bfloat16 and chosen.wide is not None and chosen.wide.dtype == torch.float32
    assert float((got.float() - want).abs().max()) <= 2**-7 * float(want.abs().max())  # rounded once, to bf16


def test_a_measured_model_keeps_its_tables_per_machine_and_reads_them_back(tmp_path, monkeypatch):
    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    assert not any(type(m) is torch.nn.Linear for m in net.modules())
    tables = kernels.measure(net, tmp_path)  # each: a kernel per row count of ROWS, then the prefills'
    assert tables and all(len(t) == len(ROWS) + 1 and set(t) <= set(kernels.KERNELS) for t in tables.values())
    assert all(m.table + [m.prefill] in tables.values() for m in net.modules() if isinstance(m, ChosenLinear))
    (kept,) = tmp_path.glob("kernels-*.json")

    def no_timing(*_):
        raise AssertionError("timed again although the tables were kept")

    monkeypatch.setattr(kernels, "timings", no_timing)
    assert kernels.measure(net, tmp_path) == tables
    kept.write_text('{"not": "tables"}')  # a damaged file is timed again, not trusted
    timed = []
    monkeypatch.setattr(kernels, "timings", lambda sample, rows: timed.append(rows) or even(sample, rows))
    assert set(kernels.measure(net, tmp_path)) == set(tables) and timed
    wrong = {name: ["int8"] * (len(ROWS) + 1) for name in tables}  # a kernel these dense layers do not have
    kept.write_text(json.dumps(wrong))
    assert kernels.measure(net, tmp_path) != wrong
    assert all(m.pick(1) in m.candidates(1) for m in net.modules() if isinstance(m, ChosenLinear))


def test_tables_timed_beside_other_work_are_kept_and_timed_again_once_when_the_machine_is_quiet(
    tmp_path, monkeypatch, caplog
):
    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    timed = []
    monkeypatch.setattr(kernels, "timings", lambda sample, rows: timed.append(rows) or even(sample, rows))
    monkeypatch.setattr(busy.Watch, "so_far", lambda _: 1.2)  # a server loading beside the timing
    tables = kernels.measure(net, tmp_path)
    (kept,) = tmp_path.glob("kernels-*.json")
    assert json.loads(kept.read_text())[kernels.BESIDE] == 1.2  # kept all the same, and said so
    assert "beside other processes' work (1.20 cores)" in caplog.text
    asked = []
    monkeypatch.setattr(busy, "now", lambda: asked.append(1) or 0.9)  # still busy: the kept ones serve
    timed.clear()
    assert kernels.measure(net, tmp_path) == tables and not timed and asked == [1]
    monkeypatch.setattr(busy, "now", lambda: 0.05)  # quiet now: timed again
    monkeypatch.setattr(busy.Watch, "so_far", lambda _: 0.6)  # (and busy again meanwhile)
    assert set(kernels.measure(net, tmp_path)) == set(tables) and timed
    assert json.loads(kept.read_text())[kernels.BESIDE] == 0.6 and json.loads(kept.read_text())[kernels.AGAIN]
    monkeypatch.setattr(busy, "now", lambda: pytest.fail("timed again once: no second look"))
    timed.clear()
    assert kernels.measure(net, tmp_path) == tables and not timed


def test_other_processes_cpu_is_read_from_proc_less_this_processs_own():
    name = "4242 (a (b) c) R 1 2 3 0 -1 4194304 99 0 0 0 700 300 0 0 20 0 1 0"  # a command name with ") "
    fields = busy.stat_fields(name)
    assert fields[:2] == ["R", "1"] and busy.stat_ticks(fields) == 1000 and busy.stat_ticks([]) == 0
    # user nice system idle iowait irq softirq steal: idle and iowait are not busy
    stat = "cpu  15 1 7 150 10 3 4 6 0 0\ncpu0 10 1 5 100 7 2 3 4 0 0\ncpu1 5 0 2 50 3 1 1 2 0 0\nintr 9\n"
    assert busy.machine_ticks(stat, {0}) == 25 and busy.machine_ticks(stat) == 25 + 11  # its CPUs' lines
    with pytest.raises(ValueError):
        busy.machine_ticks("intr 1 2 3")
    assert busy.others((100, 40), (300, 140), seconds=2.0, hz=100) == 0.5  # 200 ticks, 100 of them its own
    assert busy.others((100, 40), (150, 140), seconds=2.0, hz=100) == 0.0  # (ticks land late: never below 0)


def test_a_process_spinning_beside_is_other_work(monkeypatch):
    import subprocess
    import sys

    monkeypatch.undo()  # (the module's `quiet`: here the machine is read)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert (busy.now(1.0) or 0.0) > busy.QUIET_CORES  # (None: no /proc here)
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.parametrize("slow", ["wxt", "linear"])
def test_the_tables_are_checked_in_the_whole_model_and_a_row_count_they_lose_at_runs_linear(
    tmp_path, monkeypatch, slow, clock
):
    """Each shape's own timing chose `wxt` (faked); whole passes of the model then run with the
    tables and with `linear` everywhere, in turn: where the tables lost (a `wxt` made slow), every
    row count goes back to `linear`, and the kept file says so; where they won, they stay."""
    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    monkeypatch.setattr(kernels, "timings", winning(lambda _sample, rows: "wxt" if rows > 1 else "linear"))
    plain = kernels.KERNELS[slow]

    def slowed(layer, x):
        clock.sleep(0.002)
        return plain(layer, x)

    monkeypatch.setitem(kernels.KERNELS, slow, slowed)
    passes = []
    tables = kernels.measure(net, tmp_path, step=lambda n: passes.append(n) or whole_pass(net, n))
    # (the judge's clock counts only the sleeps, not the tiny model's own products: every row count is judged)
    want = ["linear"] * (len(ROWS) + 1) if slow == "wxt" else ["linear"] + ["wxt"] * len(ROWS)
    assert all(t == want for t in tables.values()), tables
    assert all(m.table + [m.prefill] == want for m in net.modules() if isinstance(m, ChosenLinear))
    assert sorted(set(passes)) == [*ROWS[1:], kernels.PREFILL_ROWS]  # 1 row ran linear already: not checked
    assert kernels.measure(net, tmp_path) == tables  # kept as checked


def test_a_cache_that_cannot_be_written_only_means_timing_again(tmp_path):
    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert kernels.measure(net, blocked)  # mkdir fails: a warning, the tables still set
    assert list(tmp_path.iterdir()) == [blocked]  # no temporary file left behind


def test_a_quantized_layer_times_its_own_kernel_too_and_never_runs_it_where_dense_is_faster(monkeypatch):
    net = quant.quantize(tiny_model(lm.load_tokenizer()).to(torch.float32), "int8")
    q = next(m for m in net.modules() if isinstance(m, quant.QuantLinear))
    dnn = ["dnn"] if q.blockable() else []
    assert q.candidates(1) == ["linear", "mv", "xwt", *dnn, "int8"]
    assert q.candidates(8) == ["linear", "wxt", *dnn, "int8"]
    monkeypatch.setattr(kernels, "timings", winning(lambda sample, rows: "linear" if rows > 2 else sample[0].mode))
    kernels.measure(net)
    assert q.table[:3] == ["int8", "int8", "linear"] and q.pick(1) == "int8" and q.pick(64) == "linear"


def params(i, n=16):
    return plain_request({"prompt": PROMPTS[i], "max_tokens": n, "seed": i, "temperature": 0}).params


def alone_and_together(net):
    """Each prompt's greedy text alone (the thread engine), then all of them in one batch."""
    model = model_of(net)
    ids = [lm.tok(p).input_ids for p in PROMPTS]

    async def run():
        alone = [await job_text(ThreadJob(ids[i], params(i), model=model).start()) for i in range(len(PROMPTS))]
        e = BatchEngine(model, max_batch=4)
        together = await asyncio.gather(
            *(job_text(BatchedJob(e, ids[i], params(i)).start()) for i in range(len(PROMPTS)))
        )
        return alone, list(together)

    return asyncio.run(run())


@pytest.mark.parametrize("name", sorted(kernels.KERNELS))
def test_a_batch_running_a_kernel_gives_each_row_its_tokens_alone_with_that_kernel(name):
    net = tiny_model(lm.load_tokenizer()).to(torch.float32).eval()
    kernels.wrap(net)
    for m in net.modules():
        if isinstance(m, ChosenLinear):
            m.fixed = name
    alone, together = alone_and_together(net)
    assert all(alone) and together == alone


def test_the_bf16_weights_of_a_float32_model_compute_its_product_within_bfloat16s_rounding():
    """--quantize bf16: a float32 layer's weights (and rows) rounded to bfloat16, the product widened
    back; a candidate beside the dense kernels at every row count, cut by rows for timing."""
    plain = layer(torch.float32)
    q = quant.QuantLinear(plain, "bf16")
    dnn = ["dnn"] if q.blockable() else []  # a float32 weight: oneDNN's blocked product where torch has it
    assert q.wh.dtype == torch.bfloat16 and q.candidates(1) == ["linear", "mv", "xwt", *dnn, "bf16"]
    assert q.table[:3] == ["bf16", "bf16", "linear"]  # until measured: where it wins on an AVX2 CPU
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 96)
        want = plain(x)
        got = q.run("bf16", x)
        assert got.dtype == torch.float32 and (got - want).abs().max() <= TOLERANCE[torch.bfloat16] * want.abs().max()
    piece = q.part(40)
    assert piece is not None and piece.wh.shape == (40, 96) and piece.run("bf16", x).shape == (64, 40)
    with pytest.raises(ValueError, match="float32"):
        quant.QuantLinear(layer(torch.bfloat16), "bf16")


def test_a_batch_through_the_bf16_weights_gives_each_row_its_tokens_alone_through_them():
    net = quant.quantize(tiny_model(lm.load_tokenizer()).to(torch.float32).eval(), "bf16", dense_from=1 << 30)
    assert all(m.fixed == "bf16" for m in net.modules() if isinstance(m, quant.QuantLinear))
    alone, together = alone_and_together(net)
    assert all(alone) and together == alone


needs_fbgemm = pytest.mark.skipif(not quant.fbgemm_available(), reason="fbgemm's kernels: x86 builds of torch only")


@needs_fbgemm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_fp16_weights_compute_the_product_within_float16s_rounding_in_float32_arithmetic(dtype):
    """--quantize fp16: fbgemm's packed float16 copy of the weights; the rows stay as they are
    (a bfloat16 model's are widened for it and the product rounded back), a candidate at every row
    count, packed again when cut by rows for timing."""
    plain = layer(dtype)
    q = quant.QuantLinear(plain, "fp16")
    dnn = ["dnn"] if q.blockable() else []
    assert q.candidates(1) == ["linear", "mv", "xwt", *dnn, "fp16"]
    assert q.candidates(16) == ["linear", "wxt", *dnn, "fp16"]
    assert q.table == ["fp16"] * len(ROWS)  # until measured: it wins at every decode row count on an AVX2 CPU
    tolerance = 1e-3 if dtype == torch.float32 else TOLERANCE[dtype]  # float16 weights: ~2e-4 of the product
    for rows in (1, 2, 7, 64, 100):
        x = torch.randn(rows, 96).to(dtype)
        with torch.inference_mode():
            want, got = plain(x), q.run("fp16", x)
        assert got.dtype == dtype and float((got - want).abs().max()) <= tolerance * float(want.abs().max())
    piece = q.part(40)
    assert piece is not None and piece.run("fp16", x).shape == (100, 40)
    with torch.inference_mode():
        assert torch.equal(piece.run("fp16", x), q.run("fp16", x)[:, :40])
    huge = layer(torch.float32)
    with torch.no_grad():
        huge.weight[0, 0] = 1e5
    with pytest.raises(ValueError, match="float16's range"):
        quant.QuantLinear(huge, "fp16")


@needs_fbgemm
def test_a_batch_through_the_fp16_weights_gives_each_row_its_tokens_alone_through_them():
    net = quant.quantize(tiny_model(lm.load_tokenizer()).to(torch.float32).eval(), "fp16", dense_from=1 << 30)
    assert all(m.fixed == "fp16" for m in net.modules() if isinstance(m, quant.QuantLinear))
    alone, together = alone_and_together(net)
    assert all(alone) and together == alone


@needs_fbgemm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_w8a8_product_is_each_rows_own_whatever_else_is_in_the_batch(dtype):
    """--quantize w8a8: int8 weights and int8 rows through fbgemm's dynamic kernel, which
    quantizes its whole input with one scale; each row is mapped onto exactly [-1, 1] first, so
    a row's product is the same bits alone as beside any other rows (one with a channel 100x the
    rest, one of equal values), and within 8 bits' rounding of the dense product."""
    plain = layer(dtype)
    s = torch.rand(96) + 0.5
    q = quant.QuantLinear(plain, "w8a8", smooth=s)
    i8w = ["i8w"] if quant.int8_fast() else []  # torch's int8 weight kernel too, where it is fast
    dnn = ["dnn"] if q.blockable() else []
    assert q.candidates(1) == ["linear", "mv", "xwt", *dnn, "w8a8", *i8w] and q.table == ["w8a8"] * len(ROWS)
    assert "i8w" not in q.candidates(quant.I8W_ROWS + 1)
    torch.manual_seed(1)
    x = torch.randn(9, 96)
    x[3, 5] = 100.0  # an outlier channel in one row
    x[4] = 0.25  # a row of equal values
    x[6] += 3.0  # a row off zero
    x = x.to(dtype)
    with torch.inference_mode():
        together = q.run("w8a8", x)
        alone = torch.cat([q.run("w8a8", x[i : i + 1]) for i in range(len(x))])
        want = plain(x)
        assert together.dtype == dtype and torch.equal(together, alone)
        assert torch.equal(q.run("w8a8", x[2:5]), together[2:5])
        # 8 bits a row and a column: ~1% of the row's largest output; without VNNI the weights get
        # 7 bits (quant.weight_levels()), twice their rounding
        bound = 3e-2 if quant.vnni() else 6e-2
        for i in range(len(x)):
            err = float((together[i] - want[i]).float().abs().max())
            assert err <= bound * float(want[i].float().abs().max()) + 1e-3, i
        piece = q.part(40)
        assert piece is not None and torch.equal(piece.run("w8a8", x), together[:, :40])
    with pytest.raises(ValueError, match="smoothing factors"):
        quant.QuantLinear(plain, "w8a8")


@needs_fbgemm
def test_a_batch_through_w8a8_gives_each_row_its_tokens_alone_through_it():
    """The whole tiny model smoothed on the calibration text: every Linear w8a8 but the MLP's down
    projection (int8 or float16 weights only: its inputs do not fit 8 bits a row), every product
    through the quantized kernels, a batch's texts equal to each prompt's alone. The down
    projection runs `mv` here, whose rows are their own: fbgemm's float16 product (kept_mode on
    the AVX2 kind) is not (a row's last bits depend on how many rows the call has: 10 of 40
    rows, a call of 1 to 40 rows, on the AVX2 EPYC), which with 8-bit rows changed a greedy token
    of this random model."""
    tok = lm.load_tokenizer()
    net = quant.quantize(tiny_model(tok).to(torch.float32).eval(), "w8a8", 1 << 30, smooth.calibration_ids(tok))
    modes = {n.rsplit(".", 1)[-1]: m.fixed for n, m in net.named_modules() if isinstance(m, quant.QuantLinear)}
    assert modes["down_proj"] == quant.kept_mode() and modes["up_proj"] == modes["q_proj"] == modes["lm_head"] == "w8a8"
    for name, m in net.named_modules():
        if name.endswith("down_proj"):
            m.fixed = "mv"
    alone, together = alone_and_together(net)
    assert all(alone) and together == alone
    with pytest.raises(ValueError, match="smooths on a text"):
        quant.quantize(tiny_model(tok).eval(), "w8a8")


@needs_fbgemm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_w8a8s_int8_weight_kernel_is_each_rows_own_and_its_copy_is_kept_only_where_chosen(dtype, monkeypatch):
    """ "i8w": a w8a8 layer's unsmoothed weights in int8 (a scale per output) through torch's int8
    weight kernel, the rows as they are: within int8 weights' rounding of the dense product, each
    row the same bits alone as in any batch; offered where that kernel is fast (AVX512) up to
    I8W_ROWS rows; its copy made by a table that names it, dropped by one that does not, and not
    shared with a piece of the layer."""
    plain = layer(dtype)
    q = quant.QuantLinear(plain, "w8a8", smooth=torch.rand(96) + 0.5)
    for capability, offered in (("AVX512", True), ("AVX2", False)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert ("i8w" in q.candidates(1)) == offered and "i8w" not in q.candidates(quant.I8W_ROWS + 1)
    monkeypatch.undo()
    torch.manual_seed(2)
    x = torch.randn(7, 96).to(dtype)
    with torch.inference_mode():
        together, want = q.run("i8w", x), plain(x)
        assert together.dtype == dtype and torch.equal(together, torch.cat([q.run("i8w", r[None]) for r in x]))
        for i in range(len(x)):  # int8 weights: 1/254 of each output's largest weight, summed over 96 inputs
            err = float((together[i] - want[i]).float().abs().max())
            assert err <= 3e-2 * float(want[i].float().abs().max()) + 1e-3, i
    assert q.int8_copy is not None and q.part(40).int8_copy is None
    kernels.use([q], ["i8w", *["w8a8"] * len(ROWS)])
    assert q.int8_copy is not None and q.pick(1) == "i8w"
    kernels.use([q], ["w8a8"] * (len(ROWS) + 1))
    assert q.int8_copy is None


@needs_fbgemm
def test_a_batch_through_w8a8s_int8_weight_kernel_gives_each_row_its_tokens_alone_through_it():
    tok = lm.load_tokenizer()
    net = quant.quantize(tiny_model(tok).to(torch.float32).eval(), "w8a8", 1 << 30, smooth.calibration_ids(tok))
    for m in net.modules():
        if isinstance(m, quant.QuantLinear) and m.mode == "w8a8":
            m.fixed = "i8w"
        elif isinstance(m, quant.QuantLinear):
            m.fixed = "mv"  # the down projection (as in the w8a8 test above: rows of their own)
    alone, together = alone_and_together(net)
    assert all(alone) and together == alone


def test_w8a8_keeps_the_down_projection_in_the_weight_kernel_this_cpu_runs_fast(monkeypatch):
    """int8 weights where torch's int8 kernel is vectorized (AVX512), float16 elsewhere, and int8
    for a weight float16 cannot hold (w8a8 still loads)."""
    small, huge = torch.ones(4, 4), torch.full((4, 4), 7e4)
    for capability, want in (("AVX512", ["int8", "int8"]), ("AVX2", ["fp16", "int8"]), ("DEFAULT", ["fp16", "int8"])):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert [quant.kept_mode(small), quant.kept_mode(huge)] == want, capability


def test_the_blocked_copy_is_made_only_for_a_table_that_names_it_and_runs_the_same_product():
    """ "dnn" keeps oneDNN's own layout of the weight (a copy): a table that chose it makes it at
    once (not in the first request's step), one that did not drops the timings' copy; a piece of a
    layer (the output layer timed by its first rows) gets none of the whole's."""
    chosen = ChosenLinear(layer(torch.bfloat16, bias=True))
    if not chosen.blockable():
        pytest.skip(NO_BLOCKS)
    assert "dnn" in chosen.candidates(1) and "dnn" in chosen.candidates(2)
    kernels.use([chosen], ["mv", *["dnn"] * (len(ROWS) - 1), "dnn"])
    assert chosen.blocks is not None and chosen.part(40).blocks is None
    x = torch.randn(5, 96).to(torch.bfloat16)
    with torch.inference_mode():
        want = torch.nn.functional.linear(x, chosen.weight, chosen.bias)
        assert torch.allclose(
            chosen(x).float(), want.float(), rtol=0, atol=TOLERANCE[torch.bfloat16] * float(want.abs().max())
        )
    kernels.use([chosen], ["linear"] * (len(ROWS) + 1))
    assert chosen.blocks is None


def test_a_process_times_its_kernels_only_when_no_other_is_timing_on_the_machine(tmp_path, monkeypatch):
    """Timings taken beside another process's are the contention's, and they are kept: a load
    waits on the kept tables' folder's lock (held here as another process would), then times."""
    import fcntl
    import threading

    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    monkeypatch.setattr(kernels, "timings", even)  # the lock, not the timing
    done = threading.Event()
    with open(tmp_path / kernels.LOCK_FILE, "a+b") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiting = threading.Thread(target=lambda: (kernels.measure(net, tmp_path), done.set()))
        waiting.start()
        assert not done.wait(0.5) and not list(tmp_path.glob("kernels-*.json"))
    waiting.join(60)
    assert done.is_set() and len(list(tmp_path.glob("kernels-*.json"))) == 1


def test_a_copy_kept_for_some_row_counts_wins_at_the_plain_margin_at_the_others_from_the_same_timings(monkeypatch):
    """The copy's margin pays for its memory once: a table that keeps the blocked copy for 64 rows
    and up lets it win the prefills' band by the plain margin (95% of linear's time: not the copy's
    90%), from the timings already taken (each row count timed once); without a copy, the plain
    kernels as before."""
    chosen = ChosenLinear(layer(torch.bfloat16, bias=False))
    if not chosen.blockable():
        pytest.skip(NO_BLOCKS)
    calls = []

    def fake(sample, rows):
        calls.append(rows)
        times = even(sample, rows) | ({"mv": 0.5} if rows == 1 else {"wxt": 0.5, "dnn": 0.8})
        if rows >= 64:
            times |= {"wxt": 1.0, "dnn": 0.8 if rows <= ROWS[-1] else 0.95}
        return times

    monkeypatch.setattr(kernels, "timings", fake)
    table = kernels.timed_table([chosen], ROWS)
    assert table == ["mv", *["wxt"] * 6, "dnn", "dnn", "dnn", "dnn"]  # 2-48: "wxt" won at either margin
    assert calls == [*ROWS, kernels.PREFILL_ROWS]
    calls.clear()
    monkeypatch.setattr(kernels, "timings", lambda sample, rows: calls.append(rows) or even(sample, rows))
    assert kernels.timed_table([chosen], ROWS) == ["linear"] * (len(ROWS) + 1) and len(calls) == len(ROWS) + 1


def test_the_whole_model_judges_the_kernels_close_to_each_shapes_fastest_among_the_others(tmp_path, monkeypatch, clock):
    """Each shape's own timing (faked) put `wxt` first and `linear` within judging.CLOSE of it, every
    other kernel far behind (one row: `linear` first; the output layer from 64 rows too, where its
    `wxt` is dear anyway). In the model `wxt` is slow for the output layer and `linear` for the
    others (sleeps): whole passes, each with one shape changed, give the output layer `linear` at
    every row count and leave the others on `wxt` (which check(), against `linear` everywhere,
    cannot give); no kernel past CLOSE runs at all; the kept file holds the judged tables."""
    net = tiny_model(lm.load_tokenizer()).to(torch.float32)
    kernels.wrap(net)
    head = net.lm_head
    assert isinstance(head, ChosenLinear)

    def timings(sample, rows):  # (one row has no `wxt`: `linear` wins there)
        if sample[0].out_features == head.out_features and rows >= 64:  # (`wxt` far behind: no dear passes)
            return {k: 1.0 if k == "linear" else 2.0 for k in sample[0].candidates(rows)}
        return {k: {"wxt": 1.0, "linear": 1.2}.get(k, 2.0) for k in sample[0].candidates(rows)}

    monkeypatch.setattr(kernels, "timings", timings)
    monkeypatch.setattr(judging, "TUNE_ROUNDS", 3)  # (sleeps far past the noise: fewer rounds do)
    monkeypatch.setattr(judging, "CHECK_ROUNDS", 1)  # (`linear` everywhere: a sleep in every layer)
    ran = set()
    for name, kernel in dict(kernels.KERNELS).items():

        def watched(layer, x, name=name, kernel=kernel):
            ran.add(name)
            if (name == "wxt") == (layer is head):
                clock.sleep(0.015 if layer is head else 0.006)
            return kernel(layer, x)

        monkeypatch.setitem(kernels.KERNELS, name, watched)
    tables = kernels.measure(net, tmp_path, step=lambda n: whole_pass(net, n))
    head_name = kernels.shape_name(head.shape())
    # (the head's prefill entry never runs: a pass keeps the logits of at most ROWS[-1] rows)
    assert tables[head_name][:-1] == ["linear"] * len(ROWS), tables
    assert all(t == ["linear"] + ["wxt"] * len(ROWS) for name, t in tables.items() if name != head_name), tables
    assert head.table + [head.prefill] == tables[head_name]
    assert ran == {"linear", "wxt"}
    assert kernels.measure(net, tmp_path) == tables  # kept as judged


def test_a_quantized_models_tables_run_against_its_dense_kernels_and_lose_to_them_where_slower(
    tmp_path, monkeypatch, clock
):
    """Each shape's own timing (faked) put the int8 kernel first and `wxt` first among the dense
    ones. In the model (sleeps) the int8 kernel is the fastest below 64 rows and slower than `wxt`
    from there, `linear` the slowest everywhere: check() gives the row counts from 64 on `wxt`, the
    shapes' fastest dense kernel (not `linear`), and leaves int8 below; the kept file says so."""
    net = quant.quantize(tiny_model(lm.load_tokenizer()).to(torch.float32), "int8")
    kernels.wrap(net)

    def timings(sample, rows):
        return {k: {"int8": 0.5, "wxt": 0.8, "linear": 1.0}.get(k, 2.0) for k in sample[0].candidates(rows)}

    monkeypatch.setattr(kernels, "timings", timings)
    monkeypatch.setattr(judging, "CONFIRM_ROUNDS", 3)
    slept = {"linear": lambda _: 0.002, "wxt": lambda _: 0.0005, "int8": lambda rows: 0.004 if rows >= 64 else 0}
    for name in ("linear", "wxt"):  # (each the plain product: `wxt`'s own copies the output layer's wide rows)
        monkeypatch.setitem(kernels.KERNELS, name, sleeping(clock, kernels.linear, slept[name]))
    run = quant.QuantLinear.run

    def slow_int8(layer, name, x):  # (the product itself a dense one: the real int8 kernel's speed varies by CPU)
        if name != "int8":
            return run(layer, name, x)
        clock.sleep(slept["int8"](x.shape[0]))
        return torch.nn.functional.linear(x, layer.weight, layer.bias)

    monkeypatch.setattr(quant.QuantLinear, "run", slow_int8)
    tables = kernels.measure(net, tmp_path, step=lambda n: whole_pass(net, n))
    want = ["int8"] * ROWS.index(64) + ["wxt"] * (len(ROWS) + 1 - ROWS.index(64))
    assert all(t == want for t in tables.values()), {k: t for k, t in tables.items() if t != want}
    assert kernels.measure(net, tmp_path) == tables  # kept as checked


def sleeping(clock, kernel, seconds):
    def slept(layer, x):
        clock.sleep(seconds(x.shape[0]))
        return kernel(layer, x)

    return slept


class Layer:
    """What judging's passes need of a layer: a table, a prefill kernel, one to force."""

    def __init__(self) -> None:
        self.table, self.prefill, self.fixed = ["wxt"] * len(ROWS), "wxt", None

    def pick(self, _rows):
        return self.fixed or self.table[0]


@pytest.mark.parametrize("again", [True, False])
def test_a_row_count_goes_back_to_linear_only_when_its_tables_lose_twice(again, clock):
    """The chosen tables' passes are slow in check()'s first rounds only, or always: a loss seen
    once (the machine's noise) keeps the tables; one seen again sets the row count back."""
    layers = [Layer(), Layer()]
    calls = []

    def step(_n):
        chosen = layers[0].fixed is None
        calls.append(chosen)
        slow = chosen and (again or calls.count(True) <= judging.CHECK_ROUNDS + 1)
        clock.sleep(0.004 if slow else 0.002 if not chosen else 0)

    assert judging.check(layers, step, [8]) == ({0: "linear"} if again else {})
    assert calls.count(True) == judging.CHECK_ROUNDS + judging.CONFIRM_ROUNDS + 2  # each after one to warm up
