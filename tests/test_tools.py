"""Tool calls end to end, judged by the SDKs' own accumulators: the `echo` model answers with the
user's message, so a message in Qwen2.5's tool-call syntax is an answer that calls a tool,
through the real engine, the chat template and the parser (tests/test_toolcalls.py drives the
parser alone). OpenAI's tool_calls deltas, Anthropic's tool_use blocks with input_json_delta,
the Responses API's function_call items; the call's result back in the next turn; malformed
calls stay text; tool_choice none reads no calls."""

import json

import anthropic
import httpx
import openai
import pytest
from helpers import events

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]


def call(city):
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


SAY = "Let me look." + call("Paris")
TWO = "Both." + call("Paris") + "\n" + call("Rome")


def oa(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def an(port):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="unused", max_retries=0)


def test_openai_whole_and_streamed_calls_through_the_sdk(servers):
    client = oa(servers["echo"].port)
    messages = [{"role": "user", "content": SAY}]
    whole = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=80)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (c,) = choice.message.tool_calls
    assert c.id.startswith("call_") and c.function.name == "get_weather"
    assert json.loads(c.function.arguments) == {"city": "Paris"}
    with client.chat.completions.stream(model="m", messages=messages, tools=TOOLS, max_tokens=80) as s:
        chunks = list(s)
        final = s.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls" and final.choices[0].message.content == "Let me look."
    assert json.loads(final.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}
    deltas = [e for e in chunks if e.type == "tool_calls.function.arguments.delta"]
    assert len(deltas) > 1  # the arguments streamed, in pieces


def test_openai_raw_chunks_have_the_call_first_then_its_arguments_and_two_calls_two_indexes(servers):
    port = servers["echo"].port
    body = {"messages": [{"role": "user", "content": TWO}], "tools": TOOLS, "max_tokens": 120, "stream": True}
    evs = events(httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).content)
    chunks = [json.loads(e.data) for e in evs if e.data != "[DONE]"]
    calls = [d["tool_calls"][0] for ch in chunks for d in [ch["choices"][0]["delta"]] if "tool_calls" in d]
    starts = [c for c in calls if "id" in c]
    assert [c["index"] for c in starts] == [0, 1] and all(c["function"]["arguments"] == "" for c in starts)
    for i, city in enumerate(["Paris", "Rome"]):
        args = "".join(c["function"]["arguments"] for c in calls if c["index"] == i)
        assert json.loads(args) == {"city": city}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)


def test_the_calls_result_goes_back_in_the_next_turn(servers):
    client = oa(servers["echo"].port)
    first = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": SAY}], tools=TOOLS, max_tokens=80
    ).choices[0]
    messages = [
        {"role": "user", "content": SAY},
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": first.message.tool_calls[0].id, "content": "20 C"},
        {"role": "user", "content": "Thanks, and Rome?"},
    ]
    again = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=40)
    assert again.choices[0].message.content == "Thanks, and Rome?" and again.choices[0].finish_reason == "stop"


def test_anthropic_tool_use_blocks_and_input_json_deltas(servers):
    client = an(servers["echo"].port)
    messages = [{"role": "user", "content": TWO}]
    with client.messages.stream(model="m", max_tokens=120, messages=messages, tools=ANTHROPIC_TOOLS) as s:
        evs = list(s)
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]  # (no blank block between calls)
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}, {"city": "Rome"}]
    assert all(b.id.startswith("toolu_") for b in final.content if b.type == "tool_use")
    starts = [e.index for e in evs if e.type == "content_block_start"]
    stops = [e.index for e in evs if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in evs)
    whole = client.messages.create(model="m", max_tokens=120, messages=messages, tools=ANTHROPIC_TOOLS)

    def texts_and_calls(blocks):  # (a whole message has its text in one block, first)
        return "".join(b.text for b in blocks if b.type == "text"), [b.input for b in blocks if b.type == "tool_use"]

    assert (
        texts_and_calls(whole.content)
        == texts_and_calls(final.content)
        == ("Both.", [{"city": "Paris"}, {"city": "Rome"}])
    )
    turn = [
        *messages,
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": whole.content[1].id, "content": "20 C"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]
    after = client.messages.create(model="m", max_tokens=20, messages=turn, tools=ANTHROPIC_TOOLS)
    assert after.content[0].text == "Thanks" and after.stop_reason == "end_turn"


def test_responses_function_call_items_streamed_and_whole(servers):
    client = oa(servers["echo"].port)
    with client.responses.stream(model="m", input=SAY, tools=RESPONSES_TOOLS, max_output_tokens=80) as s:
        evs = list(s)
        final = s.get_final_response()
    assert final.status == "completed" and [o.type for o in final.output] == ["message", "function_call"]
    added = [e for e in evs if e.type in ("response.output_item.added", "response.output_item.done")]
    assert [(e.type.rsplit(".", 1)[1], e.output_index) for e in added] == [
        ("added", 0),
        ("done", 0),
        ("added", 1),
        ("done", 1),
    ]
    fc = final.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id.startswith("call_")
    types = [e.type for e in evs]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert final.tools[0].name == "get_weather"  # echoed, as OpenAI does
    whole = client.responses.create(model="m", input=SAY, tools=RESPONSES_TOOLS, max_output_tokens=80)
    assert [(o.type, getattr(o, "arguments", None)) for o in whole.output] == [
        ("message", None),
        ("function_call", fc.arguments),
    ]
    back = [
        {"role": "user", "content": SAY},
        {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "20 C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert client.responses.create(model="m", input=back, tools=RESPONSES_TOOLS).output_text == "Thanks"


@pytest.mark.parametrize(
    "say",
    [
        '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments not an object
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "get_weather", "argu',  # cut before it started
    ],
)
def test_a_malformed_call_stays_text(servers, say):
    r = oa(servers["echo"].port).chat.completions.create(
        model="m", messages=[{"role": "user", "content": say}], tools=TOOLS, max_tokens=80
    )
    assert r.choices[0].message.content == say and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_reads_no_calls_and_no_tools_none_either(servers):
    client = oa(servers["echo"].port)
    messages = [{"role": "user", "content": SAY}]
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=80, **kw)
        assert r.choices[0].message.content == SAY and not r.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"tools": [{"type": "function", "function": {"name": "bad name"}}]},
            "tools[0].function.name",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("/v1/chat/completions", {"tools": "x"}, "tools"),
        ("/v1/responses", {"tools": [{"type": "web_search"}]}, "tools[0]"),
    ],
)
def test_bad_tools_are_a_400_naming_the_param(servers, path, body, param):
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"input": "hi"}
    r = httpx.post(f"http://127.0.0.1:{servers['echo'].port}{path}", json={**base, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param

    with pytest.raises(anthropic.BadRequestError):
        an(servers["echo"].port).messages.create(
            model="m", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=[{"name": "x"}]
        )


@pytest.fixture(scope="module")
def front(servers):
    """--engine upstream in front of the echo server: its calls arrive as tool_calls deltas."""
    from helpers import ServerProcess

    upstream = f"http://127.0.0.1:{servers['echo'].port}/v1"
    with ServerProcess("--engine", "upstream", "--upstream", upstream) as s:
        yield s.wait()


def test_an_upstreams_calls_are_relayed_in_the_readers_format(front):
    messages = [{"role": "user", "content": TWO}]
    with an(front.port).messages.stream(model="m", max_tokens=120, messages=messages, tools=ANTHROPIC_TOOLS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.input for b in final.content if b.type == "tool_use"] == [{"city": "Paris"}, {"city": "Rome"}]
    r = oa(front.port).chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=120)
    assert [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        {"city": "Paris"},
        {"city": "Rome"},
    ]
    assert r.choices[0].message.content == "Both." and r.choices[0].finish_reason == "tool_calls"
    with oa(front.port).responses.stream(model="m", input=SAY, tools=RESPONSES_TOOLS, max_output_tokens=80) as s:
        out = s.get_final_response().output
    assert [o.type for o in out] == ["message", "function_call"] and json.loads(out[1].arguments) == {"city": "Paris"}


def test_a_required_call_is_held_by_a_prefill_that_the_reader_continues():
    """tool_choice required (or a named tool): the answer begins with a call's opening, which the
    model continues; the reader is fed it first, so what the model writes reads as the call."""
    from streaming.wire.answers import AnswerStream, prefill
    from streaming.wire.tools import openai_tools

    named = openai_tools({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    start = prefill(named.choice, named.name)
    assert start == '<tool_call>\n{"name": "get_weather", "arguments": '
    out = AnswerStream([], named, prefill=start)
    for piece in ['{"ci', 'ty": "Rome"}', "}\n</tool", "_call>"]:  # what the model writes after it
        out.push(piece)
    out.flush()
    assert out.text == "" and [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Rome"})
    ]
    assert prefill("required") == "<tool_call>\n" and prefill("auto") == ""


def test_tool_choice_required_through_the_server(servers):
    """The echo model continues the prefill with the rest of the user's message: the call."""
    r = oa(servers["echo"].port).chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": call("Oslo")}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=80,
    )
    (c,) = r.choices[0].message.tool_calls
    assert json.loads(c.function.arguments) == {"city": "Oslo"} and r.choices[0].finish_reason == "tool_calls"
    assert r.usage.completion_tokens < len(call("Oslo"))  # (the prefill's tokens are the prompt's)


def test_an_anthropic_answer_that_begins_with_a_call_has_no_empty_text_block(servers):
    """A forced call (tool_choice any) begins the answer: its stream opened an empty text block 0
    first, which the whole answer did not have and the real API refuses when sent back."""
    client = an(servers["echo"].port)
    body = {"model": "m", "max_tokens": 80, "messages": [{"role": "user", "content": call("Oslo")}]}
    body.update(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    with client.messages.stream(**body) as s:
        evs = list(s)
        final = s.get_final_message()
    whole = client.messages.create(**body)
    assert [b.type for b in final.content] == [b.type for b in whole.content] == ["tool_use"], final.content
    assert final.content[0].input == whole.content[0].input == {"city": "Oslo"}
    assert [e.index for e in evs if e.type == "content_block_start"] == [0]


def test_an_upstreams_call_deltas_become_the_text_the_reader_reads_back():
    """CallsAsText (the relay's): OpenAI tool_calls deltas in any split, as Qwen's syntax, read
    back by the answer reader as the same calls; text between calls stays text."""
    from streaming.wire.answers import AnswerStream
    from streaming.wire.openai import CallsAsText, read_chunk
    from streaming.wire.tools import openai_tools

    def chunk(delta):
        return read_chunk(json.dumps({"choices": [{"index": 0, "delta": delta}]}))

    def call_delta(i, name=None, args=""):
        return {
            "tool_calls": [{"index": i, "function": {"name": name, "arguments": args} if name else {"arguments": args}}]
        }

    deltas = [
        {"content": "Both."},
        call_delta(0, "get_weather", ""),
        call_delta(0, args='{"city": '),
        call_delta(0, args='"Paris"}'),
        {"content": " and "},
        call_delta(1, "get_weather", '{"city": "Rome"}'),
        call_delta(2, "noop"),  # a call without arguments
    ]
    relay, out = CallsAsText(), AnswerStream([], openai_tools({"tools": TOOLS}))
    for d in deltas:
        out.push(relay.text(chunk(d)))
    out.push(relay.close())
    out.flush()
    assert out.text == "Both. and "
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
        ("noop", {}),
    ]


def test_whitespace_between_calls_is_no_text_but_text_after_a_call_is():
    from streaming.wire.answers import AnswerStream
    from streaming.wire.tools import openai_tools

    out = AnswerStream([], openai_tools({"tools": TOOLS}))
    for piece in [call("Paris"), "\n", call("Rome"), "\n\nDone", " now.\n"]:
        out.push(piece)
    out.flush()
    assert [json.loads(c.arguments)["city"] for c in out.calls] == ["Paris", "Rome"] and out.text == "\n\nDone now.\n"
    tail = AnswerStream([], openai_tools({"tools": TOOLS}))
    tail.push(call("Oslo") + "\n")
    tail.flush()
    assert tail.text == "" and len(tail.calls) == 1  # whitespace at the end is no text either
