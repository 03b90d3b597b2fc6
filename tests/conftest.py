"""Shared fixtures: the tests use the `tiny` model (real bundled tokenizer, random weights)
unless marked `bundled`, and every asyncio loop runs in debug mode."""

import os
import sys
from pathlib import Path

os.environ.setdefault("PYTHONASYNCIODEBUG", "1")
os.environ["LM_MODEL"] = "tiny"  # the default for in-process use; subprocess servers get --model

sys.path.insert(0, str(Path(__file__).parent))

import lm  # noqa: E402

lm.configure(model="tiny")

import pytest  # noqa: E402
from helpers import ServerProcess  # noqa: E402

# Servers started once per test session, all at once (each takes a few seconds to import torch).
SERVERS = {
    "plain": ("--ping", "0.3"),
    "slow": ("--token-delay", "0.02"),  # about 50 tokens a second: time to leave mid-answer
    "naive": ("--naive", "--token-delay", "0.02"),
    "failing": ("--fail-after", "5", "--request-timeout", "1"),
    "quiet": ("--token-delay", "0.6", "--ping", "0.2"),  # long silences between pieces
    "keyed": ("--api-key", "sekrit"),
    "exact": ("--model", "exact"),  # logits exact in any batch and dtype: equal texts are a real assertion
    # answers with the user's message: a scripted answer (tool calls, test_tools.py). 5 ms a token:
    # at full speed a loaded machine's loop could fall behind and send a call's few argument tokens
    # in one event (the SDKs' "tool-input-delta > 1" failed 1 run in the full suite, never alone)
    "echo": ("--model", "echo", "--token-delay", "0.005"),
    # resumable streams: a short grace and memory, so the tests can watch both run out
    "resuming": ("--token-delay", "0.03", "--resume-grace", "1", "--resume-keep", "2"),
    "dropping": ("--token-delay", "0.02", "--drop-after", "8"),  # the network blinks every 8 events
}


@pytest.fixture(scope="session")
def servers():
    started = {name: ServerProcess(*args) for name, args in SERVERS.items()}
    try:
        yield {name: s.wait() for name, s in started.items()}
    finally:
        for s in started.values():
            s.stop()
