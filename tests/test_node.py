"""The Node SDKs are judges too: OpenAI's and Anthropic's, the AI SDK with its providers, and the
`eventsource` package, each run by a small script in tests/node/ against the session's servers:
Chat Completions, Messages, the Responses API (numbered, resumed, cancelled), text completions,
and tool calls in all three formats through each SDK's own accumulator (on the `echo` model,
which answers with the user's message: a message in Qwen2.5's call syntax is an answer that calls
a tool, as in tests/test_tools.py).

A script is `node tests/node/NAME.mjs BASE_URL [OPTIONS_JSON]` and prints one JSON line of what its
client saw (tests/node/common.mjs lists the fields). A new case is a script there (or a provider
in ai_stream_text.mjs's PROVIDERS) and a test here calling `node(...)`. The packages are pinned in
tests/node/package-lock.json and installed by `make node-deps` (npm ci into tests/node/node_modules);
without node 20+, npm or those packages the module is skipped, saying why, unless REQUIRE_NODE=1
(.ci/run), under which it fails.
"""

import json
import os
import shutil
import subprocess

import httpx
import pytest
from helpers import ROOT, metrics, server_log, wait_for_log, wait_idle

NODE_DIR = ROOT / "tests" / "node"
REQUIRED = os.environ.get("REQUIRE_NODE") == "1"  # .ci/run: missing Node packages are a failure, not a skip
MESSAGES = [{"role": "user", "content": "Tell me about lighthouses."}]  # the scripts' default too
PROMPT = "The lighthouse keeper wrote in his log"  # eventsource_stream.mjs's and openai_completions.mjs's default

# tests/test_tools.py's scripted answers and tools, in each API's shape
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": PARAMS}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
AI_SDK_TOOLS = {"get_weather": {"description": "Weather", "input_schema": PARAMS}}  # ai_stream_text.mjs's JSON form


def call(city):
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


SAY = "Let me look." + call("Paris")
TWO = "Both." + call("Paris") + "\n" + call("Rome")


def missing():
    """Why the Node tests cannot run here, or None."""
    node = shutil.which("node")
    if node is None:
        return "needs node 20+ and npm (then `make node-deps`)"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < 20:
        return f"needs node 20+ (the pinned packages' minimum), found {version}"
    pinned = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]
    for name, version in pinned.items():
        installed = NODE_DIR / "node_modules" / name / "package.json"
        if not installed.exists():
            return f"tests/node/node_modules has no {name}: run `make node-deps` (npm ci)"
        if (found := json.loads(installed.read_text())["version"]) != version:
            return f"tests/node/node_modules has {name} {found}, {version} is pinned: run `make node-deps`"
    return None


MISSING = missing()
if MISSING and not REQUIRED:
    pytest.skip(MISSING, allow_module_level=True)


def node(script, port, timeout=60, **options):
    """Run tests/node/SCRIPT.mjs against the server on `port`: the JSON line it printed."""
    if MISSING:
        pytest.fail(f"REQUIRE_NODE=1 and {MISSING}")
    argv = [shutil.which("node"), str(NODE_DIR / f"{script}.mjs"), f"http://127.0.0.1:{port}", json.dumps(options)]
    p = subprocess.run(argv, cwd=NODE_DIR, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0 and p.stdout.strip(), f"{script} exited {p.returncode}:\n{p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


def post(port, path, body):
    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def openai_whole(port, max_tokens=20):
    """The server's whole answer to the scripts' default Chat Completions request (greedy, seed 3)."""
    body = {"model": "x", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "seed": 3}
    return post(port, "/v1/chat/completions", body)


def anthropic_whole(port, max_tokens=20):
    body = {"model": "x", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    return post(port, "/v1/messages", body)


def responses_text(port, max_output_tokens=20):
    """The text of the server's whole Responses answer to the scripts' default request (greedy)."""
    body = {"model": "x", "input": MESSAGES, "max_output_tokens": max_output_tokens, "temperature": 0}
    r = post(port, "/v1/responses", body)
    return "".join(c["text"] for o in r["output"] if o["type"] == "message" for c in o["content"])


def completion(port, prompt=PROMPT, max_tokens=20, **body):
    """The server's whole text completion, greedy, seed 3 (openai_completions.mjs's defaults)."""
    body = {"model": "x", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 3, **body}
    return post(port, "/v1/completions", body)


def last_logged(port, before):
    """The log entry [path, generated, left early] of the one request made since `before` entries."""
    return wait_for_log(port, before + 1)[before]


# --- OpenAI's SDK (openai) -----------------------------------------------------------------------


def test_openai_sdk_whole_and_streamed_give_the_servers_answer_and_usage(servers):
    port = servers["plain"].port
    whole = openai_whole(port)
    text, usage = whole["choices"][0]["message"]["content"], whole["usage"]
    assert usage["completion_tokens"] == 20 and text
    before = len(server_log(port))
    got = node("openai_chat", port)
    assert got["error"] is None and got["object"] == "chat.completion", got
    assert got["text"] == text and got["finish_reason"] == "length"
    assert got["usage"] == {"input": usage["prompt_tokens"], "output": 20}
    streamed = node("openai_chat_stream", port)
    assert streamed["error"] is None and streamed["chunk_object"] == "chat.completion.chunk", streamed
    assert streamed["text"] == text and streamed["finish_reason"] == "length" and streamed["role"] == "assistant"
    assert 1 < streamed["deltas"] <= 20 and streamed["events"] == streamed["deltas"] + 3  # role, finish, usage
    assert streamed["usage"] == {"input": usage["prompt_tokens"], "output": 20}
    assert streamed["usage_chunks"] == 1 and streamed["usage_chunk_choices"] == []
    assert [entry[1] for entry in wait_for_log(port, before + 2)[before:]] == [20, 20]  # usage = tokens generated


def test_openai_sdk_abort_mid_stream_stops_generation_within_a_few_tokens(servers):
    port = servers["slow"].port  # 20 ms a token: 200 would take 4 s
    before, m0 = len(server_log(port)), metrics(port)
    got = node("openai_chat_abort", port, abort_after=10, max_tokens=200)
    assert got["error"] is None and got["aborted"] and got["deltas"] == 10 and got["after_abort"] == 0, got
    path, generated, left = last_logged(port, before)
    assert path == "/v1/chat/completions" and left
    assert generated <= got["deltas"] + 3, (generated, got)  # each delta a token or more; a few in flight
    m1 = wait_idle(port)
    assert m1["requests_stopped"] > m0["requests_stopped"]
    assert m1["tokens_after_stop"] - m0["tokens_after_stop"] <= 1  # at most the token being computed


# --- Anthropic's SDK (@anthropic-ai/sdk) ---------------------------------------------------------


def test_anthropic_sdk_stream_and_final_message_give_the_servers_answer(servers):
    port = servers["plain"].port
    whole = anthropic_whole(port)
    text, usage = whole["content"][0]["text"], whole["usage"]
    got = node("anthropic_messages_stream", port)
    assert got["error"] is None, got
    assert got["text"] == got["final_text"] == text and got["finish_reason"] == "max_tokens"
    assert got["usage"] == {"input": usage["input_tokens"], "output": 20} and usage["output_tokens"] == 20
    types = {k: v for k, v in got["event_types"].items() if k != "ping"}  # --ping 0.3: one may land mid-answer
    assert types == {
        "message_start": 1,
        "content_block_start": 1,
        "content_block_delta": got["deltas"],
        "content_block_stop": 1,
        "message_delta": 1,
        "message_stop": 1,
    }


# --- the AI SDK (ai) through its providers ---------------------------------------------------------

# The prompt @ai-sdk/openai's .completion() model makes of MESSAGES, with its stop ["\nuser:"]
AI_SDK_COMPLETION_PROMPT = "user:\nTell me about lighthouses.\n\nassistant:\n"

PROVIDERS = {  # provider: (the whole answer to compare with, its own finish reason)
    "openai-compatible": (lambda port: openai_whole(port)["choices"][0]["message"]["content"], "length"),
    "anthropic": (lambda port: anthropic_whole(port)["content"][0]["text"], "max_tokens"),
    "openai": (responses_text, "max_output_tokens"),  # the Responses API
    "openai-chat": (lambda port: openai_whole(port)["choices"][0]["message"]["content"], "length"),
    "openai-completion": (
        lambda port: completion(port, AI_SDK_COMPLETION_PROMPT, stop=["\nuser:"])["choices"][0]["text"],
        "length",
    ),
}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_ai_sdk_stream_text_gives_the_servers_answer_and_usage(servers, provider):
    port = servers["plain"].port
    whole, raw_reason = PROVIDERS[provider]
    got = node("ai_stream_text", port, provider=provider)
    assert got["error"] is None and "warnings" not in got, got
    assert got["text"] == whole(port) and got["deltas"] > 1
    assert got["finish_reason"] == "length" and got["raw_finish_reason"] == raw_reason
    assert got["usage"]["output"] == 20 and got["usage"]["input"] > 5
    assert got["event_types"]["text-delta"] == got["deltas"] and got["event_types"]["finish"] == 1


# --- an error mid-stream, as each SDK reports it -----------------------------------------------------


@pytest.mark.parametrize(
    "script,options",
    [
        ("openai_chat_stream", {}),
        ("anthropic_messages_stream", {}),
        ("ai_stream_text", {"provider": "openai-compatible"}),
        ("ai_stream_text", {"provider": "anthropic"}),
        ("responses_stream", {}),
        ("ai_stream_text", {"provider": "openai"}),
    ],
)
def test_an_error_mid_stream_reaches_each_sdk_after_the_text_before_it(servers, script, options):
    got = node(script, servers["failing"].port, **options)  # --fail-after 5
    assert got["error"] and "injected failure" in got["error"]["message"], got
    assert 0 < got["deltas"] <= 5 and got["text"]


# --- EventSource (eventsource) on the resumable GET /stream -------------------------------------------


def complete(port, max_tokens):
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "seed": 3, "ignore_eos": True}
    return post(port, "/complete", body)["text"]


def test_eventsource_reads_get_stream_until_done(servers):
    port = servers["plain"].port
    got = node("eventsource_stream", port, max_tokens=20)
    assert got["error"] is None and got["done"], got
    assert got["text"] == complete(port, 20)
    assert got["events"] == got["deltas"] + 2  # the `stream` event first, [DONE] last
    assert got["ids"] == [f"{got['stream']}.0", f"{got['stream']}.{got['events'] - 1}"]
    assert got["connections"] == 1 and got["errors"] == 0 and got["last_event_ids"] == []


def test_eventsource_reconnects_with_last_event_id_and_loses_nothing(servers):
    port = servers["dropping"].port  # the connection ends after every 8 events; retry: 1000 ms
    got = node("eventsource_stream", port, max_tokens=12)
    assert got["error"] is None and got["done"], got
    assert got["text"] == complete(port, 12)
    assert got["events"] == got["deltas"] + 2  # nothing repeated, nothing lost
    assert got["connections"] == 2 and got["errors"] == 1 and got["last_event_ids"] == [f"{got['stream']}.7"]


# --- the Responses API (/v1/responses), openai's responses.create and responses.stream ---------------

OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_openai_sdk_responses_stream_is_the_whole_answer_numbered_and_resumes_after_n(servers):
    port = servers["plain"].port
    got = node("responses_stream", port, whole=True, resume_after=6)
    assert got["error"] is None, got
    assert got["text"] == got["whole_text"] == got["final_text"] == responses_text(port) and got["text"]
    assert got["order"] == [*OPENING, "response.output_text.delta", *CLOSING, "response.incomplete"]
    assert 1 < got["deltas"] <= 20 and got["events"] == got["deltas"] + 8
    assert got["sequence_numbers"] == list(range(got["events"]))
    assert got["final_type"] == "response.incomplete" and got["status"] == "incomplete"
    assert got["finish_reason"] == "max_output_tokens" and got["id"].startswith("resp_")
    assert got["usage"]["output"] == 20 and got["usage"]["input"] > 5
    assert got["sdk_usage"]["total_tokens"] == got["usage"]["input"] + 20
    # the helper asks for the whole stream again and drops 0..6 itself; retrieve has the server skip them
    rid = got["id"]
    assert got["requests"] == [
        "POST /v1/responses",
        "POST /v1/responses",
        f"GET /v1/responses/{rid}?stream=true",
        f"GET /v1/responses/{rid}?stream=true&starting_after=6",
    ]
    for way in ("helper", "retrieve"):
        again = got["resumed"][way]
        assert again["same_events"] and again["sequence_numbers"] == list(range(7, got["events"])), (way, again)
        assert got["text"].endswith(again["text"]) and again["order"][-1] == "response.incomplete"


def test_openai_sdk_responses_cancel_ends_the_stream_cancelled_and_stops_generation(servers):
    port = servers["slow"].port  # 20 ms a token: 400 would take 8 s
    before = len(server_log(port))
    got = node("responses_stream", port, cancel_after=8, max_output_tokens=400)
    assert got["error"] is None, got
    assert got["cancelled"] == {"id": got["id"], "status": "cancelled", "object": "response"}
    assert got["final_type"] == "response.incomplete" and got["status"] == "cancelled"
    assert got["order"][-4:] == [*CLOSING, "response.incomplete"] and got["usage"]["output"] < 100
    assert got["requests"] == ["POST /v1/responses", f"POST /v1/responses/{got['id']}/cancel"]
    path, generated, _ = last_logged(port, before)
    assert path == "/v1/responses" and generated < 100
    assert wait_idle(port)["active_generations"] == 0


# --- text completions (/v1/completions), openai's completions.create -------------------------------


def test_openai_sdk_completions_whole_and_streamed_give_the_servers_text(servers):
    port = servers["plain"].port
    whole = completion(port)
    text, usage = whole["choices"][0]["text"], whole["usage"]
    assert usage["completion_tokens"] == 20 and usage["prompt_tokens"] == 8 and text  # the prompt as it is
    got = node("openai_completions", port)
    assert got["error"] is None and got["object"] == "text_completion", got
    assert got["text"] == text and got["finish_reason"] == "length"
    assert got["usage"] == {"input": usage["prompt_tokens"], "output": 20}
    streamed = node("openai_completions", port, stream=True, stream_options={"include_usage": True})
    assert streamed["error"] is None and streamed["object"] == "text_completion", streamed
    assert streamed["text"] == text and streamed["finish_reason"] == "length"
    assert 1 < streamed["deltas"] <= 20 and streamed["events"] == streamed["deltas"] + 2  # finish, usage
    assert streamed["usage"] == got["usage"] and streamed["usage_chunks"] == 1 and streamed["usage_chunk_choices"] == []


# --- tool calls through each SDK's accumulator (the echo model) ------------------------------------


def test_openai_sdk_chat_stream_accumulates_two_tool_calls(servers):
    got = node("openai_chat_tools", servers["echo"].port, messages=[{"role": "user", "content": TWO}], tools=TOOLS)
    assert got["error"] is None, got
    assert got["finish_reason"] == "tool_calls" and got["text"] == got["final_text"] == "Both."
    assert [(c["name"], c["input"]) for c in got["calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["id"].startswith("call_") for c in got["calls"]) and got["calls"][0]["id"] != got["calls"][1]["id"]
    types = got["event_types"]
    assert types["tool_calls.function.arguments.done"] == 2 and types["tool_calls.function.arguments.delta"] > 2
    assert got["usage"]["output"] > 0


def test_openai_sdk_run_tools_calls_the_local_function_and_sends_its_result_back(servers):
    got = node(
        "openai_chat_tools",
        servers["echo"].port,
        messages=[{"role": "user", "content": SAY}],
        tools=TOOLS,
        run_tools="20 C",
    )
    assert got["error"] is None, got
    assert got["ran"] == [{"name": "get_weather", "input": {"city": "Paris"}}] and got["rounds"] == 2
    assert got["roles"] == ["user", "assistant", "tool", "assistant"]
    # the echo model answers the last user turn, which Qwen2.5's template makes of a tool result
    assert got["final_content"] == got["final_text"] == "<tool_response>\n20 C\n</tool_response>"
    assert got["finish_reason"] == "stop" and got["calls"] == []
    assert got["text"] == "Let me look." + got["final_content"]  # both rounds' content deltas


def test_anthropic_sdk_final_message_has_the_tool_use_blocks_and_their_inputs(servers):
    messages = [{"role": "user", "content": TWO}]
    got = node(
        "anthropic_messages_stream", servers["echo"].port, messages=messages, tools=ANTHROPIC_TOOLS, max_tokens=120
    )
    assert got["error"] is None, got
    assert got["finish_reason"] == "tool_use" and got["blocks"] == ["text", "tool_use", "tool_use"]
    assert [(c["name"], c["input"]) for c in got["calls"]] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert all(c["id"].startswith("toolu_") for c in got["calls"])
    assert got["text"] == got["final_text"] == "Both." and got["input_json_deltas"] > 2
    assert got["event_types"]["content_block_start"] == got["event_types"]["content_block_stop"] == 3


def test_openai_sdk_responses_function_call_items_streamed_whole_and_resumed(servers):
    port = servers["echo"].port
    got = node(
        "responses_stream", port, input=SAY, tools=RESPONSES_TOOLS, max_output_tokens=80, whole=True, resume_after=3
    )
    assert got["error"] is None, got
    assert got["final_type"] == "response.completed" and got["status"] == "completed"
    assert got["text"] == got["final_text"] == got["whole_text"] == "Let me look."
    assert [(c["name"], c["input"]) for c in got["calls"]] == [("get_weather", {"city": "Paris"})]
    assert [(c["name"], c["input"]) for c in got["whole_calls"]] == [("get_weather", {"city": "Paris"})]
    assert got["calls"][0]["call_id"].startswith("call_")
    types = got["event_types"]
    assert types["response.function_call_arguments.done"] == 1 and types["response.function_call_arguments.delta"] > 1
    assert types["response.output_item.added"] == types["response.output_item.done"] == 2
    assert got["sequence_numbers"] == list(range(got["events"]))
    helper = got["resumed"]["helper"]
    assert helper["same_events"] and got["resumed"]["retrieve"]["same_events"] and helper["final_status"] == "completed"


# provider: its own finish reason for calls (@ai-sdk/openai reads Responses' only from incomplete_details)
TOOL_PROVIDERS = {
    "openai-compatible": "tool_calls",
    "anthropic": "tool_use",
    "openai": None,
    "openai-chat": "tool_calls",
}


@pytest.mark.parametrize("provider", TOOL_PROVIDERS)
def test_ai_sdk_stream_text_with_tools_gives_tool_call_parts(servers, provider):
    messages = [{"role": "user", "content": SAY}]
    got = node(
        "ai_stream_text",
        servers["echo"].port,
        provider=provider,
        messages=messages,
        tools=AI_SDK_TOOLS,
        maxOutputTokens=80,
    )
    assert got["error"] is None and "warnings" not in got, got
    assert [(c["name"], c["input"]) for c in got["calls"]] == [("get_weather", {"city": "Paris"})]
    assert got["finish_reason"] == "tool-calls" and got.get("raw_finish_reason") == TOOL_PROVIDERS[provider]
    assert got["text"] == "Let me look." and got["event_types"]["tool-call"] == 1
    assert got["event_types"]["tool-input-start"] == got["event_types"]["tool-input-end"] == 1
    assert got["event_types"]["tool-input-delta"] > 1 and got["usage"]["output"] > 0
