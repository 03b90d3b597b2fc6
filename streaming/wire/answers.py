"""An answer's pieces into what an API sends: text through the stop strings, and tool calls.

`AnswerStream` sits between the generated pieces and a format's stream encoder (apis.StreamEncoder):
with tools offered (and tool_choice not "none") every piece goes through a ToolCallParser
(toolcalls.py) first, its Text events through the request's StopMatcher (stops.py) and on as
text events, its call events on as the format's tool-call events. Without an encoder it only
collects: the whole answer's text and calls, for a non-streaming answer. No I/O.

A stop string is matched in the answer's text, not inside a call's arguments.
tool_choice "required" (or a named tool) is held by a prefill: the answer begins with the
opening of a call, which the model continues (`prefill`); "none" reads no calls.
"""

from __future__ import annotations

import json

from streaming.wire.apis import Call, StreamEncoder
from streaming.wire.stops import StopMatcher
from streaming.wire.toolcalls import CALL_OPEN, CallArgs, CallEnd, CallStart, Event, Text, ToolCallParser
from streaming.wire.tools import Tools


def prefill(choice: str, name: str | None = None) -> str:
    """The answer's beginning that holds a model to a tool choice that requires a call: the
    opening of a call (of the tool `name`), which the model continues. A local engine puts it
    after the prompt; the tool-call reader is fed it first, so the call reads whole."""
    if choice != "required":
        return ""
    return CALL_OPEN + "\n" + (f'{{"name": {json.dumps(name)}, "arguments": ' if name else "")


class AnswerStream:
    def __init__(
        self,
        stops: list[str],
        tools: Tools | None = None,
        enc: StreamEncoder | None = None,
        id_prefix: str = "call_",
        calling: bool | None = None,
        prefill: str = "",
    ) -> None:
        """`calling`: read tool calls (default: if `tools` offers some and tool_choice is not none);
        `prefill`: what the answer began with before the model wrote (its pieces follow on)."""
        self.matcher, self.enc = StopMatcher(stops), enc
        if calling is None:
            calling = tools is not None and bool(tools.specs) and tools.choice != "none"
        self.parser = ToolCallParser(id_prefix) if calling else None
        if self.parser is not None and prefill:
            self.parser.push(prefill)  # (it says nothing yet: a call's start)
        self.parts: list[str] = []  # the text, when collecting a whole answer
        self.calls: list[Call] = []
        self.args: list[list[str]] = []
        # Whitespace after a call is held: only text that is more than whitespace goes out with
        # it, so parallel calls have no "\n" text between them (an empty content, a blank block).
        self.after_call, self.gap = False, ""

    @property
    def matched(self) -> str | None:
        return self.matcher.matched

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def called(self) -> bool:
        """The answer made at least one complete call (its finish reason says tool calls)."""
        return any(c.complete for c in self.calls)

    def push(self, piece: str) -> bytes:
        """A piece of the answer: what to send for it (b"" while it is held)."""
        if self.matched is not None:
            return b""
        if self.parser is None:
            return self.say(self.matcher.push(piece))
        return self.events(self.parser.push(piece))

    def flush(self) -> bytes:
        """At the answer's end: what is still held."""
        out = self.events(self.parser.flush()) if self.parser is not None and self.matched is None else b""
        return out + self.say(self.matcher.flush())

    def say(self, text: str) -> bytes:
        if not text:
            return b""
        self.parts.append(text)
        return self.enc.text(text) if self.enc is not None else b""

    def events(self, events: list[Event]) -> bytes:
        out = []
        for e in events:
            if self.matched is not None:
                break
            if isinstance(e, Text):
                if self.after_call and not e.text.strip():  # between calls ("</tool_call>\n<tool_call>"): held
                    self.gap += e.text
                    continue
                text, self.gap, self.after_call = self.gap + e.text, "", False
                out.append(self.say(self.matcher.push(text)))
                continue
            held = self.matcher.flush()  # text before a call was not a stop string after all
            out.append(self.say(held))
            self.gap, self.after_call = "", isinstance(e, CallEnd)  # (whitespace before a call is dropped)
            if isinstance(e, CallStart):
                self.calls.append(Call(e.id, e.name, "", False))
                self.args.append([])
                out.append(self.enc.call_start(e.index, e.id, e.name) if self.enc else b"")
            elif isinstance(e, CallArgs):
                self.args[e.index].append(e.delta)
                out.append(self.enc.call_args(e.index, e.delta) if self.enc else b"")
            elif isinstance(e, CallEnd):
                arguments = "".join(self.args[e.index]) or "{}"
                self.calls[e.index] = self.calls[e.index]._replace(arguments=arguments, complete=e.complete)
                out.append(self.enc.call_end(e.index) if self.enc else b"")
        return b"".join(out)
