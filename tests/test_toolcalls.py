"""Tool calls in a stream (streaming/wire/toolcalls.py) and a request's tools (tools.py).

Scripted answers split at every place into one, two and three pieces give the same events;
failures end as text (before a call started) or as a call that says it is incomplete; and,
fuzzed with hypothesis, any answer of text and well-formed calls in any split gives back its
text and each call's arguments, and any text at all gives the same events in any split.
"""

import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import lm
from streaming.wire.errors import InvalidRequest
from streaming.wire.toolcalls import (
    CALL_CLOSE,
    CALL_OPEN,
    MAX_CALL_CHARS,
    MAX_DEPTH,
    CallArgs,
    CallEnd,
    CallStart,
    JsonScanner,
    Text,
    ToolCallParser,
)
from streaming.wire.tools import Tools, anthropic_tools, call_arguments, openai_tools

FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ID = re.compile(r"call_[0-9a-f]{24}")


def parse(pieces, prefix="call_"):
    """The events of these pieces, canonical: text merged into text and a call's arguments into
    one delta across pieces, ids checked (unique, the prefix and 24 hex digits) and left out."""
    parser, raw = ToolCallParser(prefix), []
    for piece in pieces:
        raw += parser.push(piece)
    raw += parser.flush()
    out, ids = [], set()
    for e in raw:
        if isinstance(e, CallStart):
            assert re.fullmatch(re.escape(prefix) + "[0-9a-f]{24}", e.id) and e.id not in ids
            ids.add(e.id)
            e = ("start", e.index, e.name)
        elif isinstance(e, Text):
            assert e.text
            if out and out[-1][0] == "text":
                e = ("text", out.pop()[1] + e.text)
            else:
                e = ("text", e.text)
        elif isinstance(e, CallArgs):
            assert e.delta
            if out and out[-1][:2] == ("args", e.index):
                e = ("args", e.index, out.pop()[2] + e.delta)
            else:
                e = ("args", e.index, e.delta)
        else:
            e = ("end", e.index, e.complete)
        out.append(e)
    return out


def splits(text):
    """The text whole, and cut at every place into two pieces and into three."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
        for j in range(i + 1, len(text)):
            yield [text[:i], text[i:j], text[j:]]


def call(name, args, index=0):
    return [("start", index, name), ("args", index, args), ("end", index, True)]


WEATHER = '{"city": "Paris", "unit": "c"}'
CASES = {
    "text only": ("Hello, <world> </tool_call> <tool_ca", [("text", "Hello, <world> </tool_call> <tool_ca")]),
    "one call": (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
        call("get_weather", WEATHER),
    ),
    "text around": (
        f'Let me look.\n<tool_call>\n{{"name": "w", "arguments": {WEATHER}}}\n</tool_call>\nDone.',
        [("text", "Let me look.\n"), *call("w", WEATHER), ("text", "\nDone.")],
    ),
    "two calls": (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        [*call("a", '{"x": 1}'), ("text", "\n"), *call("b", "{}", 1)],
    ),
    "braces and quotes in strings": (
        r'<tool_call>{"name": "run", "arguments": {"code": "if (a) { b(\"}\\\"\"); }", "n": {"m": [1, {"k": []}]}}}</tool_call>',
        call("run", r'{"code": "if (a) { b(\"}\\\"\"); }", "n": {"m": [1, {"k": []}]}}'),
    ),
    "tags in strings": (
        '<tool_call>{"name": "say", "arguments": {"t": "</tool_call><tool_call>"}}</tool_call>',
        call("say", '{"t": "</tool_call><tool_call>"}'),
    ),
    "unicode": (
        '¿Qué? 東京 <tool_call>{"name": "na\\u00efve", "arguments": {"city": "Zürich 🇨🇭", "e": "\\ud83d\\ude00"}}</tool_call> ✓',
        [("text", "¿Qué? 東京 "), *call("naïve", '{"city": "Zürich 🇨🇭", "e": "\\ud83d\\ude00"}'), ("text", " ✓")],
    ),
    "arguments first": (
        '<tool_call>{"arguments": {"a": [true, null, -1.5e+3]}, "name": "f"}</tool_call>',
        call("f", '{"a": [true, null, -1.5e+3]}'),
    ),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', call("now", "{}")),
    "other members": (
        '<tool_call>{"id": 7, "name": "f", "type": ["x"], "arguments": {}, "z": null}</tool_call>',
        call("f", "{}"),
    ),
    "a prefix of the tag, then not": (
        '<tool_ca<tool_call>{"name": "f"}</tool_call>',
        [("text", "<tool_ca"), *call("f", "{}")],
    ),
}
FAILED = [  # calls that never started: their characters are text, exactly
    "<tool_call>\nnot json\n</tool_call>",
    '<tool_call>["name", "f"]</tool_call>',
    '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
    '<tool_call>{"arguments": {}, "arguments": {}, "name": "f"}</tool_call>',
    '<tool_call>{"name": "f", \'arguments\': {}}</tool_call>',
    '<tool_call>{"name": "f\nx", "arguments": {}}</tool_call>',  # a raw newline in a string
    '<tool_call>{"arguments": {"a": 01}, "name": "f"}</tool_call>',  # arguments before the name are held
    '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',  # not a name a tokenizer takes
    '<tool_call>\n{"name": "f", "argu',  # the answer ended
    "<tool_call>",
    "a <tool_call>{}",
]


@pytest.mark.parametrize("name", list(CASES))
def test_answers_in_any_split(name):
    answer, expected = CASES[name]
    for pieces in splits(answer) if len(answer) < 130 else [[answer], list(answer)]:
        assert parse(pieces) == expected, pieces
    for e in expected:
        if e[0] == "args":
            assert isinstance(json.loads(e[2]), dict)


def test_every_answer_also_in_all_three_way_splits_of_the_long_ones():
    for answer, expected in CASES.values():
        if len(answer) >= 130:
            for i in range(1, len(answer), 7):
                for j in range(i + 1, len(answer)):
                    assert parse([answer[:i], answer[i:j], answer[j:]]) == expected


@pytest.mark.parametrize("answer", FAILED)
def test_a_call_that_never_started_is_its_own_text(answer):
    for pieces in splits(answer):
        assert parse(pieces) == [("text", answer)], pieces


def test_a_failed_call_is_read_again_from_its_tag_on():
    answer = 'A <tool_call>{"name": <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    for pieces in splits(answer):
        assert parse(pieces) == [("text", 'A <tool_call>{"name": '), *call("f", "{}")]


def test_text_goes_out_at_once_and_only_a_prefix_of_the_tag_waits():
    p = ToolCallParser()
    assert p.push("Hello <") == [Text("Hello ")]
    assert p.push("tool") == []
    assert p.push("box>") == [Text("<toolbox>")]
    assert p.push("<tool_call>") == []
    assert p.push('{"name": "f"') == []  # the name alone does not start the call
    events = p.push(', "arguments": {"a": ')
    assert isinstance(events[0], CallStart) and events[0].name == "f" and events[0].index == 0
    assert events[1:] == [CallArgs(0, '{"a": ')]
    assert p.push('"x"}') == [CallArgs(0, '"x"}')]
    assert p.push("}\n") == []
    assert p.push("</tool_call>") == [CallEnd(0, True)]
    assert p.push(" end") == [Text(" end")]
    assert p.flush() == []


def test_arguments_stream_as_the_model_writes_them():
    args = json.dumps({"code": "x = {}\n" * 700})
    p, deltas = ToolCallParser(), []
    p.push('<tool_call>\n{"name": "write", "arguments": ')
    for i in range(0, len(args), 5):
        events = [e for e in p.push(args[i : i + 5]) if not (i == 0 and isinstance(e, CallStart))]
        assert len(events) == 1 and isinstance(events[0], CallArgs)  # nothing held back
        deltas += [e.delta for e in events if isinstance(e, CallArgs)]
    assert "".join(deltas) == args and len(args) > MAX_CALL_CHARS  # a started call has no length limit
    assert p.push("}\n</tool_call>") == [CallEnd(0, True)]


def test_a_started_call_that_breaks_ends_incomplete_and_its_rest_is_dropped():
    cases = {
        '<tool_call>{"name": "f", "arguments": {"a": 1 2}}</tool_call>ok': ('{"a": 1 ', "ok"),
        '<tool_call>{"name": "f", "arguments": {"a": "x\ny"}}</tool_call>ok': ('{"a": "x', "ok"),
        '<tool_call>{"name": "f", "arguments": {"a": ]}</tool_call>ok': ('{"a": ', "ok"),
        '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>ok': ('{"a": tru', "ok"),
    }
    for answer, (args, after) in cases.items():
        for pieces in splits(answer):
            assert parse(pieces) == [("start", 0, "f"), ("args", 0, args), ("end", 0, False), ("text", after)]


def test_a_call_cut_by_the_answers_end_says_so():
    assert parse(['<tool_call>{"name": "f", "arguments": {"a": [1, 2']) == [
        ("start", 0, "f"),
        ("args", 0, '{"a": [1, 2'),
        ("end", 0, False),
    ]
    # the arguments closed, the object or the tag did not: the call is whole
    for answer in [
        '<tool_call>{"name": "f", "arguments": {"a": 1}',
        '<tool_call>{"name": "f", "arguments": {}}\n</tool_',
    ]:
        assert parse([answer]) == call("f", '{"a": 1}' if "1" in answer else "{}")


def test_what_follows_the_object_before_the_closing_tag_is_dropped():
    for junk in ["}", "}}", " extra text ", "</tool_cal"]:
        answer = f'<tool_call>\n{{"name": "f", "arguments": {{}}}}{junk}\n</tool_call>after'
        for pieces in splits(answer):
            assert parse(pieces) == [*call("f", "{}"), ("text", "after")], pieces


def test_a_call_left_open_ends_at_the_next_one():
    answer = '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    broken = '<tool_call>{"name": "a", "arguments": {"x": oops <tool_call>{"name": "b", "arguments": {}}</tool_call>'
    for pieces in splits(answer):
        assert parse(pieces) == [*call("a", "{}"), *call("b", "{}", 1)]
    assert parse([broken]) == [("start", 0, "a"), ("args", 0, '{"x": '), ("end", 0, False), *call("b", "{}", 1)]


def test_the_limits():
    # a call not started within MAX_CALL_CHARS is text
    long = CALL_OPEN + '{"pad": "' + "x" * MAX_CALL_CHARS + '", "name": "f", "arguments": {}}' + CALL_CLOSE
    assert parse([long]) == parse(list(long)) == [("text", long)]
    # after a break, at most MAX_CALL_CHARS are dropped
    broken = '<tool_call>{"name": "f", "arguments": {"a": !' + "y" * MAX_CALL_CHARS + "z"
    assert parse([broken])[-1] == ("text", "yz")
    # nesting deeper than MAX_DEPTH breaks the call
    deep = '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}}</tool_call>"
    assert parse([deep]) == [("start", 0, "f"), ("args", 0, '{"a": ' + "[" * (MAX_DEPTH - 2)), ("end", 0, False)]


def test_an_anthropic_id_prefix():
    assert parse(['<tool_call>{"name": "f"}</tool_call>'], prefix="toolu_") == call("f", "{}")


# --- JsonScanner against Python's json ---------------------------------------------------------


def scans(text):
    sc = JsonScanner(max_depth=10**6)
    return all(sc.feed(ch) for ch in text + " ") and sc.done


def loads(text):
    try:
        json.loads(text, parse_constant=lambda _c: 1 / 0)
    except (ValueError, ZeroDivisionError, RecursionError):
        return False
    return True


JSON_BITS = [
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    '"',
    "\\",
    "\\u00e9",
    "\\ud800",
    "tru",
    "e",
    "null",
    "false",
    "-",
    "0",
    "1",
    ".",
    "E",
    "+",
    " ",
    "\n",
    "\t",
    "x",
    "é",
    "\x01",
    "NaN",
    "٣",
]


@given(st.lists(st.sampled_from(JSON_BITS), max_size=16).map("".join))
@FUZZ
def test_the_scanner_accepts_what_json_loads_does(text):
    assert scans(text) == loads(text), text


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
        lambda kids: st.lists(kids) | st.dictionaries(st.text(), kids),
        max_leaves=12,
    )
)
@FUZZ
def test_the_scanner_accepts_every_json_value(value):
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, indent=1)):
        assert scans(text)


# --- any answer, any split ---------------------------------------------------------------------

TEXT_BITS = ["<", ">", "/", "tool_call", "<tool_ca", "</tool_call>", "{", "}", '"', "\n", " ", "é", "字", "hi"]
ARG_TEXT = st.lists(st.sampled_from([*'ab{}[]"\\\n\t:,<>/ é字🙂', CALL_CLOSE, CALL_OPEN]), max_size=6).map("".join)
ARGS = st.dictionaries(
    ARG_TEXT,
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | ARG_TEXT,
        lambda kids: st.lists(kids, max_size=3) | st.dictionaries(ARG_TEXT, kids, max_size=3),
        max_leaves=6,
    ),
    max_size=4,
)


@st.composite
def rendered_call(draw):
    """A well-formed call, written in one of the ways a model might write JSON."""
    name = draw(st.text(alphabet="abcxyz_-0é", min_size=1, max_size=8))
    args = draw(ARGS)
    style = draw(st.sampled_from([{}, {"separators": (",", ":")}, {"indent": 2}, {"ensure_ascii": False}]))
    body = {"arguments": args, "name": name} if draw(st.booleans()) else {"name": name, "arguments": args}
    space = draw(st.sampled_from(["", "\n", " \n  "]))
    return CALL_OPEN + space + json.dumps(body, **style) + space + CALL_CLOSE, name, args


@st.composite
def answer_and_split(draw):
    parts = draw(
        st.lists(st.one_of(st.lists(st.sampled_from(TEXT_BITS), max_size=5).map("".join), rendered_call()), max_size=5)
    )
    texts = "".join(p for p in parts if isinstance(p, str))
    runs = re.split("\x00", "".join(p if isinstance(p, str) else "\x00" for p in parts))
    assume(not any(CALL_OPEN in run for run in runs))
    answer = "".join(p if isinstance(p, str) else p[0] for p in parts)
    calls = [p[1:] for p in parts if not isinstance(p, str)]
    return answer, texts, calls, draw(pieces_of(answer))


def pieces_of(text):
    @st.composite
    def cut(draw):
        how = draw(st.sampled_from(["whole", "chars", "random"]))
        if how == "whole" or not text:
            return [text]
        if how == "chars":
            return list(text)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=10))))
        bounds = [0, *cuts, len(text)]
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    return cut()


@given(answer_and_split())
@FUZZ
def test_any_answer_in_any_split_gives_back_its_text_and_calls(case):
    answer, texts, calls, pieces = case
    assert "".join(pieces) == answer
    events = parse(pieces)
    assert "".join(e[1] for e in events if e[0] == "text") == texts
    starts = [e for e in events if e[0] == "start"]
    assert [s[1] for s in starts] == list(range(len(calls)))
    for (_, i, name), (want_name, want_args) in zip(starts, calls, strict=True):
        args = "".join(e[2] for e in events if e[0] == "args" and e[1] == i)
        assert name == want_name and json.loads(args) == want_args
        assert ("end", i, True) in events


@st.composite
def anything_split(draw):
    bits = [*TEXT_BITS, CALL_OPEN, CALL_CLOSE, '{"name": "f"', ', "arguments": {', '"a": 1', "}", "]", ":", ","]
    text = draw(st.lists(st.one_of(st.sampled_from(bits), st.text(max_size=4)), max_size=14).map("".join))
    return text, draw(pieces_of(text))


@given(anything_split())
@FUZZ
def test_any_text_gives_the_same_events_in_any_split(case):
    text, pieces = case
    events = parse(pieces)
    assert events == parse([text])
    started = [e[1] for e in events if e[0] == "start"]
    assert [e[1] for e in events if e[0] == "end"] == started  # each started call ends, once
    if not started:  # nothing is dropped but a started call's broken rest
        assert "".join(e[1] for e in events) == text
    for i in started:
        args = "".join(e[2] for e in events if e[0] == "args" and e[1] == i)
        if ("end", i, True) in events:
            assert isinstance(json.loads(args), dict)


# --- tools.py ----------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SPEC = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}


def test_openai_and_anthropic_tools_become_the_same_specs():
    openai = openai_tools({"tools": [SPEC]})
    anthropic = anthropic_tools({"tools": [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}]})
    assert openai == anthropic == Tools([SPEC], "auto")
    assert openai_tools({}) == anthropic_tools({"tools": None}) == Tools([], "none")
    bare = openai_tools({"tools": [{"type": "function", "function": {"name": "now"}}]})
    assert bare.specs == [{"type": "function", "function": {"name": "now"}}] and bare.names == ["now"]


def test_tool_choices():
    tools = {"tools": [SPEC]}
    for choice, want in [
        ("auto", ("auto", None)),
        ("none", ("none", None)),
        ("required", ("required", None)),
        ({"type": "function", "function": {"name": "get_weather"}}, ("required", "get_weather")),
    ]:
        t = openai_tools({**tools, "tool_choice": choice})
        assert (t.choice, t.name, t.parallel) == (*want, True)
    assert not openai_tools({**tools, "parallel_tool_calls": False}).parallel
    atools = {"tools": [{"name": "get_weather", "input_schema": SCHEMA}]}
    for choice, want in [
        ({"type": "auto"}, ("auto", None, True)),
        ({"type": "none"}, ("none", None, True)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", None, False)),
        ({"type": "tool", "name": "get_weather"}, ("required", "get_weather", True)),
    ]:
        t = anthropic_tools({**atools, "tool_choice": choice})
        assert (t.choice, t.name, t.parallel) == want


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": {}}, "tools"),
        ({"tools": [SPEC] * 129}, "tools"),
        ({"tools": ["f"]}, "tools[0]"),
        ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]},
            "tools[0].function.description",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]}, "tools[0].function"),
        ({"tools": [SPEC, SPEC]}, "tools"),
        ({"tools": [SPEC], "tool_choice": "always"}, "tool_choice"),
        ({"tools": [SPEC], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": [SPEC], "tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [SPEC], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_openai_tools(body, param):
    with pytest.raises(InvalidRequest) as e:
        openai_tools(body)
    assert e.value.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"name": "f", "input_schema": SCHEMA}, {"input_schema": SCHEMA}]}, "tools.1.name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": "auto"}, "tool_choice.type"),
        ({"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        (
            {"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "g"}},
            "tool_choice.name",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        (
            {
                "tools": [{"name": "f", "input_schema": SCHEMA}],
                "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1},
            },
            "tool_choice.disable_parallel_tool_use",
        ),
    ],
)
def test_bad_anthropic_tools(body, param):
    with pytest.raises(InvalidRequest) as e:
        anthropic_tools(body)
    assert e.value.param == param


def test_call_arguments():
    assert call_arguments('{"a": 1}', "p") == call_arguments({"a": 1}, "p") == {"a": 1}
    for bad in ["[1]", "{", 3, None]:
        with pytest.raises(InvalidRequest):
            call_arguments(bad, "messages[1].tool_calls[0].function.arguments")


def test_the_chat_template_asks_for_the_format_the_parser_reads():
    """The bundled tokenizer's template: our specs printed one per line, the call format asked
    for, and an assistant's call given back as the parser reads it."""
    tools = openai_tools({"tools": [SPEC]}).specs
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = lm.tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert f"<tools>\n{json.dumps(SPEC, ensure_ascii=False)}\n</tools>" in prompt
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    arguments = call_arguments('{"city": "Paris"}', "arguments")
    back = [
        *messages,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": arguments}}],
        },
        {"role": "tool", "content": "20 °C"},
    ]
    prompt = lm.tok.apply_chat_template(back, tools=tools, tokenize=False, add_generation_prompt=True)
    said = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse([said]) == call("get_weather", '{"city": "Paris"}')
    assert "<|im_start|>user\n<tool_response>\n20 °C\n</tool_response><|im_end|>" in prompt
