"""What the benchmarks share: the prompts, a percentile, the peer started, CPU time read, and
matplotlib where it is installed. No benchmark here, and no import of one (bench.py dispatches
to bench_qoe.py and bench_guidellm.py, which import this, not bench.py)."""

import asyncio
import os
import shutil
import sys
from pathlib import Path

import client
from streaming.generation.kv import KV_MEMORY
from streaming.launch import Process, free_port

PROMPTS = client.prompts()


def pct(values, q):
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


def answers(port):
    """Whether an OpenAI-compatible server on `port` answers GET /v1/models."""
    try:
        asyncio.run(client.get_json("/v1/models", port=port))
        return True
    except (OSError, ValueError, client.ServerError):
        return False


PEER_MEMORY = KV_MEMORY * 3 // 2  # the peer's budget for its KV cache and the attention masks it sizes with it


def peer_memory_percent() -> float:
    """The share of the machine's memory the peer may give its KV cache and masks: PEER_MEMORY.
    Left to itself, the peer on a CPU takes 60% of the machine's memory less its own, whatever
    else runs (its attention masks grow with the cache's tokens): beside three of this server's
    processes it reached 13 GB and was killed for memory. Our loads need far less cache than this
    (a burst of 48 readers holds about 20,000 tokens)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return round(min(0.6, PEER_MEMORY / total), 3)


def start_peer(folder, dtype, device="cpu"):
    """`transformers serve --continuous-batching` as a child, on a model folder, once it answers,
    its cache held to peer_memory_percent()."""
    port = free_port()
    exe = shutil.which("transformers") or str(Path(sys.executable).parent / "transformers")
    argv = [exe, "serve", str(folder), "--continuous-batching", "--dtype", dtype, "--device", device]
    argv += ["--cb-max-memory-percent", str(peer_memory_percent())]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    return Process("transformers serve", argv, port=port, stderr=True).wait(check=answers)  # its output if it fails


def cpu_seconds(pid):
    """A process's CPU time so far (user and system), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pyplot():
    """matplotlib's pyplot drawing to files, or None where matplotlib is missing (no picture)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
