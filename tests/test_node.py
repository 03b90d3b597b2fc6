"""The Node SDKs are judges too: OpenAI's and Anthropic's, the AI SDK with its providers, and the
`eventsource` package, each run by a small script in tests/node/ against the session's servers.

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
PROMPT = "The lighthouse keeper wrote in his log"  # eventsource_stream.mjs's default prompt


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

PROVIDERS = {  # provider: (the whole answer to compare with, its own finish reason)
    "openai-compatible": (lambda port: openai_whole(port)["choices"][0]["message"]["content"], "length"),
    "anthropic": (lambda port: anthropic_whole(port)["content"][0]["text"], "max_tokens"),
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


# --- the Responses API (/v1/responses) ---------------------------------------------------------------
# Not served yet. Once it is: a script responses_stream.mjs (openai's
# client.responses.create({stream: true}), its response.output_text.delta events and the
# response.completed usage), an "openai" entry in ai_stream_text.mjs's PROVIDERS (@ai-sdk/openai's
# createOpenAI, Responses by default) and in PROVIDERS above, and their tests here.
