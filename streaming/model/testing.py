"""The two test models, over the real bundled tokenizer, for tests and load experiments.

- `tiny_model`: two layers of seeded random weights in the Qwen2 architecture. The same code
  path as a real model, fast; its text is gibberish.
- `ExactModel`: not a language model but a stand-in whose logits are an exact function of a
  row's own tokens (small integers, the same bits in every dtype and any batch): for the tests of
  batching plumbing, where equal texts must mean equal work.
- `EchoModel` (`echo`): ExactModel, except that in a conversation it answers with the last user
  message's tokens, then ends (<|im_end|>): a scripted answer, for the tests of what a real model
  would write (tool calls in Qwen2.5's syntax, for one), through every engine and format.
"""

from __future__ import annotations

from typing import Any

import torch


def tiny_model(tokenizer: Any, architecture: str = "qwen2") -> torch.nn.Module:
    """Qwen2 architecture (or `llama`: the same shape, no biases on q, k, v), 2 layers, width 64,
    seeded random weights, real vocabulary size."""
    import transformers

    prefix = {"qwen2": "Qwen2", "llama": "Llama"}[architecture]
    config = getattr(transformers, prefix + "Config")(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,  # as Qwen2.5
        # Wide initial weights make peaked next-token distributions, as a trained model has;
        # the default 0.02 gives near-uniform ones, whose nucleus is most of the vocabulary.
        initializer_range=0.5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = getattr(transformers, prefix + "ForCausalLM")(config)
    return m  # type: ignore[no-any-return]


class ExactModel(torch.nn.Module):
    """`exact`: the next token's logits are a function of the row's tokens so far (their sum and
    count), with four candidates at 4, 3, 2 and 1 and the rest at -inf: small integers, exact in
    every dtype, and a row's logits never depend on the other rows of a batch. It keeps a real KV
    cache (one layer; the keys carry the token ids), so the batched engine's slots, joins, leaves
    and kept prefixes run as with a real model: in the engine's steps it reads each row back from
    its slot (`reads_slots`), elsewhere from a plain cache."""

    FIRST, SPAN = 1000, 30000  # candidates among ordinary tokens, which decode to text

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        from transformers import Qwen2Config

        self.config = Qwen2Config(
            vocab_size=len(tokenizer),
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            max_position_embeddings=32768,
        )
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # for .to(dtype) and .dtype

    reads_slots = True  # the batched engine's steps: it reads its rows from their slots itself

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Any = None,
        cache: Any = None,
        past_key_values: Any = None,
        logits_to_keep: Any = None,
        **_: Any,
    ) -> Any:
        cache = cache if cache is not None else past_key_values
        b, n = input_ids.shape
        keys = input_ids.to(torch.float32).view(b, 1, n, 1)  # ids < 2**24: exact in float32
        stored, _ = cache.update(keys, torch.ones_like(keys), 0)
        layout = attention_mask.get("full_attention") if isinstance(attention_mask, dict) else None
        if layout is not None:  # a batched engine's step (generation/kv.py): each kept token's slot up to it
            store = cache.layer(0)[0]
            kept = logits_to_keep.tolist() if isinstance(logits_to_keep, torch.Tensor) else range(n)
            rows = [store[s, 0, : p + 1, 0].to(torch.int64).tolist() for s, p in (layout.tokens[j] for j in kept)]
        else:  # one row or several, its last position: the thread engine, a prefix's prefill
            ids = stored.reshape(b, -1).to(torch.int64)  # (a view of a cache: not contiguous)
            rows = [
                (ids[r][attention_mask[r].bool()] if attention_mask is not None else ids[r]).tolist() for r in range(b)
            ]
        logits = torch.full((len(rows), self.config.vocab_size), float("-inf"), dtype=self.anchor.dtype)
        for r, row in enumerate(rows):
            h = (sum(row) * 1_000_003 + len(row) * 7919) % 1_000_000_007
            for k, value in enumerate((4.0, 3.0, 2.0, 1.0)):
                logits[r, self.FIRST + (h * (k + 3) + k * 104_729) % self.SPAN] = value
        self.script(logits, rows)
        logits = logits.unsqueeze(0) if layout is not None else logits.unsqueeze(1)
        return type("Output", (), {"logits": logits})()

    def script(self, logits: torch.Tensor, rows: list[list[int]]) -> None:
        """Where a subclass may set a row's next token (EchoModel); ExactModel leaves them be."""


class EchoModel(ExactModel):
    """`echo`: after the chat template's `<|im_start|>assistant\n`, the next token is the next one
    of the last user message (its tokens as the prompt has them), then <|im_end|>; anywhere else
    (a plain-text prompt) it is ExactModel."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        ids = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
        self.user, self.assistant = ids("<|im_start|>user\n"), ids("<|im_start|>assistant\n")
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def script(self, logits: torch.Tensor, rows: list[list[int]]) -> None:
        for r, row in enumerate(rows):
            token = self.next_of(row)
            if token is not None:
                logits[r, :] = float("-inf")
                logits[r, token] = 4.0

    def next_of(self, row: list[int]) -> int | None:
        """The scripted next token of a row, or None if the row is no conversation's answer."""
        a = last(row, self.assistant)
        u = last(row[: a if a is not None else 0], self.user)
        if a is None or u is None:
            return None
        start = u + len(self.user)
        script = row[start : start + row[start:].index(self.end)] if self.end in row[start:] else []
        k = len(row) - (a + len(self.assistant))  # tokens of the answer so far
        return script[k] if k < len(script) else self.end


def last(row: list[int], seq: list[int]) -> int | None:
    """Where the last occurrence of `seq` in `row` begins."""
    for i in range(len(row) - len(seq), -1, -1):
        if row[i : i + len(seq)] == seq:
            return i
    return None
