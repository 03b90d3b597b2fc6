"""Which matrix product each Linear layer runs, chosen per call by how many rows multiply, from
timings taken when the model loads.

A decode step multiplies every weight matrix by as many rows as the batch has, and the fastest
way to do that depends on the row count, the machine and the build of torch, in ways nobody can
guess. Measured here (AMD EPYC, AVX2, torch 2.13's CPU wheel, float32, the bundled model's
896 x 4864 MLP weights): `F.linear(x, W)` takes 2.8 ms for 4 rows, and the same product written
as `(W @ xᵀ)ᵀ` takes 1.0 ms (the BLAS call is laid out the other way round); from ~128 rows they
are even. And torch's int8 weight kernel (`_weight_int8pack_mm`, quant.py) wins at batch 1 on
an AVX-512 machine but on this AVX2 one is 2x slower than dense at 1 row and 40x at 32.

So nothing is assumed: at load, `measure()` times each candidate kernel on the model's own
weights (enough of them that they do not sit in the cache) at each row count of ROWS, and each
layer gets a table: the kernel for each row count, the plain `linear` unless another is faster
by a margin (MARGIN; COPY_MARGIN for one that costs memory); past ROWS[-1] rows (prefills) the
kernel timed at PREFILL_ROWS. The tables are kept on disk, so
every process on a machine runs the same kernels (and computes the same bits for a request alone);
a batch's logits may differ from a request's alone in the last bits anyway (padding changes the
shapes).

One kernel needs a transposed copy of the weight (`xwt`: 1.5x faster than `linear` at one row
here for the 896 x 4864 MLP weights and the 151,936-row output layer, not for the others): it is
timed at one and two rows only, and a layer keeps the copy only if its table chose it (the
bundled model in float32: ~1.4 GB more, beside the 2 GB of weights). At one row `mv` (torch's
matrix-vector product) needs no copy: on an Intel Xeon with AVX-512 BF16 it took the bundled
model's one-row step in bfloat16 from 92 to 63 ms, every layer choosing it. At every row count,
where torch has oneDNN, `dnn` multiplies by a copy of the weight laid out once in oneDNN's
blocked format (`linear` lays the plain weight out again at every call): on the Xeon with AMX it
took a 64-row bfloat16 step from 140 to 110 ms, and on the AMD EPYC without AMX a one-row step
from 71 to 51 ms (a candidate from two rows only until the tables' format kernels-9). A copy that a table keeps for some row counts is
judged at the plain margin at the others, from the same timings (`table_of`: its memory is paid once).

Then the whole model judges them (judging.py): at each row count, each kernel close to its
shape's fastest on its own runs in whole passes among the others (`tune()`: a kernel that wins
alone can lose among the others, and the reverse), and the tables run against `linear`
everywhere, and a quantized model's against its dense kernels (`check()`), which takes back the
row counts where they lost twice (to the winner); the tables are kept after it. One process on a
machine times at a time (`timing_alone`): timings taken beside another's are the contention's.
Nor can the lock keep out other work (a peer loading, a test suite): tables timed while other
processes kept more than busy.QUIET_CORES busy are kept with a warning and that figure, and timed
again, once, by the first load that finds the machine quiet (busy.py).

Leaves out: GPUs and MPS (their libraries choose well: only the CPU is measured).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from streaming.model import busy, judging, locks

# Row counts measured; a count between two takes the larger's kernel. 48 splits 33-64, where a
# burst's decode steps run: on the AMD EPYC without AMX, w8a8's own product for the gate and up
# product and the output layer took whole 48-row steps from 187.0 to 171.5 ms (40 rows: 160.8 to
# 154.5) and 56- and 64-row ones from 220.8 to 238.5 and 239.8 to 260.9: a choice judged at 64
# fit 48 only by chance (one timing chose the dense kernels there, as bfloat16's tables, another w8a8's).
ROWS = (1, 2, 4, 8, 16, 32, 48, 64, 128, 256)
# The row count timed for every count past ROWS[-1]: what a prefill step runs (the qoe policy's
# MAX_PREFILL prompt tokens, with the decoding rows). Timed at 256 and used for everything past 64,
# it chose `wxt` for the 4864 x 896 layers on an Intel Xeon with AMX (1.55 against 1.54 ms at 256
# rows: a coin toss), which at the 525 rows a burst's prefill steps ran took 6.1 against 2.7 ms:
# 12% of each prefill step. The kernels' speeds are not monotonic in rows, so each band is timed.
PREFILL_ROWS = 512
MARGIN = 0.97  # a kernel replaces `linear` only when its median time is at most 97% of linear's (noise)
COPY_MARGIN = 0.9  # one that keeps a copy of the weight (COPYING), at most 90%: it costs memory
# The kept file's format: a change of it, or of what is timed, times again. kernels-10: the file
# says how busy the machine was (BESIDE, AGAIN), which a build reading kernels-9 took for a table.
FORMAT = "kernels-10"
ROUNDS = 5  # timings of each candidate at each row count, judged by their median
SAMPLE_BYTES = 64 << 20  # weights timed per shape: more than a CPU's last-level cache, as in a real step
LOCK_FILE = "kernels.lock"  # in the kept tables' folder: one process times at a time (timing_alone)
WAITING = "another process is timing its kernels on this machine: waiting for it"
# The kept file's entry for the cores other processes kept busy while its tables were timed
# (busy.py): past busy.QUIET_CORES they are timed again by the next load that finds the machine quiet.
BESIDE = "timed beside other work (cores)"
AGAIN = "timed again"  # (true once timed again: a machine never quiet for a timing is not timed at every load)
TIMED_BESIDE = "kernel timings taken beside other processes' work (%.2f cores): kept, and taken again by a load that finds the machine quiet"
RETIMING = (
    "the kept kernel tables were timed beside other work (%.2f cores); the machine is quiet now (%.2f): timing again"
)
STILL_BUSY = "the kept kernel tables were timed beside other work (%.2f cores), and the machine is busy now (%s): kept"
MODES = ("measure", "linear")  # --kernels: measure at load (the default), or the plain product always


def linear(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def weight_first(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    """(W @ xᵀ)ᵀ: the same product, the BLAS call laid out with the weight first."""
    y = torch.mm(layer.weight, x.t()).t().contiguous()
    return y if layer.bias is None else y + layer.bias


def vector(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    """W·x for each row on its own (torch.mv): torch's matrix-vector kernel, which reads a bfloat16
    weight at 22-25 GB/s where `linear` at one row reads it at 15-19 here (an Intel Xeon with
    AVX-512 BF16: 0.40 against 0.58 ms for 896 x 4864, 10.9 against 15.7 for the output layer),
    and a one-row step is bound by reading the weights. Timed at one row only; a row's product is
    the same whatever else is in the call."""
    if x.shape[0] == 1:
        y = torch.mv(layer.weight, x[0]).unsqueeze(0)
    elif x.shape[0]:
        y = torch.stack([torch.mv(layer.weight, row) for row in x])
    else:
        return linear(layer, x)
    return y if layer.bias is None else y + layer.bias


def blocked(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    """x @ Wᵀ by oneDNN from a copy of the weight laid out once in its own blocked format (what
    torch.compile's CPU backend does), kept by the layer: `linear` hands oneDNN the plain weight,
    which it lays out again at every call, reading the whole weight an extra time. Measured on the
    Intel Xeon with AMX, bfloat16, 24 layers' distinct weights: the fused 896 x 9728 gate and up
    product 0.84 against 1.32 ms at 16 rows, 5.7 against 7.4 at 512; the output layer 11.9
    against 18.0 ms at 16 rows; at one row torch.mv is as fast there. On the AMD EPYC with AVX-512
    BF16 (no AMX) it wins at one row too, where a one-row step had cost more than a two-row one (70
    against 57 ms, `bench.py profile`): 24 layers' distinct weights at one row, 17.2 against 27.1
    ms (`linear`) and 39.8 (`mv`) for the gate and up product, 10.2 against 19.3 and 30.0 for the
    output layer. The same bits as `linear` here in bfloat16. Offered where torch has oneDNN's ops
    (its CPU builds for x86 and ARM)."""
    return torch.ops.mkldnn._linear_pointwise(x, layer.blocked_weight(), layer.bias, "none", [], "")


def transposed_first(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    """x @ Wᵀ from a transposed copy of the weight, kept by the layer (twice its memory): the one
    kernel that beats `linear` at a single row here (0.73 against 1.09 ms for 896 x 4864)."""
    y = x @ layer.transposed()
    return y if layer.bias is None else y + layer.bias


def widened(layer: ChosenLinear, x: torch.Tensor) -> torch.Tensor:
    """x @ Wᵀ in float32, from a float32 copy of a bfloat16 or float16 weight kept by the layer
    (three times the weight's memory in all), rounded back: on a CPU whose half-precision products
    are slower than its float32 ones at prefill sizes (an Intel Xeon without AMX here: 140 against
    210 GFLOP/s at 256 rows of 896 x 4864; with AMX, bfloat16 runs at 1.7-2 TFLOP/s and wins).
    Timed from WIDE_ROWS rows."""
    bias = None if layer.bias is None else layer.bias.to(torch.float32)
    return torch.nn.functional.linear(x.to(torch.float32), layer.widened(), bias).to(x.dtype)


KERNELS: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "linear": linear,
    "wxt": weight_first,
    "xwt": transposed_first,
    "mv": vector,
    "f32": widened,
    "dnn": blocked,
}
COPYING = ("xwt", "dnn")  # kernels that keep a copy of the weight: kept only if chosen, and win by COPY_MARGIN
COPY_ROWS = 2  # "xwt" up to this many rows (past it the others win here, and timing costs a copy)
BLOCK_ROWS = 16  # the row count oneDNN lays the weight out for ("dnn"; one layout serves every count)
HALF = (torch.bfloat16, torch.float16)  # weights that "f32" can widen
WIDE_ROWS = 128  # from this many rows "f32" is a candidate (a copy of the weight that wins only at prefill sizes)
log = logging.getLogger("streaming.model")
BLOCKING = hasattr(torch.ops.mkldnn, "_linear_pointwise") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# oneDNN lays out a bfloat16 or float16 weight only on a CPU with those products (AVX-512 BW/VL/DQ,
# AVX-NE-CONVERT): on an AVX2-only one torch refuses ("bf16 path needs the cpu support ..."), so
# "dnn" is no candidate there for such a weight (a bfloat16 model on the AVX2 kind failed to load)
BLOCKABLE_HALF = {
    torch.bfloat16: lambda: bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    torch.float16: lambda: bool(torch.ops.mkldnn._is_mkldnn_fp16_supported()),
}


class ChosenLinear(torch.nn.Module):
    """A Linear that runs, for each call, the kernel its table names for that many rows."""

    copying: ClassVar[tuple[str, ...]] = COPYING  # its kernels that keep a copy of the weight (COPY_MARGIN)
    # kernel -> the attribute holding its copy and what makes it (WEIGHT_COPIES; a subclass adds its own)
    copies: ClassVar[dict[str, tuple[str, Callable[[Any], Any]]]]

    def __init__(self, layer: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.table = ["linear"] * len(ROWS)  # until measured (or --kernels linear)
        self.prefill = "linear"  # past ROWS[-1] rows: the kernel timed at PREFILL_ROWS
        self.fixed: str | None = None  # one kernel for every call (tests, scripts/perplexity.py)
        self.copy: torch.Tensor | None
        self.register_buffer("copy", None, persistent=False)  # Wᵀ, contiguous, while "xwt" may run
        self.wide: torch.Tensor | None
        self.register_buffer("wide", None, persistent=False)  # W in float32, while "f32" may run
        # W in oneDNN's blocked layout, while "dnn" may run: an opaque tensor that no module method
        # (.to(), state_dict) can handle, so an attribute, not a buffer
        self.blocks: torch.Tensor | None = None

    def candidates(self, rows: int) -> list[str]:
        """The kernels worth timing at this many rows (`linear` first: the one to beat)."""
        dnn = ["dnn"] if self.blockable() else []
        if rows >= WIDE_ROWS:
            return ["linear", "wxt", *(["f32"] if self.weight.dtype in HALF else []), *dnn]
        if rows == 1:
            return ["linear", "mv", "xwt", *dnn]
        return ["linear", "wxt", *(["xwt"] if rows <= COPY_ROWS else []), *dnn]

    def blockable(self) -> bool:
        """Whether oneDNN's blocked product can run here: torch built with it, a CPU weight, and for a
        half-width weight a CPU whose oneDNN multiplies in it (BLOCKABLE_HALF)."""
        native = BLOCKABLE_HALF.get(self.weight.dtype, lambda: True)
        return self.weight.device.type == "cpu" and torch.backends.mkldnn.is_available() and BLOCKING and native()

    def part(self, n: int) -> ChosenLinear | None:
        """The layer of its first n outputs (a view of its weight), to time a huge one."""
        piece = copy.copy(self)
        piece._parameters, piece._buffers = dict(self._parameters), dict(self._buffers)
        piece.weight = torch.nn.Parameter(self.weight.detach()[:n], requires_grad=False)
        if self.bias is not None:
            piece.bias = torch.nn.Parameter(self.bias.detach()[:n], requires_grad=False)
        piece.out_features = n
        for attribute, _ in self.copies.values():
            setattr(piece, attribute, None)
        return piece

    def transposed(self) -> torch.Tensor:
        if self.copy is None:
            self.copy = self.weight.detach().t().contiguous()
        return self.copy

    def blocked_weight(self) -> torch.Tensor:
        if self.blocks is None:
            self.blocks = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BLOCK_ROWS)
        return self.blocks

    def widened(self) -> torch.Tensor:
        if self.wide is None:
            self.wide = self.weight.detach().to(torch.float32)
        return self.wide

    def run(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return KERNELS[name](self, x)

    def pick(self, rows: int) -> str:
        if self.fixed:
            return self.fixed
        i = bisect.bisect_left(ROWS, rows)
        return self.table[i] if i < len(ROWS) else self.prefill

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The product of rows (n, in_features) by the kernel the table names for n rows."""
        return self.run(self.pick(flat.shape[0]), flat)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rows(x.reshape(-1, x.shape[-1]))
        return y.reshape(*x.shape[:-1], self.out_features)

    def shape(self) -> tuple[Any, ...]:
        """Layers of one shape share a table: timed once."""
        return (type(self).__name__, self.out_features, self.in_features, self.weight.dtype, self.bias is not None)


# The kernels that run from a copy of the weight: the layer's attribute that holds it, and what makes it.
WEIGHT_COPIES: dict[str, tuple[str, Callable[[ChosenLinear], torch.Tensor]]] = {
    "xwt": ("copy", ChosenLinear.transposed),
    "dnn": ("blocks", ChosenLinear.blocked_weight),
    "f32": ("wide", ChosenLinear.widened),
}
ChosenLinear.copies = WEIGHT_COPIES


def wrap(model: torch.nn.Module, make: Callable[[torch.nn.Linear], ChosenLinear | None] = ChosenLinear) -> None:
    """Replace every torch Linear of the model (the lm_head too) by what `make` returns, in place
    (None: keep that one)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and (chosen := make(child)) is not None:
                setattr(parent, name, chosen)


def measure(
    model: torch.nn.Module,
    folder: Path | None = None,
    rows: tuple[int, ...] = ROWS,
    step: Callable[[int], Any] | None = None,
) -> dict[str, list[str]]:
    """Time every candidate kernel for each shape of layer at each row count and set the layers'
    tables; with `step` (a whole forward pass of the model over n tokens), judge them in the
    model (judging.tune, then judging.check). Returns the tables by shape (logged, and in
    /metrics). With a `folder`, the tables are kept there under a key of this CPU, this torch, its
    threads and the shapes, and read back by the next load (timing the bundled model takes ~13 s
    here, judging and checking it in the model ~40 s); delete the file to time again (those timed
    beside other work are timed again by a load that finds the machine quiet: `again`)."""
    groups: dict[str, list[ChosenLinear]] = {}
    for m in model.modules():
        if isinstance(m, ChosenLinear):
            groups.setdefault(shape_name(m.shape()), []).append(m)
    counts = (*rows, PREFILL_ROWS)
    path = None if folder is None else folder / f"kernels-{machine_key(sorted(groups), rows)}.json"
    with timing_alone(folder):
        beside = busy.Watch()  # (from the lock on: a process timing before it is not counted)
        kept, cores, retimed = read_tables(path, {name: layers[0] for name, layers in groups.items()}, rows)
        timing_again = kept is not None and not retimed and again(cores)
        if timing_again:
            kept = None
        with torch.inference_mode():
            timed: dict[str, list[dict[str, float]]] = {}
            tables = dict(kept or {})
            for name, layers in groups.items():  # each shape's copies of its weight made, timed, dropped in turn
                if not kept:
                    timed[name] = [timings(sample_of(layers), n) for n in counts]
                    tables[name] = table_of(timed[name], layers[0].copying)
                use(layers, tables[name])
            if step is not None and not kept and groups:
                tables = judging.tune(
                    groups, timed, tables, step, counts, margins(groups), functools.partial(give, groups)
                )
                dense = {name: dense_table(times, groups[name][0].copying) for name, times in timed.items()}
                rival = functools.partial(dense_rival, groups, tables, dense)
                everyone = [*itertools.chain(*groups.values())]
                # (give after each row count: the tables again, without the copies the rival's passes made)
                lost = judging.check(everyone, step, counts, rival, functools.partial(give, groups, tables))
                for i, winner in lost.items():
                    for name, t in tables.items():
                        if winner == "linear":
                            t[i] = "linear"
                        elif t[i] not in KERNELS:  # (the dense rival forced only the quantized kernels)
                            t[i] = dense[name][i]
                give(groups, tables)
        if path is not None and not kept:  # (under the lock: a load waiting on it reads them)
            keep_tables(path, tables, beside.so_far(), timing_again)
    return tables


def again(cores: float) -> bool:
    """Whether kept tables timed beside other processes' `cores` are timed again now: where the
    machine is quiet now (busy.now), else they serve until a load finds it so."""
    if cores <= busy.QUIET_CORES:
        return False
    quiet = (now := busy.now()) is not None and now <= busy.QUIET_CORES
    log.info(RETIMING if quiet else STILL_BUSY, cores, now)
    return quiet


def dense_table(timed: list[dict[str, float]], copying: tuple[str, ...]) -> list[str]:
    """A shape's table among its dense kernels alone (those of KERNELS, not a quantized layer's own
    product): what check() runs against a quantized model's tables."""
    return table_of([{k: t for k, t in median.items() if k in KERNELS} for median in timed], copying)


def dense_rival(
    groups: dict[str, list[ChosenLinear]],
    tables: dict[str, list[str]],
    dense: dict[str, list[str]],
    i: int,
) -> list[tuple[list[ChosenLinear], str]]:
    """At counts[i], the shapes whose table runs a quantized kernel there, each with its fastest
    dense one (none: nothing to check against)."""
    return [(groups[name], dense[name][i]) for name, t in tables.items() if t[i] not in KERNELS]


def margins(groups: dict[str, list[ChosenLinear]]) -> Callable[[str, str, list[str]], float]:
    """judging.tune's margins: a kernel that keeps a copy of the weight (any of the layer's
    `copies`) its shape's table does not keep yet wins by judging.COPY_MARGIN, any other by
    judging.MARGIN."""

    def margin(name: str, kernel: str, table: list[str]) -> float:
        new_copy = kernel in groups[name][0].copies and kernel not in table
        return judging.COPY_MARGIN if new_copy else judging.MARGIN

    return margin


def give(groups: dict[str, list[ChosenLinear]], tables: dict[str, list[str]]) -> None:
    """Every shape's layers their table (use)."""
    for name, layers in groups.items():
        use(layers, tables[name])


@contextlib.contextmanager
def timing_alone(folder: Path | None) -> Any:
    """Hold the kept tables' folder's lock while reading or timing them: two processes loading at
    once on one machine (replicas, a benchmark's servers) would each time their kernels beside the
    other's timings, and keep what the contention chose (seen: three servers starting together on
    2 cores kept `linear` at one row, 84 ms a step against 64). The second waits, then reads what
    the first kept (or times alone, for another model or mode). No folder, or one that cannot be
    locked: no lock."""
    if folder is None:
        yield
        return
    with locks.alone(folder / LOCK_FILE, lambda: log.info(WAITING)):
        yield


def use(layers: list[ChosenLinear], table: list[str]) -> None:
    """Give layers of one shape their table (a kernel per row count, then the prefills'), and the
    weight copies it needs, made now rather than in the first request's step; no others."""
    for layer in layers:
        layer.table, layer.prefill = list(table[:-1]), table[-1]
        for kernel, (attribute, make) in layer.copies.items():
            if kernel in table:
                make(layer)
            else:
                setattr(layer, attribute, None)  # the timings' copy goes: no call will read it


def keep_tables(path: Path, tables: dict[str, list[str]], beside: float | None = None, retimed: bool = False) -> None:
    """Write the tables for the next load, with the cores other processes kept busy while they
    were timed (`beside`: a warning past busy.QUIET_CORES) and whether they were timed again; a
    cache that cannot be written (read-only, full) only means timing again next time. A temporary
    file of this process's own, then a rename: two replicas measuring at once each write whole files."""
    if beside is not None and beside > busy.QUIET_CORES:
        log.warning(TIMED_BESIDE, beside)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({**tables, BESIDE: beside or 0.0, AGAIN: retimed}, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("kernel timings not kept (%s): they are taken again at the next load", e)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def shape_name(shape: tuple[Any, ...]) -> str:
    """`ChosenLinear 896x4864 float32`, `... bias`, `QuantLinear ... int8`: a group's name in the
    log, /metrics.json and the kept file."""
    kind, out, inputs, dtype, bias, *mode = shape
    return " ".join([kind, f"{inputs}x{out}", str(dtype).removeprefix("torch."), *(["bias"] if bias else []), *mode])


def sample_of(layers: list[ChosenLinear]) -> list[ChosenLinear]:
    """Enough layers of a shape to pass SAMPLE_BYTES (weights no cache holds), or all of them;
    of a layer far larger (the output layer: 544 MB in float32), its first rows only."""
    first = layers[0]
    row_bytes = first.in_features * first.weight.element_size()
    if first.out_features * row_bytes > 2 * SAMPLE_BYTES and (piece := first.part(SAMPLE_BYTES // row_bytes)):
        return [piece]
    sample, size = [], 0
    for layer in layers:
        sample.append(layer)
        size += layer.out_features * row_bytes
        if size >= SAMPLE_BYTES:
            break
    return sample


def machine_key(shapes: list[str], rows: tuple[int, ...]) -> str:
    """What the timings depend on: the CPU (its model and flags), torch, its threads, the shapes."""
    try:
        cpu = [
            line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("model name", "flags"))
        ][:2]
    except OSError:
        cpu = [platform.processor(), platform.machine()]
    facts = [*cpu, torch.__version__, str(torch.get_num_threads()), *shapes, str(rows), FORMAT]
    facts += [str(x) for x in (MARGIN, COPY_MARGIN, COPY_ROWS, SAMPLE_BYTES, ROUNDS, sorted(KERNELS))]
    facts += [
        str(x) for x in (judging.CLOSE, judging.TUNE_ROUNDS, judging.CHECK_ROUNDS, judging.MARGIN, judging.COPY_MARGIN)
    ]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def read_tables(
    path: Path | None, groups: dict[str, ChosenLinear], rows: tuple[int, ...]
) -> tuple[dict[str, list[str]] | None, float, bool]:
    """Tables kept by an earlier load, if there is one for every group and each names, at each
    row count, a kernel that group's layers can run there, else None (timed again); the cores
    other processes kept busy while they were timed (0 where the file does not say); and whether
    they were timed again already."""
    try:
        kept = json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError):
        return None, 0.0, False
    if not isinstance(kept, dict):
        return None, 0.0, False
    counts = (*rows, PREFILL_ROWS)
    for name, layer in groups.items():
        table = kept.get(name)
        if not isinstance(table, list) or len(table) != len(counts):
            return None, 0.0, False
        if not all(isinstance(k, str) and k in layer.candidates(n) for k, n in zip(table, counts, strict=True)):
            return None, 0.0, False
    cores = kept.get(BESIDE)
    cores = float(cores) if isinstance(cores, (int, float)) else 0.0
    return {name: kept[name] for name in groups}, cores, kept.get(AGAIN) is True


def timed_table(sample: list[ChosenLinear], rows: tuple[int, ...]) -> list[str]:
    """A shape's table from its own timings alone (table_of), each row count timed once."""
    return table_of([timings(sample, n) for n in (*rows, PREFILL_ROWS)], sample[0].copying)


def table_of(timed: list[dict[str, float]], copying: tuple[str, ...]) -> list[str]:
    """A shape's table: the fastest kernel at each row count, then the prefills', from each count's
    medians. A copy of the weight that the table keeps for some row count costs no more memory at
    the others, so the same timings decide again with that copy at the plain margin (on the Xeon
    with AMX the blocked copy chosen from 64 rows lost the 512-row prefills' band by its margin
    alone, and whole 512-token passes with it took 300 against 325 ms)."""
    copies = frozenset(k for k in (fastest(m, copying=copying) for m in timed) if k in copying)
    return [fastest(median, copies, copying) for median in timed]


def timings(sample: list[ChosenLinear], rows: int) -> dict[str, float]:
    """Each candidate kernel's median seconds at this many rows (`linear` first). Each runs over
    the whole sample once per round, the candidates in turn (so a slow moment of the machine falls
    on all of them), ROUNDS rounds after one to warm up."""
    first = sample[0]
    x = torch.randn(rows, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
    runs = {name: functools.partial(run_all, sample, name, x) for name in first.candidates(rows)}
    return judging.medians(runs, ROUNDS)


def fastest(median: dict[str, float], kept: frozenset[str] = frozenset(), copying: tuple[str, ...] = COPYING) -> str:
    """The kernel to use, from its candidates' median times: `linear` unless another takes at most
    MARGIN of its time (COPY_MARGIN for one that keeps a copy of the weight, `copying`, unless the
    copy is `kept` anyway)."""
    margin = {n: COPY_MARGIN if n in copying and n not in kept else MARGIN for n in median}
    passing = [n for n in median if median[n] <= margin[n] * median["linear"]]
    return min(passing, key=median.__getitem__) if passing else "linear"


def run_all(layers: list[ChosenLinear], name: str, x: torch.Tensor) -> None:
    for layer in layers:
        layer.run(name, x)


def describe(tables: dict[str, list[str]], rows: tuple[int, ...] = ROWS) -> str:
    """One line for the log: the row counts where a shape runs something other than `linear`."""
    parts = []
    for shape, table in tables.items():
        other = [f"{n}:{k}" for n, k in zip((*rows, "prefill"), table, strict=True) if k != "linear"]
        if other:
            parts.append(f"{shape.split(' ', 1)[1]} {','.join(other)}")
    return "; ".join(parts) or "linear at every row count"
