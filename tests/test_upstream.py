"""--engine upstream: this server in front of OpenAI-compatible engines. The upstreams are real
servers: this project's own (its /log says how many tokens it generated after a reader left) and
`transformers serve` on a small model folder. Text equal to the upstream's, leaving closes the
upstream request, errors before and after the headers, retry before the first byte, and an
upstream taken out and probed back."""

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import anthropic
import openai
import pytest
from helpers import ServerProcess, WSClient, connect, events, http, metrics, server_log, stream_texts, wait_for_log

from streaming.launch import Process, free_port
from streaming.replicas import when

MESSAGES = [{"role": "user", "content": "The lighthouse keeper wrote in his log"}]
PROMPT = MESSAGES[0]["content"]


@pytest.fixture(scope="module")
def upstream():
    """The exact model (text fixed by the prompt, greedy or sampled by seed), 20 tokens a second."""
    with ServerProcess("--model", "exact", "--token-delay", "0.05") as s:
        yield s.wait()


@pytest.fixture(scope="module")
def front(upstream):
    with ServerProcess("--engine", "upstream", "--upstream", f"http://127.0.0.1:{upstream.port}/v1") as s:
        yield s.wait()


def direct(upstream, n=20, seed=4, temperature=0, top_p=0.9):
    body = {
        "model": "x",
        "messages": MESSAGES,
        "max_tokens": n,
        "seed": seed,
        "temperature": temperature,
        "top_p": top_p,
    }
    status, _, raw = http(upstream.port, "POST", "/v1/chat/completions", body)
    assert status == 200
    return json.loads(raw)["choices"][0]["message"]["content"]


def test_every_endpoint_relays_the_upstreams_text(upstream, front):
    expected = direct(upstream)
    body = {"prompt": PROMPT, "max_tokens": 20, "seed": 4, "temperature": 0}
    status, _, raw = http(front.port, "POST", "/complete", body)
    assert status == 200 and json.loads(raw)["text"] == expected
    texts, done = stream_texts(http(front.port, "POST", "/stream", body)[2])
    assert done and "".join(texts) == expected and len(texts) > 1  # streamed piece by piece
    ws = WSClient(front.port)
    ws.send_json(body)
    messages, code = ws.until_close()
    ws.close()
    assert code == 1000 and "".join(m.get("text", "") for m in messages) == expected
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{front.port}/v1", api_key="none")
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=MESSAGES,
            max_tokens=20,
            seed=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens > 0  # the upstream's counts
    claude = anthropic.Anthropic(base_url=f"http://127.0.0.1:{front.port}", api_key="none")
    with claude.messages.stream(model="any", max_tokens=20, messages=MESSAGES) as st:
        assert "".join(st.text_stream) == direct(upstream, seed=0, temperature=1, top_p=1.0)  # Anthropic's defaults
        usage = st.get_final_message().usage
    assert usage.output_tokens == 20 and usage.input_tokens > 0  # the upstream's prompt count, at the end
    sampled = direct(upstream, seed=9, temperature=1)
    status, _, raw = http(front.port, "POST", "/complete", dict(body, seed=9, temperature=1))
    assert json.loads(raw)["text"] == sampled  # the seed goes upstream too
    assert metrics(front.port)["upstreams"][0]["served"] >= 5


def test_a_reader_leaving_closes_the_upstream_request(upstream, front):
    before = len(server_log(upstream.port))
    after_stop = metrics(upstream.port)["tokens_after_stop"]
    s = connect(front.port)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}).encode()
    s.sendall(b"POST /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n")
    s.sendall(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    raw = b""
    while raw.count(b"data: {") < 10:
        data = s.recv(65536)
        assert data, raw
        raw += data
    s.close()
    entry = wait_for_log(upstream.port, before + 1)[before]
    assert entry[0] == "/v1/chat/completions" and entry[2] is True  # the upstream saw its reader leave
    assert entry[1] <= 10 + 3  # what was read, plus at most a step or two in flight (not 200)
    assert metrics(upstream.port)["tokens_after_stop"] - after_stop <= 1  # it stopped within a step


def test_errors_before_the_headers_are_502_in_each_endpoints_shape():
    dead = free_port()
    with ServerProcess("--engine", "upstream", "--upstream", f"http://127.0.0.1:{dead}/v1") as s:
        s.wait()
        status, _, raw = http(s.port, "POST", "/complete", {"prompt": "a"})
        assert status == 502 and json.loads(raw)["error"]["type"] == "upstream_failed"
        message = json.loads(raw)["error"]["message"]
        assert message == "the upstream cannot be reached: Connection refused", message  # (its address is the log's)
        named = f"upstream http://127.0.0.1:{dead}/v1 failed (upstream http://127.0.0.1:{dead}/v1 cannot be reached"
        deadline = time.monotonic() + 10
        while not any(line.startswith(named) for line in s.lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(line.startswith(named) for line in s.lines), s.lines
        status, _, raw = http(s.port, "POST", "/v1/chat/completions", {"model": "m", "messages": MESSAGES})
        assert status == 502 and json.loads(raw)["error"]["type"] == "server_error"  # OpenAI's shape
        ws = WSClient(s.port)
        ws.send_json({"prompt": "a"})
        messages, code = ws.until_close()
        ws.close()
        assert code == 1011 and messages[-1]["error"]["status"] == 502
        status, _, raw = http(s.port, "GET", "/health")
        assert status == 200  # and it keeps serving


def test_an_upstreams_refusal_keeps_its_status_or_becomes_502():
    with ServerProcess("--api-key", "sekrit", "--model", "exact") as keyed:
        keyed.wait()
        argv = ("--engine", "upstream", "--upstream", f"http://127.0.0.1:{keyed.port}/v1", "--upstream-model", "m")
        with ServerProcess(*argv) as s:
            s.wait()
            status, _, raw = http(s.port, "POST", "/complete", {"prompt": "a"})
            assert status == 502 and "401" in json.loads(raw)["error"]["message"]  # our key is wrong: ours to fix
        with ServerProcess(*argv, "--upstream-key", "sekrit") as s:
            s.wait()
            assert http(s.port, "POST", "/complete", {"prompt": "a", "max_tokens": 3})[0] == 200


def test_a_failure_after_the_headers_is_an_error_event_and_a_close_1011():
    with ServerProcess("--model", "exact", "--fail-after", "5") as failing:
        failing.wait()
        with ServerProcess("--engine", "upstream", "--upstream", f"http://127.0.0.1:{failing.port}/v1") as s:
            s.wait()
            status, _, raw = http(s.port, "POST", "/stream", {"prompt": PROMPT, "max_tokens": 50})
            assert status == 200
            assert b"event: error" in raw and b"injected failure" in raw and b"[DONE]" not in raw
            ws = WSClient(s.port)
            ws.send_json({"prompt": PROMPT, "max_tokens": 50})
            messages, code = ws.until_close()
            ws.close()
            assert code == 1011 and any("text" in m for m in messages) and "error" in messages[-1]


def test_retry_before_the_first_byte_and_an_upstream_taken_out_and_probed_back(upstream):
    dead = free_port()
    urls = ["--upstream", f"http://127.0.0.1:{dead}/v1", "--upstream", f"http://127.0.0.1:{upstream.port}/v1"]
    with ServerProcess("--engine", "upstream", *urls) as s:
        s.wait()
        for _ in range(3):
            assert http(s.port, "POST", "/complete", {"prompt": "a", "max_tokens": 3})[0] == 200
        ups = metrics(s.port)["upstreams"]
        assert ups[0]["failures"] >= 1 and ups[0]["out_s"] > 0 and ups[1]["served"] == 3
        with ServerProcess("--model", "exact", "--port", str(dead)) as back:  # the upstream comes back
            back.wait()
            assert when(lambda: metrics(s.port)["upstreams"][0]["out_s"] == 0, 10)
            for _ in range(4):
                assert http(s.port, "POST", "/complete", {"prompt": "a", "max_tokens": 3})[0] == 200
            assert metrics(s.port)["upstreams"][0]["served"] >= 1
            assert any("is back" in line for line in s.lines)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    import lm
    from streaming.model.testing import tiny_model

    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model(lm.tok).save_pretrained(folder)
    lm.tok.save_pretrained(folder)
    return folder


def test_in_front_of_transformers_serve(tiny_folder):
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    if subprocess.run([exe, "serve", "--help"], capture_output=True).returncode != 0:
        pytest.skip("transformers serve needs transformers[serving] (the test extra installs it)")
    port = free_port()
    argv = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with Process("transformers serve", argv, port=port, stderr=True) as peer:
        peer.wait(120, check=lambda p: http(p, "GET", "/v1/models")[0] == 200 if accepts(p) else False)
        model = str(tiny_folder)
        body = {"model": model, "messages": MESSAGES, "max_tokens": 12, "temperature": 0, "stream": True}
        status, _, raw = http(port, "POST", "/v1/chat/completions", body)
        assert status == 200, raw
        chunks = [json.loads(e.data) for e in events(raw) if e.data != "[DONE]"]
        # (its whole answer, stream false, drops the first piece's leading space: the stream is what we relay)
        expected = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        argv = ("--engine", "upstream", "--upstream", f"http://127.0.0.1:{port}/v1", "--upstream-model", model)
        with ServerProcess(*argv) as s:
            s.wait()
            body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
            texts, done = stream_texts(http(s.port, "POST", "/stream", body)[2])
            assert done and "".join(texts) == expected


def accepts(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_bad_upstream_options_are_usage_errors():
    for argv, said in (
        (["--engine", "upstream"], "go together"),
        (["--upstream", "http://x/v1"], "go together"),
        (["--engine", "upstream", "--upstream", "ftp://x"], "http:// or https://"),
    ):
        p = subprocess.run([sys.executable, "server.py", *argv], capture_output=True, text=True)
        assert p.returncode == 2 and said in p.stderr, p.stderr
    assert time.monotonic() > 0


def test_an_upstream_that_does_not_speak_http_is_a_502_not_a_400():
    """The parser's complaint is about the upstream, not the reader: 502, and no Python text."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_nonsense():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"SPDY/9 what\r\n\r\n")

    threading.Thread(target=answer_nonsense, daemon=True).start()
    try:
        with ServerProcess("--engine", "upstream", "--upstream", f"http://127.0.0.1:{port}/v1") as s:
            s.wait()
            status, _, raw = http(s.port, "POST", "/complete", {"prompt": "a"})
            error = json.loads(raw)["error"]
            assert status == 502 and error["type"] == "upstream_failed" and "broken answer" in error["message"]
    finally:
        listener.close()


def test_the_upstream_is_asked_with_the_requests_cache_salt_and_ignore_eos_only_when_set():
    """vLLM reads both: a salted request keeps its tenant apart in the upstream's prefix cache too."""
    from streaming.generation.upstream import asking
    from streaming.wire.params import GenerationParams

    plain = json.loads(asking.body("m", GenerationParams(), None, MESSAGES))
    assert "cache_salt" not in plain and "ignore_eos" not in plain
    salted = json.loads(asking.body("m", GenerationParams(cache_salt="s3cret", ignore_eos=True), None, MESSAGES))
    assert salted["cache_salt"] == "s3cret" and salted["ignore_eos"] is True


def test_a_prefill_is_continued_by_the_upstream_too_with_the_text_so_far_inside_it():
    """Anthropic's prefill (a last assistant message) was sent as a closed turn, so the upstream
    began a new one after it; and a stream taken over then sent two assistant messages in a row."""
    from streaming.generation.prompts import Prompt
    from streaming.generation.upstream import asking
    from streaming.wire.params import GenerationParams

    chat = [*MESSAGES, {"role": "assistant", "content": "Lighthouses"}]
    prompt = Prompt(None, tuple(chat), True)
    asked = json.loads(asking.body("m", GenerationParams(), prompt, chat))
    assert asked["messages"] == chat and asked["continue_final_message"] is True
    assert asked["add_generation_prompt"] is False
    again = json.loads(asking.body("m", GenerationParams(), prompt, chat, so_far=" guide", produced=1))
    assert again["messages"] == [*MESSAGES, {"role": "assistant", "content": "Lighthouses guide"}]
