"""The Responses API (/v1/responses) and text completions (/v1/completions), judged by the
official OpenAI SDK: event types and numbers, the same text whole and streamed, usage, resuming
by starting_after and by Last-Event-ID, cancel, errors in OpenAI's shape before the head and as
events after it. (Across replicas and after a SIGKILL: tests/test_replicas.py.)"""

import json

import httpx
import openai
import pytest
from helpers import events, http, metrics

from streaming.wire.responses import Responses, ResponsesStream

INPUT = "Tell me about lighthouses."
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def oa(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


def create(port, n=12, **kw):
    return oa(port).responses.create(model="m", input=INPUT, max_output_tokens=n, extra_body={"seed": 3}, **kw)


def test_whole_and_streamed_give_the_same_text_usage_and_event_sequence(servers):
    port = servers["plain"].port
    whole = create(port)
    assert whole.object == "response" and whole.status == "incomplete" and whole.id.startswith("resp_")
    assert whole.incomplete_details.reason == "max_output_tokens" and whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12 and whole.usage.input_tokens > 5
    evs = list(create(port, stream=True))
    types = [e.type for e in evs]
    assert types[:4] == OPENING and types[-4:] == [*CLOSING, "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    text = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    assert text == whole.output_text == evs[-4].text == evs[-1].response.output_text
    assert evs[-1].response.usage.output_tokens == 12 and evs[-1].response.id == evs[0].response.id
    assert evs[-2].item.status == "incomplete" and evs[-2].item.content[0].text == text


def test_each_event_carries_an_sse_id_naming_its_number(servers):
    port = servers["plain"].port
    body = {"input": INPUT, "max_output_tokens": 5, "stream": True}
    raw = httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=60)
    evs = events(raw.content)
    stream = json.loads(evs[0].data)["response"]["id"].removeprefix("resp_")
    assert [e.id for e in evs] == [f"{stream}.{k}" for k in range(len(evs))]
    assert all(e.event == json.loads(e.data)["type"] for e in evs)  # the SSE event name is the type
    assert evs[0].retry == 1000 and "[DONE]" not in raw.text  # (no [DONE] in this API)


def test_the_sdk_resumes_after_a_sequence_number(servers):
    port = servers["resuming"].port
    evs = list(create(port, n=20, stream=True))
    with oa(port).responses.stream(response_id=evs[0].response.id, starting_after=6) as s:
        rest = list(s)
    assert [e.sequence_number for e in rest] == list(range(7, len(evs)))
    assert [e.type for e in rest] == [e.type for e in evs[7:]]
    assert [getattr(e, "delta", None) for e in rest] == [getattr(e, "delta", None) for e in evs[7:]]


def test_a_dropped_stream_is_read_whole_with_last_event_id(servers):
    """The "dropping" server cuts the connection every 8 events: each reconnect with
    Last-Event-ID gets the next ones, none twice, and together they are the whole answer."""
    port = servers["dropping"].port
    body = {"input": INPUT, "max_output_tokens": 30, "seed": 3, "stream": True}
    status, _, first = http(port, "POST", "/v1/responses", body)
    got = events(first)
    assert status == 200 and len(got) == 8
    response_id = json.loads(got[0].data)["response"]["id"]
    for _ in range(20):
        if got[-1].event in ("response.completed", "response.incomplete"):
            break
        headers = [("Last-Event-ID", got[-1].id)]
        status, _, more = http(port, "GET", f"/v1/responses/{response_id}?stream=true", headers=headers)
        assert status == 200
        got += events(more)
    numbers = [json.loads(e.data)["sequence_number"] for e in got]
    assert numbers == list(range(len(got))) and got[-1].event == "response.incomplete"
    whole = create(servers["plain"].port, n=30)
    assert "".join(json.loads(e.data).get("delta", "") for e in got if e.event.endswith(".delta")) == whole.output_text


def test_cancel_stops_generation_and_the_stream_ends_cancelled(servers):
    port = servers["slow"].port  # 20 ms a token
    client = oa(port)
    stream = client.responses.create(model="m", input=INPUT, max_output_tokens=400, stream=True)
    seen = []
    for e in stream:
        seen.append(e)
        if len(seen) == 8:
            cancelled = client.responses.cancel(seen[0].response.id)
            assert cancelled.status == "cancelled" and cancelled.id == seen[0].response.id
    assert seen[-1].type == "response.incomplete" and seen[-1].response.status == "cancelled"
    assert seen[-1].response.usage.output_tokens < 100
    assert metrics(port)["active_generations"] == 0
    with pytest.raises(openai.BadRequestError, match="already over"):  # (it was "cancelled" again, ended or not)
        client.responses.cancel(seen[0].response.id)


def test_errors_come_in_openais_shape(servers):
    port = servers["plain"].port
    url = f"http://127.0.0.1:{port}/v1/responses"
    cases = [
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"input": "hi", "previous_response_id": "resp_x"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        oa(port).responses.create(model="m", input="hi", previous_response_id="resp_1")
    get = httpx.get(f"{url}/resp_nope", timeout=30)
    assert get.status_code == 400 and get.json()["error"]["param"] == "stream"  # no stored responses
    assert httpx.get(f"{url}/resp_nope?stream=true", timeout=30).status_code == 404
    assert httpx.get(f"{url}/resp_x?stream=true&starting_after=a", timeout=30).status_code == 400
    with pytest.raises(openai.NotFoundError):
        oa(port).responses.cancel("resp_nope")


def test_a_failure_after_the_head_is_an_error_event_then_response_failed(servers):
    port = servers["failing"].port  # fails after 5 tokens
    body = {"input": INPUT, "max_output_tokens": 40, "stream": True}
    evs = events(httpx.post(f"http://127.0.0.1:{port}/v1/responses", json=body, timeout=60).content)
    assert [e.event for e in evs[-2:]] == ["error", "response.failed"]
    failed = json.loads(evs[-1].data)["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    with pytest.raises(openai.APIError):
        list(oa(port).responses.create(model="m", input=INPUT, max_output_tokens=40, stream=True))


def test_a_stream_taken_over_goes_on_with_the_next_number_and_its_text():
    """What a replica that takes a stream over rebuilds from its events (takeover.py)."""
    s = ResponsesStream("resp_abc", "m", 7)
    evs = [*s.opening(), *s.delta("Hel"), *s.delta("lo")]
    again = ResponsesStream.resume(json.loads(json.dumps(evs)))
    assert (again.seq, again.text, again.id, again.created_at) == (6, "Hello", "resp_abc", 7)
    closing = again.closing(Responses().finish("eos", None), 3, 2)
    assert [e["sequence_number"] for e in closing] == [6, 7, 8, 9] and closing[0]["text"] == "Hello"
    assert closing[-1]["type"] == "response.completed" and closing[-1]["response"]["usage"]["output_tokens"] == 2


# --- /v1/completions ------------------------------------------------------------------------------


def test_completions_whole_and_streamed_give_the_same_text_and_usage(servers):
    client = oa(servers["plain"].port)
    whole = client.completions.create(model="m", prompt="The lighthouse", max_tokens=10, seed=1)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10 and whole.usage.prompt_tokens == 3  # as it is: no chat template
    chunks = list(
        client.completions.create(
            model="m",
            prompt=["The lighthouse"],
            max_tokens=10,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == 3


def test_completions_stop_strings_and_the_default_length(servers):
    client = oa(servers["plain"].port)
    text = client.completions.create(model="m", prompt="The lighthouse", max_tokens=20, seed=1).choices[0].text
    stop = text[6:9]
    r = client.completions.create(model="m", prompt="The lighthouse", max_tokens=20, seed=1, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"
    assert client.completions.create(model="m", prompt="The lighthouse").usage.completion_tokens == 16  # OpenAI's


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "logprobs": 2}, "logprobs"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "suffix": "b"}, "suffix"),
    ],
)
def test_completions_refuse_what_they_do_not_do_with_a_400(servers, body, param):
    r = httpx.post(f"http://127.0.0.1:{servers['plain'].port}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_taker_goes_on_with_a_call_cut_in_the_middle():
    """The generator died inside a tool call: the taker's reader, replayed with the answer so
    far, continues the same call (its arguments, its end), numbered on."""
    from streaming.server.resumable.encodings import ResponsesEvents, of_events, parsed
    from streaming.server.resumable.recordings import Recording
    from streaming.wire.tools import openai_tools

    tools = openai_tools({"tools": [{"type": "function", "function": {"name": "get_weather"}}]})
    before = ["Hi", "<tool_call>", '\n{"name": "get_weather", "arguments": {"ci']
    after = ['ty": "Paris"}}\n', "</tool_call>"]
    rec = Recording("S", None)
    enc = ResponsesEvents.new("S", "m", tools)
    enc.open(rec)
    for piece in before:
        enc.piece(rec, piece)
    taker = of_events(rec, "".join(before))  # what a replica that takes over rebuilds
    for piece in after:
        taker.piece(rec, piece)
    taker.done(rec, "eos", 3, 9)
    evs = [json.loads(data) for _, data in parsed(rec)]
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    final = evs[-1]["response"]
    assert evs[-1]["type"] == "response.completed" and [o["type"] for o in final["output"]] == [
        "message",
        "function_call",
    ]
    assert (
        json.loads(final["output"][1]["arguments"]) == {"city": "Paris"}
        and final["output"][0]["content"][0]["text"] == "Hi"
    )
