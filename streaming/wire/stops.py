"""Stop strings on a stream of text pieces: hold back what might start one, and stop at one.

No I/O; the /v1/ handler puts every piece through a StopMatcher before it goes out. How much to
hold is found as the text comes (Knuth-Morris-Pratt's automaton, one per stop string): each
character costs a step or two, where trying every length of every stop string at every piece
cost up to 4 x 1,000 slices a token for 4 stop strings of 1,000 characters (apis.MAX_STOP_CHARS).
Leaves out stop token ids (a stop string is matched on the text, as the APIs define it).
"""

from __future__ import annotations


class Partial:
    """How long an end of the text fed so far begins `stop` (the longest, short of all of it)."""

    def __init__(self, stop: str) -> None:
        self.stop, self.state = stop, 0
        # fail[i]: the longest proper prefix of stop[: i + 1] that is also its suffix
        self.fail = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.fail[i] = k

    def feed(self, text: str) -> int:
        s, k, fail = self.stop, self.state, self.fail
        for c in text:
            if k == len(s):  # (a whole match: the matcher found it first; go on as past it)
                k = fail[k - 1]
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
        self.state = k
        return k if k < len(s) else fail[k - 1]


class StopMatcher:
    """Feed text pieces; get back what is safe to send. Text that could be the start of a stop
    string is held until it cannot be one; at a stop string, `matched` is set and the text before
    it is the last to go out."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = list(stops), ""
        self.partials = [Partial(s) for s in self.stops]
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        text = self.held + piece  # (held is at most the longest stop string: find is bounded)
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.matched = min(hits)
            self.held = ""
            return text[:at]
        keep = max((p.feed(piece) for p in self.partials), default=0)  # the longest end that begins one
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end without a match: what was held is plain text after all."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""
