"""How many text pieces go out as one event: `--stream-interval N`, and merging that adapts.

    merging = Merging(interval=1, adaptive=True)     # the defaults
    merging.add(piece)
    if merging.wait_for_reader(outlet.behind): ...   # the reader is behind: let it catch up first
    while merging.more() and (piece := ready()):     # pieces that are already waiting
        merging.add(piece)
    if merging.due(): send(merging.take()); merging.sent()

An answer's relay (answer.py) holds the pieces it has here and asks what to do with them:

- The first event of an answer is its first piece, alone and at once: the wait for the first
  text is the one a reader feels most.
- `--stream-interval N` (vLLM's and SGLang's option; per request too, where the format has a
  place for it): every later event carries N pieces. It trades latency for events: text waits
  for the Nth piece (or the end, or the next keep-alive, when the held text goes instead).
- Adaptive merging (`--stream-merge adaptive`, the default) never waits for text: it joins into
  the event only pieces that are *already waiting*, those the job queued while the relay was
  busy (the engine is ahead: a burst from an upstream, several tokens while the loop was
  elsewhere) and those that arrive while the reader's socket is still taking the events before
  (its transport holds more than its low mark: the reader is behind, and the bytes would only
  queue behind those). Up to MERGE_PIECES pieces and MERGE_CHARS characters an event. A reader
  who keeps up gets one event per piece, as before; a slow one the same text in far fewer events
  and bytes, which also reach it sooner.

The text is the same whatever the merging (the relay puts the joined text through the request's
stop strings, which match across pieces), and so are the token counts (they are the job's).
Pure: no clock, no socket, no queue; tests drive it with pieces and a `behind` flag.

Leaves out: the resumable streams (GET /stream, /v1/responses), whose recordings number one event
per piece so that a reader resumes by event number: they are never merged.
"""

from __future__ import annotations

# Pieces one merged event carries at most: 64 pieces (~250 characters of text) are one JSON
# encode and one write instead of 64; past that the per-event cost is already under 2% of the
# text's, and a bigger event is only a bigger frame for the reader to wait on.
MERGE_PIECES = 64
# Characters one merged event carries at most (upstream pieces may be long): a quarter of a stream's
# 16 KiB transport mark (connection.py), so one event, JSON-escaped, never fills it alone.
MERGE_CHARS = 4096
MODES = ("adaptive", "off")  # --stream-merge


class Merging:
    """One answer's pieces on their way into events: see the module's docstring. `interval`:
    pieces a later event carries (1: each its own, unless merging adapts); `adaptive`: join the
    pieces that are already waiting, up to `most` pieces and `chars` characters an event."""

    def __init__(
        self, interval: int = 1, adaptive: bool = True, most: int = MERGE_PIECES, chars: int = MERGE_CHARS
    ) -> None:
        if interval < 1:
            raise ValueError("a stream interval is at least one piece")
        self.interval, self.adaptive, self.chars = interval, adaptive, chars
        self.most = max(interval, most) if adaptive else interval  # pieces an event may carry
        self.held: list[str] = []  # pieces of the next event
        self.held_chars = 0
        self.events = 0  # events sent so far

    @property
    def first(self) -> bool:
        """No event has gone out yet: the next is the first piece, alone."""
        return self.events == 0

    def add(self, piece: str) -> None:
        self.held.append(piece)
        self.held_chars += len(piece)

    def wait_for_reader(self, behind: bool) -> bool:
        """Whether to let the reader's socket take what it was sent before this event goes (the
        pieces that arrive meanwhile join it): only when merging adapts, the reader is behind
        (those bytes would wait anyway), and this is not the first event."""
        return self.adaptive and behind and not self.first and bool(self.held)

    def more(self) -> bool:
        """Whether this event takes one more piece that is already waiting (never the first)."""
        if self.first:
            return False
        return len(self.held) < self.most and self.held_chars < self.chars

    def due(self) -> bool:
        """Whether what is held goes out now (else it waits for the next piece): the first piece,
        a whole interval, or an event at its size cap."""
        if not self.held:
            return False
        return self.first or len(self.held) >= self.interval or self.held_chars >= self.chars

    def take(self) -> str:
        """What is held, as one event's text; holds nothing after."""
        text = "".join(self.held)
        self.held.clear()
        self.held_chars = 0
        return text

    def sent(self) -> None:
        """An event went out (text that the stop strings held back entirely is not one)."""
        self.events += 1
