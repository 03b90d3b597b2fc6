"""Tool calls in a stream of text pieces: Qwen2.5's `<tool_call>{json}</tool_call>` into events.

Qwen2.5's chat template, given tools, asks the model to answer a call as
`<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>` (each
tag is one added token that is not special: skip_special_tokens keeps it). `ToolCallParser` is
fed the answer's pieces as they stream and gives back events: `Text` (held back only while it
might be the start of `<tool_call>`, as stops.py holds a stop string), then per call
`CallStart`, `CallArgs` and `CallEnd`. `JsonScanner` is the strict JSON checker it reads a
call with, one character at a time.

Arguments stream. A call starts (CallStart) once its "name" is a complete, non-empty string and
its "arguments" value has begun with `{` (or the object closed with a name and no arguments:
then they are `{}`). From there each piece of the arguments goes out as CallArgs, verbatim: the
model's own text of the arguments object, checked by JsonScanner before it goes, so the deltas
joined are always a prefix of valid JSON, and a whole JSON object once the object closed (what
OpenAI's SDK accumulators and Anthropic's input_json_delta readers json.loads at the end).
Holding each call until it is whole would make every failure plain text, but a long call (code
as an argument) would arrive in one lump after a silence; failures after a call has begun are
rare (a model writes JSON well) and mostly the answer's length running out, which real APIs
also leave as cut arguments.

Failures, never an exception:
- before the call started (not JSON, not an object, no name, a name that is not a non-empty
  string, arguments that are not an object, a name or arguments twice, more than MAX_CALL_CHARS
  held, the answer ending): the call's original characters are Text, and what followed its
  `<tool_call>` is read again (it may hold the real call);
- after it started, the call always ends with CallEnd(index, complete): complete says whether
  its arguments closed (their deltas joined are a whole object). A call ends at `</tool_call>`,
  at a next `<tool_call>` (a model that forgot to close it) or at the answer's end. What breaks
  its JSON, and anything but whitespace after the object's `}`, is dropped up to that end (at
  most MAX_CALL_CHARS of it, then text again), so the rest of a half call never shows up as
  the answer's text.

Leaves out: which tools a request offers (tools.py; the parser does not check names against
them), the APIs' events for calls (openai.py, anthropic.py), other models' formats.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The most characters of a call held before it starts (its name and the start of its arguments
# come first in the template's order, some 50 characters in), and the most dropped after it
# breaks. Bounds what one answer can make the parser keep.
MAX_CALL_CHARS = 4096
MAX_DEPTH = 64  # nesting of the JSON of a call: deeper is broken (and beyond some clients' parsers)
WHITESPACE = " \t\n\r"  # JSON's
DIGITS = "0123456789"


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # 0, 1, 2... in the answer
    id: str  # prefix + 24 hex digits
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    delta: str  # the next characters of the arguments object, as the model wrote them


@dataclass(frozen=True)
class CallEnd:
    index: int
    complete: bool  # the deltas joined are a whole JSON object (False: the call broke or was cut)


Event = Text | CallStart | CallArgs | CallEnd

# What JsonScanner expects next, outside a string, number or literal.
VALUE, FIRST_VALUE, FIRST_KEY, KEY, COLON, NEXT, DONE = range(7)
# A number's states; the ones a number may end in are NUMBER_ENDS.
SIGN, ZERO, INT, DOT, FRAC, EXP, EXP_SIGN, EXP_DIGITS = range(8)
NUMBER_ENDS = (ZERO, INT, FRAC, EXP_DIGITS)
NUMBER_STEPS = {
    (SIGN, "0"): ZERO,
    (ZERO, "."): DOT,
    (INT, "."): DOT,
    **{(s, c): EXP for s in (ZERO, INT, FRAC) for c in "eE"},
    **{(EXP, c): EXP_SIGN for c in "+-"},
    **{(s, d): t for d in DIGITS for s, t in ((DOT, FRAC), (FRAC, FRAC), (EXP, EXP_DIGITS), (EXP_SIGN, EXP_DIGITS))},
    **{(s, d): s2 for d in DIGITS for s, s2 in ((INT, INT), (EXP_DIGITS, EXP_DIGITS))},
    **{(SIGN, d): INT for d in DIGITS[1:]},
}


class JsonScanner:
    """One JSON value (RFC 8259, strictly: no control characters in strings, no NaN), checked a
    character at a time; `feed` says whether the character can continue it. The parser reads
    `depth`, `expect` and `lexeme` around each character to see where members begin and end."""

    def __init__(self, max_depth: int = MAX_DEPTH) -> None:
        self.max_depth = max_depth
        self.stack: list[str] = []  # the open containers, "{" or "["
        self.expect = VALUE
        self.lexeme: str | None = None  # inside a "string", "number" or "literal"
        self.is_key = False  # the string is an object's key
        self.escape = 0  # in a string: 1 after a backslash, 2..5 while \\u's hex digits remain
        self.number = SIGN
        self.literal = ""  # the rest of true, false or null

    @property
    def depth(self) -> int:
        return len(self.stack)

    @property
    def done(self) -> bool:
        return self.expect == DONE

    def feed(self, ch: str) -> bool:
        if self.lexeme == "string":
            return self._string(ch)
        if self.lexeme == "literal":
            if not self.literal.startswith(ch):
                return False
            self.literal = self.literal[1:]
            if not self.literal:
                self._value_done()
            return True
        if self.lexeme == "number":
            step = NUMBER_STEPS.get((self.number, ch))
            if step is not None:
                self.number = step
                return True
            if self.number not in NUMBER_ENDS:
                return False
            self._value_done()  # and ch is read as what follows the number
        return self._structure(ch)

    def _structure(self, ch: str) -> bool:
        e = self.expect
        if ch in WHITESPACE:
            return True  # between tokens, before and after the value
        if e in (VALUE, FIRST_VALUE):
            if e == FIRST_VALUE and ch == "]":
                return self._close("[")
            if ch in "{[":
                if self.depth >= self.max_depth:
                    return False
                self.stack.append(ch)
                self.expect = FIRST_KEY if ch == "{" else FIRST_VALUE
            elif ch == '"':
                self.lexeme, self.is_key = "string", False
            elif ch == "-" or ch in DIGITS:
                self.lexeme, self.number = "number", {"-": SIGN, "0": ZERO}.get(ch, INT)
            elif ch in "tfn":
                self.lexeme, self.literal = "literal", {"t": "rue", "f": "alse", "n": "ull"}[ch]
            else:
                return False
            return True
        if e in (FIRST_KEY, KEY) and ch == '"':
            self.lexeme, self.is_key = "string", True
            return True
        if e == FIRST_KEY and ch == "}":
            return self._close("{")
        if e == COLON and ch == ":":
            self.expect = VALUE
            return True
        if e == NEXT:
            if ch == ",":
                self.expect = KEY if self.stack[-1] == "{" else VALUE
                return True
            if ch in "}]":
                return self._close("{" if ch == "}" else "[")
        return False

    def _string(self, ch: str) -> bool:
        if self.escape == 1:
            if ch == "u":
                self.escape = 5
            elif ch in '"\\/bfnrt':
                self.escape = 0
            else:
                return False
        elif self.escape:
            if ch not in "0123456789abcdefABCDEF":
                return False
            self.escape = 0 if self.escape == 2 else self.escape - 1
        elif ch == "\\":
            self.escape = 1
        elif ch == '"':
            self.lexeme = None
            if self.is_key:
                self.expect = COLON
            else:
                self._value_done()
        elif ord(ch) < 0x20:
            return False
        return True

    def _close(self, opener: str) -> bool:
        if not self.stack or self.stack[-1] != opener:
            return False
        self.stack.pop()
        self._value_done()
        return True

    def _value_done(self) -> None:
        self.lexeme = None
        self.expect = NEXT if self.stack else DONE


def overlap(text: str, tag: str) -> int:
    """How long the longest end of `text` is that begins `tag` (and is shorter than it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


# The parser's modes: answer text, a call's JSON object, between its `}` and `</tool_call>`, and
# the rest of a broken call being dropped.
TEXT, OBJECT, TAIL, DROP = range(4)


def append_merged(events: list[Event], event: Event) -> None:
    """Append, merging text into text and a call's arguments into its last arguments (empty ones
    are dropped)."""
    last = events[-1] if events else None
    if isinstance(event, Text):
        if not event.text:
            return
        if isinstance(last, Text):
            events[-1] = Text(last.text + event.text)
            return
    elif isinstance(event, CallArgs):
        if not event.delta:
            return
        if isinstance(last, CallArgs) and last.index == event.index:
            events[-1] = CallArgs(event.index, last.delta + event.delta)
            return
    events.append(event)


class ToolCallParser:
    """Feed an answer's text pieces (`push`), then `flush` at its end; each gives the events its
    text completes, adjacent ones merged. `id_prefix` starts each call's id ("call_" as OpenAI's,
    "toolu_" as Anthropic's)."""

    def __init__(self, id_prefix: str = "call_") -> None:
        self.id_prefix = id_prefix
        self.mode = TEXT
        self.held = ""  # TEXT: an end that may begin <tool_call>; TAIL, DROP: one that may begin </tool_call>
        self.events: list[Event] = []
        self.calls = 0  # calls started so far: the next one's index
        self.dropped = 0  # DROP: characters dropped so far
        self._new_call()

    def push(self, piece: str) -> list[Event]:
        self._run(piece)
        return self._take()

    def flush(self) -> list[Event]:
        """At the answer's end: held text is text, a call not started fails, a started one ends."""
        while self.mode == OBJECT and not self.started:
            self._run(self._fail())
        if self.mode == TEXT:
            self._emit(Text(self.held))
        elif self.mode in (OBJECT, TAIL):
            self._emit(CallEnd(self.calls - 1, self.args_done))
        self.mode, self.held = TEXT, ""
        return self._take()

    def _run(self, text: str) -> None:
        while text:
            text = (self._text, self._object, self._tail, self._drop)[self.mode](text)

    def _take(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def _emit(self, event: Event) -> None:
        append_merged(self.events, event)

    # --- each mode reads what it can of `text` and returns the rest, for the mode it left in ---

    def _text(self, text: str) -> str:
        s, self.held = self.held + text, ""
        at = s.find(CALL_OPEN)
        if at >= 0:
            self._emit(Text(s[:at]))
            self._begin()
            return s[at + len(CALL_OPEN) :]
        keep = overlap(s, CALL_OPEN)
        self._emit(Text(s[: len(s) - keep]))
        self.held = s[len(s) - keep :]
        return ""

    def _begin(self) -> None:
        self.mode = OBJECT
        self._new_call()

    def _new_call(self) -> None:
        self.json = JsonScanner()
        self.raw = CALL_OPEN  # the call's characters while it has not started: its Text if it fails
        self.started = False
        self.key: str | None = None  # the top-level member whose value comes next
        self.name: str | None = None
        self.capture: str | None = None  # reading the top-level "key", the "name" or the "arguments"
        self.buffer = ""  # the key or name being read
        self.args = ""  # arguments read before the call started
        self.args_seen = self.args_done = False

    def _fail(self) -> str:
        """A call that has not started fails: its tag is text, and the rest is read again."""
        self._emit(Text(CALL_OPEN))  # no end of the tag begins it again, so nothing is missed
        self.mode = TEXT
        return self.raw[len(CALL_OPEN) :]

    def _object(self, text: str) -> str:
        sc = self.json
        for i, ch in enumerate(text):
            if not self.started:
                self.raw += ch
                if len(self.raw) > MAX_CALL_CHARS:
                    return self._fail() + text[i + 1 :]
            depth, expect, lexeme = sc.depth, sc.expect, sc.lexeme
            ok = sc.feed(ch) and (depth > 0 or ch in WHITESPACE or ch == "{")
            if ok:
                ok = self._member(ch, depth, expect, lexeme)
            if not ok:
                if not self.started:
                    return self._fail() + text[i + 1 :]
                return self._break(text[i:])
            if sc.done:
                if not self.started:
                    if self.name is None:
                        return self._fail() + text[i + 1 :]
                    self._start("{}")
                    self.args_done = True
                self.mode = TAIL
                return text[i + 1 :]
        return ""

    def _member(self, ch: str, depth: int, expect: int, lexeme: str | None) -> bool:
        """Follow the top-level members: read keys and the name, pass on the arguments. False
        for a call that cannot be one."""
        if self.capture == "arguments":
            if self.started:
                self._emit(CallArgs(self.calls - 1, ch))
            else:
                self.args += ch
            if self.json.depth == 1:
                self.capture, self.args_done = None, True
        elif self.capture is not None:
            self.buffer += ch
            if self.json.lexeme is None:  # the string closed
                value = json.loads(self.buffer)  # a string that JsonScanner checked
                if self.capture == "key":
                    self.key = value
                elif not value or not _encodable(value):
                    return False
                else:
                    self.name = value
                    if self.args_seen:
                        self._start(self.args)
                self.capture = None
        elif depth == 1 and lexeme is None and not self.started:
            if expect in (FIRST_KEY, KEY) and ch == '"':
                self.capture, self.buffer = "key", ch
            elif expect == VALUE and ch not in WHITESPACE:
                if self.key == "name":
                    if self.name is not None or ch != '"':
                        return False
                    self.capture, self.buffer = "name", ch
                elif self.key == "arguments":
                    if self.args_seen or ch != "{":
                        return False
                    self.capture, self.args_seen = "arguments", True
                    if self.name is not None:
                        self._start(ch)
                    else:
                        self.args = ch
        return True

    def _start(self, args: str) -> None:
        self.started, self.raw = True, ""
        self._emit(CallStart(self.calls, self.id_prefix + secrets.token_hex(12), self.name or ""))
        self._emit(CallArgs(self.calls, args))
        self.calls += 1

    def _break(self, rest: str) -> str:
        """A started call whose JSON broke: it ends here, and its rest is dropped."""
        self._emit(CallEnd(self.calls - 1, self.args_done))
        self.mode, self.held, self.dropped = DROP, "", 0
        return rest

    def _tail(self, text: str) -> str:
        for i, ch in enumerate(text):
            if not self.held and ch in WHITESPACE:
                continue
            self.held += ch
            if self.held in (CALL_CLOSE, CALL_OPEN):
                return self._end(text[i + 1 :])
            if not (CALL_CLOSE.startswith(self.held) or CALL_OPEN.startswith(self.held)):
                held, self.held = self.held, ""
                self._break("")
                return held + text[i + 1 :]  # dropped, but it may end in the start of a tag
        return ""

    def _drop(self, text: str) -> str:
        for i, ch in enumerate(text):
            self.held = (self.held + ch)[-len(CALL_CLOSE) :]
            self.dropped += 1
            if self.held.endswith((CALL_CLOSE, CALL_OPEN)):
                return self._end(text[i + 1 :])
            if self.dropped >= MAX_CALL_CHARS:
                self.mode, self.held = TEXT, ""
                return text[i + 1 :]
        return ""

    def _end(self, rest: str) -> str:
        """At </tool_call>, or at a next <tool_call> that the model opened without closing this one."""
        if self.mode == TAIL:
            self._emit(CallEnd(self.calls - 1, True))
        opened, self.held = self.held.endswith(CALL_OPEN), ""
        if opened:
            self._begin()
        else:
            self.mode = TEXT
        return rest


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
