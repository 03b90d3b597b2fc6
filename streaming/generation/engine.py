"""The step-batched generation engine: one thread, one model, every reader in one batch.

The article's server runs a thread per request, so sixteen readers share the model sixteen ways
and each gets a sixteenth of it. Here one thread owns the model and runs a loop of steps; each
step is one forward pass for every active request at once (a batch of 16 costs far less than 16
batches of one), so every reader gets a token per step. Between steps:

- requests join: a waiting request's prompt is prefilled in chunks of PREFILL_CHUNK tokens, one
  chunk per step, so a long prompt delays the others by a chunk, not by all of it; its last chunk
  samples its first token and its KV cache joins the batch's (left-padded to a common length,
  with an attention mask and each row's own positions);
- the stop flags are checked, once per step, as the article says a batched engine does: a stopped
  or finished row leaves the batch at that step and its rows of the KV cache are dropped;
- at most `max_batch` requests are active; the rest wait in order (the server sends them
  keep-alive pings meanwhile).

Each row samples with its own seeded generator, temperature and top_p (decoding.choose_batch),
and its tokens go through its job's per-token routine (job.py: its own detokenizer, its own
queue). Alone, a request gives the same tokens as with the thread engine; in a batch, its logits
can differ in the last bits (padding changes the shapes of the arithmetic), so a sampled text may
differ: in float32 rarely, in bfloat16 often (the tests state the tolerance).

Leaves out: paged KV memory (a join or leave copies the batch's cache), fusing prefill chunks
into the decode step, --queue's backpressure (a row is never paused for a slow reader: its queue
grows), and the repetition penalty.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import torch

import lm
from decoding import choose_batch
from streaming.generation.job import Job

MAX_BATCH = 64  # active requests per step: past it they wait. 64 rows of 4k tokens is ~6 GB of KV in float32
PREFILL_CHUNK = 128  # prompt tokens prefilled per step: the extra wait a joining prompt adds to others' gaps


class Row:
    """One request inside the engine: its sampler, detokenizer, and place in the batch."""

    def __init__(self, job: BatchedJob) -> None:
        p = job.params
        self.job, self.ids = job, job.ids
        self.g = torch.Generator(device=lm.DEVICE).manual_seed(p.seed)
        self.temperature, self.top_p = p.temperature, p.top_p
        self.cache = None  # its own cache while its prompt is prefilled
        self.filled = 0  # prompt tokens prefilled so far
        self.length = 0  # tokens in its KV cache: the position of the next input
        self.next = None  # the token to feed at the next step
        self.not_before = time.monotonic() + job.settings.first_delay  # testing: --first-delay
        self.done = False


class Engine:
    def __init__(
        self, max_batch: int = MAX_BATCH, prefill_chunk: int = PREFILL_CHUNK, token_delay: float = 0.0, model=None
    ) -> None:
        self.max_batch, self.chunk, self.token_delay = max_batch, prefill_chunk, token_delay
        self.model = model  # None: lm.model(), the process's model
        self.waiting: collections.deque[Row] = collections.deque()  # not yet admitted (from the event loop)
        self.joining: collections.deque[Row] = collections.deque()  # admitted, prompt being prefilled
        self.rows: list[Row] = []  # in the batch, one per row of `cache`
        self.cache: Any = None  # the batch's KV cache (a DynamicCache)
        self.mask: Any = None  # and its attention mask (B, L), a tensor
        self.lock = threading.Condition()
        self.steps = self.tokens = 0
        self.step_seconds = 0.0
        self.thread: threading.Thread | None = None

    # --- from the event loop -------------------------------------------------------------------

    def submit(self, job: BatchedJob) -> None:
        with self.lock:
            self.waiting.append(Row(job))
            if self.thread is None:
                self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)
                self.thread.start()
            self.lock.notify()

    def metrics(self):
        with self.lock:
            return {
                "engine": "batched",
                "max_batch": self.max_batch,
                "active": sum(not r.done for r in self.rows) + len(self.joining),
                "waiting": len(self.waiting),
                "steps": self.steps,
                "tokens_generated": self.tokens,
                "step_seconds": round(self.step_seconds, 3),  # bench.py: mean step time per batch size
            }

    # --- the engine thread ---------------------------------------------------------------------

    def loop(self) -> None:
        while True:
            with self.lock:
                while not (self.rows or self.joining or self.ready()):
                    self.lock.wait(0.05 if self.waiting else None)
                while len(self.rows) + len(self.joining) < self.max_batch and (row := self.admit()):
                    row.job.begin()
                    self.joining.append(row)
            try:
                t0 = time.perf_counter()
                with torch.inference_mode():
                    self.drop_stopped()
                    if self.rows:
                        self.decode()
                    if self.joining:  # after the decode: a row that joins now has its token for this step
                        self.prefill(self.joining[0])
                with self.lock:
                    self.steps += 1
                    self.step_seconds += time.perf_counter() - t0
                if self.token_delay:
                    time.sleep(self.token_delay)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the engine
                for row in list(self.rows) + list(self.joining):
                    self.end(row, error=e)
                self.rows, self.cache, self.mask = [], None, None
                self.joining.clear()

    def ready(self):
        return any(r.not_before <= time.monotonic() for r in self.waiting)

    def admit(self):
        """The next waiting row whose time has come, in order, those with a reader first."""
        now = time.monotonic()
        ready = [r for r in self.waiting if r.not_before <= now]
        if not ready:
            return None
        row = next((r for r in ready if not r.job.orphaned), ready[0])
        self.waiting.remove(row)
        return row

    def drop_stopped(self):
        """The once-per-step check of every stop flag (a waiting row's too: it leaves its place)."""
        with self.lock:
            gone = [row for row in self.waiting if row.job.stop.is_set()]
            for row in gone:
                self.waiting.remove(row)
        for row in gone:
            self.end(row, "stopped")
        for row in list(self.joining):
            if row.job.stop.is_set():
                self.joining.remove(row)
                self.end(row, "stopped")
        if any(row.job.stop.is_set() for row in self.rows):
            for row in self.rows:
                if row.job.stop.is_set():
                    self.end(row, "stopped")
            self.compact()

    def prefill(self, row):
        """One chunk of a joining row's prompt; after its last chunk, its first token, and the row
        joins the batch."""
        m = self.model if self.model is not None else lm.model()
        if row.cache is None:
            from transformers import DynamicCache

            row.cache = DynamicCache(config=m.config)
        part = row.ids[row.filled : row.filled + self.chunk]
        x = torch.tensor([part], device=lm.DEVICE)
        logits = m(input_ids=x, use_cache=True, **lm.forward_kwargs(m, row.cache)).logits[:, -1]
        row.filled += len(part)
        if row.filled < len(row.ids):
            return
        self.joining.popleft()
        row.length = len(row.ids)
        self.emit([row], logits)
        if not row.done:
            self.join(row)
        row.cache = None

    def decode(self):
        """One forward pass for every row in the batch: each feeds its last token."""
        m = self.model if self.model is not None else lm.model()
        rows = self.rows
        x = torch.tensor([[r.next] for r in rows], device=lm.DEVICE)
        positions = torch.tensor([[r.length] for r in rows], device=lm.DEVICE)
        self.mask = torch.cat([self.mask, torch.ones(len(rows), 1, dtype=self.mask.dtype, device=lm.DEVICE)], 1)
        padded = not bool(self.mask.all())
        out = m(
            input_ids=x,
            position_ids=positions,
            attention_mask=self.mask if padded else None,  # None alone: the same arithmetic as the thread engine
            use_cache=True,
            **lm.forward_kwargs(m, self.cache),
        )
        for r in rows:
            r.length += 1
        self.emit(rows, out.logits[:, -1])
        if any(r.done for r in rows):
            self.compact()

    def emit(self, rows, logits):
        """Sample a token for each row and hand it to its job's per-token routine; a row whose job
        ended is marked done."""
        tokens = choose_batch(logits, [r.g for r in rows], [r.temperature for r in rows], [r.top_p for r in rows])
        with self.lock:
            self.tokens += len(rows)
        for row, token in zip(rows, tokens, strict=True):
            row.done = not row.job.take(token)
            row.next = token

    def end(self, row, reason=None, error=None):
        row.done = True
        if error is None:
            row.job.end(reason)
        else:
            row.job.fail(error)

    # --- the batch's KV cache ------------------------------------------------------------------

    def join(self, row):
        """Append a prefilled row to the batch, left-padding its cache or the batch's to one length."""
        new = layers(row.cache)
        n = new[0][0].shape[2]
        if not self.rows:
            self.cache = row.cache
            self.mask = torch.ones(1, n, dtype=torch.long, device=lm.DEVICE)
            self.rows = [row]
            return
        old = layers(self.cache)
        L = old[0][0].shape[2]
        width = max(L, n)
        merged = [
            (torch.cat([pad(k, width), pad(k2, width)]), torch.cat([pad(v, width), pad(v2, width)]))
            for (k, v), (k2, v2) in zip(old, new, strict=True)
        ]
        set_layers(self.cache, merged)
        mask_row = torch.ones(1, n, dtype=self.mask.dtype, device=lm.DEVICE)
        self.mask = torch.cat([pad_mask(self.mask, width), pad_mask(mask_row, width)])
        self.rows.append(row)

    def compact(self):
        """Drop the rows that are done (their KV memory goes with them), then the columns of
        padding every remaining row has."""
        keep = [i for i, r in enumerate(self.rows) if not r.done]
        if not keep:
            self.rows, self.cache, self.mask = [], None, None
            return
        index = torch.tensor(keep, device=lm.DEVICE)
        self.rows = [self.rows[i] for i in keep]
        self.mask = self.mask.index_select(0, index)
        start = int(self.mask.any(0).int().argmax())  # the first column some row uses
        self.mask = self.mask[:, start:]
        set_layers(
            self.cache,
            [
                (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                for k, v in layers(self.cache)
            ],
        )


def layers(cache):
    return [(layer.keys, layer.values) for layer in cache.layers]


def set_layers(cache, kv):
    for layer, (k, v) in zip(cache.layers, kv, strict=True):
        layer.keys, layer.values = k.contiguous(), v.contiguous()


def pad(t, width):
    """Left-pad a (B, H, L, D) tensor with zeros to length `width` (masked out, never attended)."""
    missing = width - t.shape[2]
    return t if missing == 0 else torch.nn.functional.pad(t, (0, 0, missing, 0))


def pad_mask(mask, width):
    missing = width - mask.shape[1]
    return mask if missing == 0 else torch.nn.functional.pad(mask, (missing, 0))


class BatchedJob(Job):
    """A Job that an Engine's thread runs in its batch."""

    def __init__(self, engine: Engine, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.engine = engine

    def start(self) -> BatchedJob:
        super().start()
        self.engine.submit(self)
        return self
