"""The OpenAI and Anthropic wire formats, judged by the official SDKs, plus StopMatcher."""

import json

import anthropic
import httpx
import openai
import pytest
from helpers import server_log, wait_for_log

from streaming.wire.anthropic import Anthropic
from streaming.wire.completions import Completions
from streaming.wire.openai import OpenAI
from streaming.wire.responses import Responses
from streaming.wire.stops import StopMatcher

MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]


def oa(port, **kw):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw
    )


def an(port, **kw):
    return anthropic.Anthropic(
        base_url=f"http://127.0.0.1:{port}", api_key=kw.pop("api_key", "unused"), max_retries=0, **kw
    )


# --- OpenAI -------------------------------------------------------------------------------------


def test_openai_whole_and_streamed_give_the_same_text_and_usage(servers):
    client = oa(servers["plain"].port)
    whole = client.chat.completions.create(model="any", messages=MESSAGES, max_tokens=20, seed=3)
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20 and whole.usage.prompt_tokens > 5
    chunks = list(
        client.chat.completions.create(
            model="any", messages=MESSAGES, max_tokens=20, seed=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20  # the usage chunk
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_a_conversations_next_turn_copies_the_last_turns_keys_over_the_wire(servers):
    """The OpenAI SDK sends a conversation's second turn (the first turn's question and answer, then
    a new question) to the `exact` server: the server copies the beginning the ended first answer
    left (prompt_tokens_retained in /metrics.json: more than the first prompt, less than the whole)
    and computes the rest, and the same turn sent again, which copies its own ended text, gets the
    same text (the `exact` model: what a request computes alone, tests/test_sharing.py)."""
    port = servers["exact"].port
    metrics = lambda: httpx.get(f"http://127.0.0.1:{port}/metrics.json").json()  # noqa: E731
    client = oa(port)
    ask = lambda messages: client.chat.completions.create(  # noqa: E731
        model="any", messages=messages, max_tokens=12, seed=5, extra_body={"ignore_eos": True}
    )
    first = ask(MESSAGES)
    before = metrics()["prompt_tokens_retained"]
    turn = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "And what did their keepers eat?"})
    second = ask(turn)
    copied = metrics()["prompt_tokens_retained"] - before
    assert copied > first.usage.prompt_tokens and second.usage.prompt_tokens > copied
    assert ask(turn).choices[0].message.content == second.choices[0].message.content


def test_a_next_turn_copies_keys_only_from_its_own_cache_salt_over_the_wire(servers):
    """vLLM's `cache_salt`, sent through the OpenAI SDK's extra_body: a conversation's next turn
    under another salt (or none) copies nothing of the first turn's (prompt_tokens_retained in
    /metrics.json), the same salt copies it, and the text is the same either way (tenants apart:
    prefixes.py)."""
    port = servers["exact"].port
    metrics = lambda: httpx.get(f"http://127.0.0.1:{port}/metrics.json").json()["prompt_tokens_retained"]  # noqa: E731
    client = oa(port)
    question = [{"role": "user", "content": "Name three quiet harbours and what their boats carried."}]

    def ask(messages, salt):
        body = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        return client.chat.completions.create(model="any", messages=messages, max_tokens=12, seed=9, extra_body=body)

    first = ask(question, "tenant-a")
    turn = [*question, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "Which of them is the oldest?"})
    texts = []
    copied = {}
    for salt in ("tenant-b", None, "tenant-a"):
        before = metrics()
        texts.append(ask(turn, salt).choices[0].message.content)
        copied[salt] = metrics() - before
    assert copied["tenant-b"] == 0  # the first of its salt: nothing to copy
    assert copied[None] < first.usage.prompt_tokens  # at most the chat template's system prompt, from other tests
    assert copied["tenant-a"] > first.usage.prompt_tokens  # the whole first turn, question and answer
    assert texts[0] == texts[1] == texts[2]


def test_openai_chunks_carry_random_obfuscation_unless_turned_off(servers):
    port = servers["plain"].port
    body = {"model": "x", "messages": MESSAGES, "max_tokens": 10, "stream": True}
    padded = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60).text
    plain = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        json=dict(body, stream_options={"include_obfuscation": False}),
        timeout=60,
    ).text
    assert padded.count('"obfuscation":') >= 10 and '"obfuscation"' not in plain
    lengths = {len(line) for line in padded.splitlines() if '"obfuscation"' in line}
    assert len(lengths) > 3


def test_openai_stop_strings(servers):
    client = oa(servers["plain"].port)
    text = (
        client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=30, seed=5).choices[0].message.content
    )
    stop = text[12:16]
    expected = text[: text.find(stop)]
    r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=30, seed=5, stop=[stop, "zzzz"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=30, seed=5, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_usage_counts_the_tokens_through_the_one_that_completed_a_stop_string(servers):
    """As vLLM counts: the tokens through the one whose text completed the stop string (k: the
    fewest max_tokens whose answer holds it), not the one or two generated before the engine saw
    the stop (they were counted). The `slow` server: each token reaches the loop before the next."""
    client = oa(servers["slow"].port)

    def ask(**kw):
        return client.chat.completions.create(
            model="x", messages=MESSAGES, seed=5, extra_body={"ignore_eos": True}, **kw
        )

    stop = ask(max_tokens=30).choices[0].message.content[12:16]
    k = next(k for k in range(1, 31) if stop in ask(max_tokens=k).choices[0].message.content)
    whole = ask(max_tokens=30, stop=[stop])
    assert whole.choices[0].finish_reason == "stop" and whole.usage.completion_tokens == k
    chunks = list(ask(max_tokens=30, stop=[stop], stream=True, stream_options={"include_usage": True}))
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == k


def test_openai_closing_the_stream_after_10_chunks_stops_generation(servers):
    port = servers["slow"].port
    before = len(server_log(port))
    stream = oa(port).chat.completions.create(model="x", messages=MESSAGES, max_tokens=100, stream=True)
    for i, _ in enumerate(stream):
        if i == 9:
            break
    stream.close()
    path, generated, left = wait_for_log(port, before + 1)[-1]
    assert path == "/v1/chat/completions" and left and generated <= 11


def test_openai_error_mid_stream_is_the_sdks_error(servers):
    stream = oa(servers["failing"].port).chat.completions.create(
        model="x", messages=MESSAGES, max_tokens=50, stream=True
    )
    with pytest.raises(openai.APIError, match="injected failure"):
        list(stream)
    with pytest.raises(openai.InternalServerError):
        oa(servers["failing"].port).chat.completions.create(model="x", messages=MESSAGES, max_tokens=50)


def test_openai_models_and_api_key(servers):
    assert [m.id for m in oa(servers["plain"].port).models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as e:
        oa(servers["keyed"].port, api_key="wrong").chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "invalid_api_key"
    r = oa(servers["keyed"].port, api_key="sekrit").chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens == 2


OPENAI_BAD = [
    ({"model": "x"}, "messages"),
    ({"model": "x", "messages": "hi"}, "messages"),
    ({"model": "x", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": "x", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "x", "messages": [{"role": "user", "content": ""}]}, "messages"),
    ({"model": "x", "messages": MESSAGES, "max_tokens": 5000}, "max_tokens"),
    ({"model": "x", "messages": MESSAGES, "max_completion_tokens": "9"}, "max_tokens"),
    ({"model": "x", "messages": MESSAGES, "temperature": 3}, "temperature"),
    ({"model": "x", "messages": MESSAGES, "stop": [""]}, "stop"),
    ({"model": "x", "messages": MESSAGES, "stop": ["x" * 1001]}, "stop"),  # (held back whole: apis.MAX_STOP_CHARS)
    ({"model": "x", "messages": MESSAGES, "cache_salt": ""}, "cache_salt"),
    # asked, and not done: refused, where they were ignored (one free-text choice, 200)
    ({"model": "x", "messages": MESSAGES, "n": 3}, "n"),
    ({"model": "x", "messages": MESSAGES, "logprobs": True}, "logprobs"),
    ({"model": "x", "messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"model": "x", "messages": MESSAGES, "logit_bias": {"15": 100}}, "logit_bias"),
    ({"model": "x", "messages": MESSAGES, "response_format": {"type": "json_object"}}, "response_format"),
]


def test_openai_defaults_of_what_it_cannot_do_pass_and_a_null_max_completion_tokens_is_absent(servers):
    """Clients send these parameters' defaults; and a null max_completion_tokens beside max_tokens
    shadowed it (256 tokens, not 3)."""
    body = {"model": "x", "messages": MESSAGES, "n": 1, "logprobs": False, "top_logprobs": None, "logit_bias": {}}
    body.update(response_format={"type": "text"}, max_completion_tokens=None, max_tokens=3, ignore_eos=True)
    r = httpx.post(f"http://127.0.0.1:{servers['plain'].port}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_top_p_0_is_the_likeliest_token_and_a_negative_seed_is_a_seed_in_both_formats(servers):
    """OpenAI's and Anthropic's ranges: top_p from 0, which keeps the likeliest token alone (the text
    at temperature 0.9 is greedy's), and a seed any 64-bit integer, negative too (both were 400s).
    Our own format keeps its (0, 1] and seeds from 0 (test_bad_inputs.py)."""
    port = servers["exact"].port
    body = {"model": "x", "max_tokens": 12, "messages": MESSAGES, "extra_body": {"ignore_eos": True}}
    greedy = oa(port).chat.completions.create(temperature=0, **body).choices[0].message.content
    nucleus = oa(port).chat.completions.create(temperature=0.9, top_p=0, seed=-(2**63), **body)
    # (the Anthropic SDK installed takes neither in messages.create: they go in the body as they are)
    r = an(port).messages.create(**dict(body, extra_body={"ignore_eos": True, "temperature": 0.9, "top_p": 0}))
    assert nucleus.choices[0].message.content == r.content[0].text == greedy
    seeded = [oa(port).chat.completions.create(temperature=1, seed=s, **body) for s in (-7, -7)]
    assert seeded[0].choices[0].message.content == seeded[1].choices[0].message.content
    assert seeded[0].usage.completion_tokens == 12


@pytest.mark.parametrize("body,param", OPENAI_BAD)
def test_openai_bad_inputs_in_openais_error_shape(servers, body, param):
    r = httpx.post(f"http://127.0.0.1:{servers['plain'].port}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_openai_sdk_raises_bad_request(servers):
    with pytest.raises(openai.BadRequestError):
        oa(servers["plain"].port).chat.completions.create(model="x", messages=[{"role": "wizard", "content": "x"}])


# --- Anthropic ----------------------------------------------------------------------------------


def test_anthropic_whole_stream_helper_and_raw_events_agree(servers):
    client = an(servers["plain"].port)
    whole = client.messages.create(model="any", max_tokens=20, messages=MESSAGES, system="Be brief.")
    assert whole.type == "message" and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 20 and whole.usage.input_tokens > 5
    with client.messages.stream(model="any", max_tokens=20, messages=MESSAGES, system="Be brief.") as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == whole.content[0].text == final.content[0].text
    assert final.usage.output_tokens == 20 and final.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == "max_tokens"
    events = list(
        client.messages.create(model="any", max_tokens=20, messages=MESSAGES, system="Be brief.", stream=True)
    )
    types = [e.type for e in events if e.type != "ping"]  # (--ping 0.3: a block now begins at its first text)
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == streamed
    assert events[-2].usage.output_tokens == 20


def test_anthropic_takes_ignore_eos_as_chat_completions_does(servers):
    """vLLM's ignore_eos, for measurements: the same on /v1/messages as on /v1/chat/completions
    (it was dropped there: an answer ended at its first end-of-turn)."""
    from streaming.wire.anthropic import Anthropic
    from streaming.wire.openai import OpenAI

    body = {"max_tokens": 40, "messages": MESSAGES}
    assert Anthropic().parse(dict(body, ignore_eos=True)).params.ignore_eos
    assert OpenAI().parse(dict(body, ignore_eos=True)).params.ignore_eos
    assert not Anthropic().parse(dict(body, ignore_eos=False)).params.ignore_eos
    r = an(servers["plain"].port).messages.create(model="x", extra_body={"ignore_eos": True}, **body)
    c = oa(servers["plain"].port).chat.completions.create(model="x", extra_body={"ignore_eos": True}, **body)
    assert r.usage.output_tokens == c.usage.completion_tokens == 40 and r.stop_reason == "max_tokens"
    assert r.content[0].text == c.choices[0].message.content and "<|" not in r.content[0].text


def test_anthropic_continues_a_last_assistant_message_as_chat_completions_does(servers):
    """Anthropic's prefill: a last assistant message is the answer's beginning. It was closed and
    a new turn begun after it, so the answer ignored it; now it is continued, as vLLM's
    continue_final_message does on /v1/chat/completions (the exact model, sampled from seed 0 in
    both formats: the same prompt gives the same text)."""
    port = servers["exact"].port
    body = {
        "max_tokens": 12,
        "messages": MESSAGES + [{"role": "assistant", "content": "Lighthouses"}],
    }
    r = an(port).messages.create(model="x", **body)
    c = oa(port).chat.completions.create(model="x", extra_body={"continue_final_message": True}, **body)
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.content[0].text == c.choices[0].message.content
    closed = oa(port).chat.completions.create(model="x", **body)  # a new turn after it: its close and opening
    assert closed.usage.prompt_tokens > c.usage.prompt_tokens
    for last in (" ", "Lighthouses ", [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]):
        bad = dict(body, messages=MESSAGES + [{"role": "assistant", "content": last}])
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/messages", json=bad, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", reply.text


def test_anthropic_stop_sequences(servers):
    client = an(servers["plain"].port)
    text = client.messages.create(model="x", max_tokens=30, messages=MESSAGES).content[0].text
    stop = text[10:14]
    r = client.messages.create(model="x", max_tokens=30, messages=MESSAGES, stop_sequences=[stop])
    assert r.content[0].text == text[: text.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    with client.messages.stream(model="x", max_tokens=30, messages=MESSAGES, stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == text[: text.find(stop)]
        assert s.get_final_message().stop_sequence == stop


def test_anthropic_ping_events_during_silence(servers):
    r = httpx.post(
        f"http://127.0.0.1:{servers['quiet'].port}/v1/messages",
        json={"model": "x", "max_tokens": 2, "messages": MESSAGES, "stream": True},
        timeout=60,
    )
    assert "event: ping\n" in r.text
    with an(servers["quiet"].port).messages.stream(model="x", max_tokens=2, messages=MESSAGES) as s:
        assert s.get_final_message().usage.output_tokens == 2  # the SDK skips the pings


def test_anthropic_leaving_after_10_events_stops_generation(servers):
    port = servers["slow"].port
    before = len(server_log(port))
    with an(port).messages.stream(model="x", max_tokens=100, messages=MESSAGES) as s:
        for i, _ in enumerate(s.text_stream):
            if i == 9:
                break
    path, generated, left = wait_for_log(port, before + 1)[-1]
    assert path == "/v1/messages" and left and generated <= 11


def test_anthropic_error_mid_stream_is_the_sdks_error(servers):
    client = an(servers["failing"].port)
    with pytest.raises(anthropic.APIError, match="injected failure"):
        with client.messages.stream(model="x", max_tokens=50, messages=MESSAGES) as s:
            s.get_final_message()
    with pytest.raises(anthropic.InternalServerError):
        client.messages.create(model="x", max_tokens=50, messages=MESSAGES)


def test_anthropic_api_key(servers):
    with pytest.raises(anthropic.AuthenticationError):
        an(servers["keyed"].port, api_key="wrong").messages.create(model="x", max_tokens=2, messages=MESSAGES)
    r = an(servers["keyed"].port, api_key="sekrit").messages.create(model="x", max_tokens=2, messages=MESSAGES)
    assert r.usage.output_tokens == 2


ANTHROPIC_BAD = [
    {"model": "x", "messages": MESSAGES},  # no max_tokens
    {"model": "x", "max_tokens": 5},  # no messages
    {"model": "x", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]},
    {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]},
    {"model": "x", "max_tokens": 5, "messages": [{"role": "user", "content": ""}]},
    {"model": "x", "max_tokens": 5000, "messages": MESSAGES},
    {"model": "x", "max_tokens": "5", "messages": MESSAGES},
    {"model": "x", "max_tokens": 5, "messages": MESSAGES, "temperature": 1.5},
]


@pytest.mark.parametrize("body", ANTHROPIC_BAD)
def test_anthropic_bad_inputs_in_anthropics_error_shape(servers, body):
    r = httpx.post(f"http://127.0.0.1:{servers['plain'].port}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400
    value = r.json()
    assert value["type"] == "error" and value["error"]["type"] == "invalid_request_error" and value["error"]["message"]


def test_anthropic_sdk_raises_bad_request(servers):
    with pytest.raises(anthropic.BadRequestError):
        an(servers["plain"].port).messages.create(model="x", max_tokens=0, messages=MESSAGES)


# --- StopMatcher without sockets ------------------------------------------------------------------


FORMATS = [  # each API's format and the least of a streamed request's body
    (OpenAI(), {"messages": [{"role": "user", "content": "hi"}], "stream": True}, "type", "server_error"),
    (Completions(), {"prompt": "hi", "stream": True}, "type", "server_error"),
    (
        Anthropic(),
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        "type",
        "api_error",
    ),
    (Responses(), {"input": "hi", "stream": True}, "code", "server_error"),
]


@pytest.mark.parametrize("fmt, body, field, server", FORMATS, ids=lambda x: getattr(x, "name", None))
def test_a_failure_after_the_head_is_typed_by_the_status_it_would_have_had(fmt, body, field, server):
    """The APIs' streams send their head at once, so a request the engine refuses at admission (an
    id past the vocabulary from a store) fails after it: its error event says it was the request
    (an invalid request, as a 400 before the head would), and an engine's failure still says the
    server's."""
    enc = fmt.stream("m", fmt.parse(body), 3)
    refused, failed = enc.error("token id 9 is not in the model's vocabulary", 400), enc.error("boom")
    assert b"token id 9" in refused and b"boom" in failed
    assert f'"{server}"'.encode() in failed and f'"{server}"'.encode() not in refused
    invalid = b'"invalid_prompt"' if field == "code" else b'"invalid_request_error"'
    assert invalid in refused


@pytest.mark.parametrize("cut", range(1, 12))
def test_stop_matcher_at_every_split(cut):
    text = "Hello STOP world"
    m = StopMatcher(["STOP"])
    out = m.push(text[:cut]) + m.push(text[cut:]) + m.flush()
    assert out == "Hello " and m.matched == "STOP"


def test_stop_matcher_holds_only_what_could_start_a_stop_string():
    m = StopMatcher(["</end>", "##"])
    assert m.push("a <") == "a " and m.held == "<"
    assert m.push("b") == "<b" and m.held == ""
    assert m.push("x #") == "x " and m.push("y") == "#y"
    assert m.push("tail </en") == "tail " and m.flush() == "</en" and m.matched is None


def test_stop_matcher_earliest_stop_wins_and_nothing_after():
    m = StopMatcher(["bb", "a"])
    assert m.push("xxbba") == "xx" and m.matched == "bb"
    assert m.push("more") == "" and m.flush() == ""


# --- measuring the formats on the wire ------------------------------------------------------------


def run(*args):
    import subprocess
    import sys

    from helpers import ROOT

    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_event_bytes_live_against_a_running_server(servers):
    # the paced server (50 tokens a second): at full speed a loaded machine's loop can fall behind
    # and send several tokens in one event, and the two OpenAI runs, the same text, then came in
    # different numbers of pieces (no padding 44.0x against padded 42.2x, once in the full suite)
    out = run("scripts/event_bytes.py", "--live", "--port", str(servers["slow"].port), "--max-tokens", "20")
    lines = out.splitlines()
    assert "  SSE event (/stream)             article   23 bytes, ours   23.0 bytes" in lines
    assert "  WebSocket frame (/ws)           article   17 bytes, ours   17.0 bytes" in lines
    assert any(line.startswith("  Anthropic content_block_delta   article  118 bytes, ours") for line in lines)
    ratios = {line[2:29].strip(): float(line.rsplit("(", 1)[1].rstrip("x)")) for line in lines[-5:]}
    assert ratios["our /ws"] < ratios["our /stream"] < ratios["Anthropic events"] < ratios["OpenAI chunks, no padding"]
    assert ratios["OpenAI chunks, no padding"] < ratios["OpenAI chunks, padded"]


@pytest.mark.parametrize("fmt", ["openai", "anthropic"])
def test_measure_in_each_format_through_any_url(servers, fmt, tmp_path):
    port = servers["plain"].port
    saved = tmp_path / "measure.json"
    measure = ["client.py", "measure", "--format", fmt, "--url", f"http://127.0.0.1:{port}", "--prompts", "1"]
    out = run(*measure, "--model", "tiny", "--save", str(saved))
    figures = json.loads(saved.read_text())
    assert figures[f"{fmt} stream"]["ratio"] > 2 and figures["model"] == "tiny"
    out += run(*measure, "--max-tokens", "8", "--save", "")
    assert f"{fmt} stream first text after" in out and "the same text both ways: True" in out
    sdk_style = ["client.py", "measure", "--format", fmt, "--url", f"http://127.0.0.1:{port}/v1", "--prompts", "1"]
    assert f"{fmt} stream first text after" in run(*sdk_style, "--max-tokens", "4", "--save", "")  # base_url form
