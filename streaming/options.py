"""Command-line option types with their ranges, shared by the brief's scripts (server.py,
proxy.py, client.py, experiments.py): a value out of range is argparse's usage error, which says
the range, never a Python error at run time. No torch here: proxy.py and client.py load none.

Leaves out: the options themselves (each script's parse_args).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, least: float, most: float = math.inf, above: bool = False) -> Callable[[str], float]:
    """An option's type: a `kind` number from `least` (or `above` it) to `most`, finite. A timeout
    of 0 fired at once (nothing was ever answered), a ping of 0 sent keep-alives every turn of the
    loop, a token delay of -1 killed the engine's thread before the server was ready, a port of
    70000 was Python's OverflowError: each is now a usage error that says the range."""

    def parse(value: str) -> float:
        x = kind(value)  # (not a number: argparse says "invalid parse value")
        finite = not isinstance(x, float) or math.isfinite(x)  # (an int of 400 digits: no float, no OverflowError)
        if not (finite and (x > least if above else x >= least) and x <= most):
            bound = f"more than {least}" if above else f"at least {least}"
            most_said = f" and at most {most}" if most < math.inf else ""
            raise argparse.ArgumentTypeError(f"{value!r}: must be {bound}{most_said}, and finite")
        return x

    parse.__name__ = kind.__name__  # (argparse names the type in "invalid int value: 'x'")
    return parse


SECONDS = number(float, 0, above=True)  # timeouts and intervals
PAUSE = number(float, 0)  # delays, graces: 0 is none
COUNT = number(int, 0)  # 0 is none
AT_LEAST_ONE = number(int, 1)  # prompts, tokens, bytes
PORT = number(int, 0, 65535)  # 0: a free one (printed)
PEER_PORT = number(int, 1, 65535)  # a port to connect to
