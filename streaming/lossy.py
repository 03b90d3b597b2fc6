"""Standard output and error that a server can outlive: once the reader of its log goes away (a
supervisor restarted, a benchmark killed, `server.py | head`), writes are dropped instead of
raising BrokenPipeError in whichever request's handler logged a line next, or in the exit's
"shut down" (seen on a lent GPU: a benchmark stopped at its time limit left tracebacks in every
server it had started).

Leaves out: where logs go (stdout and stderr, as the article's server prints them).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, TextIO


class Lossy:
    """A text stream that drops what it cannot write once its file is gone."""

    def __init__(self, stream: TextIO) -> None:
        self.stream, self.gone = stream, False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except (BrokenPipeError, ValueError) as e:
                self.lose_or_raise(e)
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (BrokenPipeError, ValueError) as e:
                self.lose_or_raise(e)

    def lose_or_raise(self, e: Exception) -> None:
        """A closed pipe, or the stream closed (ValueError): lose it. Any other ValueError (a line
        its encoding cannot say: UnicodeEncodeError) is the writer's, and its reader is still there."""
        if isinstance(e, BrokenPipeError) or getattr(self.stream, "closed", False):
            self.lose()
        else:
            raise e

    def lose(self) -> None:
        """From now on, drop: the file descriptor points at /dev/null, so that what the stream
        still holds in its buffer goes there at the exit's flush instead of raising again."""
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding...: the stream's own
        return getattr(self.stream, name)


def outlive_readers() -> None:
    """Make sys.stdout and sys.stderr Lossy (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, Lossy):
            setattr(sys, name, Lossy(stream))
