"""Send text, not tokens: two incremental detokenizers with the same output (detokenizer.py is
their facade, with the article's `tok` as the default tokenizer).

A token is a piece of a byte sequence, not of a string: one character can span several tokens
(the parrot emoji is three with Qwen's tokenizer), and decoding each token alone prints U+FFFD
replacement characters that no later token can repair. Both classes below hold a piece back
until its last character is complete, and `flush()` returns what is still held when generation
ends.

- `Detokenizer`: the article's. It decodes every token so far at each step, so its cost per
  token grows with the length of the text (about 100 us a token at 1,400 tokens here).
- `StreamDetokenizer`: the one the server uses. It steps `tokenizers`' DecodeStream, which
  decodes only a short window of recent tokens, so its cost per token stays flat (about 1 us).

Both assume that decoding a prefix of the tokens gives a prefix of the text, which holds for
byte-level BPE such as Qwen's, not for every tokenizer. Neither strips special tokens unless
asked (skip_special_tokens=True, as the server's jobs ask: a special token is counted, not shown).
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"  # what a decoder prints for bytes that are not (yet) a whole character


class Detokenizer:
    """The article's: decode everything so far, send only the new, complete text."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is safe to send (may be '')."""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        if text.endswith(REPLACEMENT):  # the last character isn't complete yet
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new

    def flush(self) -> str:
        """The text held back at the end (an incomplete character decodes as U+FFFD)."""
        text = self.tok.decode(self.ids, skip_special_tokens=self.skip)
        new, self.sent = text[len(self.sent) :], text
        return new


class StreamDetokenizer:
    """Same output as Detokenizer, at a cost per token that does not grow with the text."""

    CONTEXT = 4  # tokens decoded before the held ones at flush, so a leading space decodes right

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.backend = tokenizer.backend_tokenizer  # the `tokenizers.Tokenizer` under transformers
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.recent: list[int] = []  # the last few ids whose text was sent, then the ids held back
        self.held = 0  # how many ids at the end of `recent` have not been sent yet

    def push(self, token_id: int) -> str:
        """Add a token; return the new text that is safe to send (may be '')."""
        self.recent.append(token_id)
        piece = self.stream.step(self.backend, token_id)
        if piece is None:
            self.held += 1
            return ""
        self.held = 0
        del self.recent[: -self.CONTEXT]  # keeps memory flat: only a short window is ever needed
        return piece

    def flush(self) -> str:
        """The text held back at the end, decoded with a little context before it."""
        if not self.held:
            return ""
        before = self.recent[: -self.held]
        whole = self.tok.decode(self.recent, skip_special_tokens=self.skip)
        sent = self.tok.decode(before, skip_special_tokens=self.skip)
        self.stream = DecodeStream(skip_special_tokens=self.skip)
        self.recent, self.held = [], 0
        return whole[len(sent) :]
