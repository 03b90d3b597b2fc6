"""Send text, not tokens: the article's `Detokenizer` and the server's `StreamDetokenizer`.

A token is a piece of a byte sequence, not of a string: one character can span several tokens
(the parrot emoji is three with Qwen's tokenizer), and decoding each token alone prints U+FFFD
replacement characters that no later token can repair. Both hold a piece back until its last
character is complete, and `flush()` returns what is still held when generation ends. The
article's decodes everything so far at each step (its cost grows with the text); the server's
steps `tokenizers`' DecodeStream (flat). Their code is the package's
(streaming/generation/detokenize.py, where the engines take them); here they default to the
article's `tok`.
"""

from typing import Any

from lm import tok
from streaming.generation import detokenize
from streaming.generation.detokenize import REPLACEMENT

__all__ = ["REPLACEMENT", "Detokenizer", "StreamDetokenizer"]


class Detokenizer(detokenize.Detokenizer):
    """The article's: decode everything so far, send only the new, complete text."""

    def __init__(self, tokenizer: Any = tok, skip_special_tokens: bool = False) -> None:
        super().__init__(tokenizer, skip_special_tokens)


class StreamDetokenizer(detokenize.StreamDetokenizer):
    """Same output as Detokenizer, at a cost per token that does not grow with the text."""

    def __init__(self, tokenizer: Any = tok, skip_special_tokens: bool = False) -> None:
        super().__init__(tokenizer, skip_special_tokens)
