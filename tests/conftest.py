"""Shared fixtures: the tests use the `tiny` model (real bundled tokenizer, random weights)
unless marked `bundled`, and every asyncio loop runs in debug mode."""

import os

os.environ.setdefault("PYTHONASYNCIODEBUG", "1")
os.environ["LM_MODEL"] = "tiny"  # the default for in-process use; subprocess servers get --model

import lm  # noqa: E402

lm.configure(model="tiny")
