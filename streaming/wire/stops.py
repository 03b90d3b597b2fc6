"""Stop strings on a stream of text pieces: hold back what might start one, and stop at one.

No I/O; the /v1/ handler puts every piece through a StopMatcher before it goes out. Each stop
string is followed through the text as it comes by Knuth-Morris-Pratt's automaton: each
character costs a step or two, and the automaton says both where a stop string first ends and
how long an end of the text begins one (what to hold). Trying every length of every stop string
at every piece cost up to 4 x 1,000 slices a token for 4 stop strings of 1,000 characters
(apis.MAX_STOP_CHARS). Leaves out stop token ids (a stop string is matched on the text, as the
APIs define it).
"""

from __future__ import annotations


class Partial:
    """One stop string followed through the text: `state` is how long an end of the text fed so
    far begins it (the longest)."""

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

    def feed(self, text: str) -> int | None:
        """Follow `text`; where in it the stop string first ends (the index after its last
        character), or None (then `state` says how much of it the text's end holds)."""
        s, k, fail = self.stop, self.state, self.fail
        for i, c in enumerate(text):
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
                if k == len(s):
                    return i + 1
        self.state = k
        return None


class StopMatcher:
    """Feed text pieces; get back what is safe to send. Text that could be the start of a stop
    string is held until it cannot be one; at a stop string, `matched` is set and the text before
    it is the last to go out (of two in one piece, the one that begins first)."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = [s for s in stops if s], ""  # (an empty one: the APIs refuse it)
        self.partials = [Partial(s) for s in self.stops]
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        text = self.held + piece
        ends = [(end, p.stop) for p in self.partials if (end := p.feed(piece)) is not None]
        if ends:  # each began in what was held or in this piece: at len(held) + end - len(stop) of text
            at, self.matched = min((len(self.held) + end - len(stop), stop) for end, stop in ends)
            self.held = ""
            return text[:at]
        keep = max((p.state for p in self.partials), default=0)  # the longest end that begins one
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """What was held is plain text after all (at the end without a match, or before a tool
        call, after which the text starts anew)."""
        out, self.held = self.held, ""
        for p in self.partials:
            p.state = 0
        return out if self.matched is None else ""
