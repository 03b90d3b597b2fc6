"""Stop strings on a stream of text pieces: hold back what might start one, and stop at one.

No I/O; the /v1/ handler puts every piece through a StopMatcher before it goes out. Leaves out
stop token ids (a stop string is matched on the text, as the APIs define it).
"""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back what is safe to send. Text that could be the start of a stop
    string is held until it cannot be one; at a stop string, `matched` is set and the text before
    it is the last to go out."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.held = list(stops), ""
        self.matched: str | None = None

    def push(self, piece: str) -> str:
        if self.matched is not None:
            return ""
        text = self.held + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, self.matched = min(hits)
            self.held = ""
            return text[:at]
        keep = 0  # the longest end of the text that begins some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    keep = max(keep, k)
                    break
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end without a match: what was held is plain text after all."""
        out, self.held = self.held, ""
        return out if self.matched is None else ""
