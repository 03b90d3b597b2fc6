"""The article's streaming server: HTTP/1.1, SSE and WebSocket on asyncio, no framework.

    python server.py [--naive] [--host 127.0.0.1] [--port 8765] [--model NAME] ...

POST /complete answers with the whole text as JSON at the end; POST /stream sends server-sent
events, `data: {"text": piece}` per piece then `data: [DONE]`; GET /ws opens a WebSocket
(first message {"prompt", "max_tokens"}, then {"text"} messages, {"done": true}, a close 1000;
the client may send {"stop": true}). GET /log is the record of finished requests; GET /metrics
counts what is running now. GET / is the browser page; GET /stream?prompt=... is the stream for
EventSource, resumable with Last-Event-ID, and POST /stop stops such a stream. /v1/ speaks
OpenAI's and Anthropic's APIs.

This file is the command line only: it parses the options into a `Config`, loads the model, and
serves. The server itself is the `streaming` package (streaming/server/ for the endpoints,
streaming/generation/ for the engines, streaming/model/ for the model, streaming/wire/ for the
formats on the wire; the README's Layout lists every module).
"""

import argparse
import asyncio
import sys

import lm
from streaming.generation.backend import ENGINES
from streaming.generation.batched import (
    BF16_CPU_MAX_BATCH,
    GPU_MAX_BATCH,
    MAX_BATCH,
    MAX_WAITING,
    PREFILL_CHUNK,
    default_max_batch,
)
from streaming.generation.kv import GPU_KV_SHARE, KV_MEMORY
from streaming.generation.policy import PREFILL_BUDGET, SCHEDULES
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.speculation import MAX_SPECULATE, SPECULATE
from streaming.generation.upstream.pool import FIRST_TEXT, SILENCE, Upstream
from streaming.lossy import outlive_readers
from streaming.model.loading import load_and_say
from streaming.options import AT_LEAST_ONE, COUNT, PAUSE, PORT, SECONDS, number
from streaming.server.answer import LOG_KEEP
from streaming.server.config import (
    BACKLOG,
    BODY_MEMORY,
    KEEPALIVE_REQUESTS,
    KEEPALIVE_TIMEOUT,
    PING_SECONDS,
    SHUTDOWN_END,
    SHUTDOWN_GRACE,
    WRITE_TIMEOUT,
    Config,
)
from streaming.server.merging import MODES
from streaming.server.resumable.recordings import GRACE_SECONDS, KEEP_COUNT, KEEP_SECONDS, ORPHANS
from streaming.server.serve import serve
from streaming.wire.http11 import MAX_BODY, REQUEST_TIMEOUT
from streaming.wire.params import MAX_STREAM_INTERVAL


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--naive", action="store_true", help="the article's naive server: never notices a reader leaving")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=PORT, default=8765, help="the port to listen on; 0 picks a free one (printed)")
    lm.add_arguments(p)
    engine_options(p.add_argument_group("generation"))
    limit_options(p.add_argument_group("limits and timeouts"))
    access_options(p.add_argument_group("who may use it"))
    resume_options(p.add_argument_group("resumable streams"))
    testing_options(p.add_argument_group("testing and experiments"))
    args = p.parse_args(argv)
    if args.queue and args.engine in ("batched", "process"):
        p.error("--queue bounds a generation thread; use it with --engine thread")
    if (args.engine == "upstream") != bool(args.upstream):
        p.error("--engine upstream and --upstream URL go together")
    for url in args.upstream:
        try:
            Upstream(url)
        except ValueError as e:
            p.error(str(e))
    return args


def engine_options(g):
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="batched",
        help="batched: one thread steps every request at once; process: the same in a process of its own "
        "(the event loop never runs the model's Python); thread: the article's thread per "
        "request; free: no model, ' x' pieces at once (measures the server's own cost per event); "
        "upstream: relay OpenAI-compatible engines (--upstream)",
    )
    upstream_options(g)
    g.add_argument(
        "--max-waiting",
        type=COUNT,
        default=MAX_WAITING,
        help="batched: requests that may wait for a place; past it 503 with Retry-After (a balancer tries another)",
    )
    batch_sizing_options(g)
    g.add_argument(
        "--prefill-chunk",
        type=AT_LEAST_ONE,
        default=PREFILL_CHUNK,
        help="batched: a longer prompt joins at most N tokens a step",
    )
    g.add_argument(
        "--prefill-budget",
        type=AT_LEAST_ONE,
        default=PREFILL_BUDGET,
        help="batched: prompt tokens that ride in a step's pass (a burst joins in a few steps)",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default="qoe",
        help="batched: fifo runs every row every step; qoe runs first the rows whose readers are about to wait",
    )
    g.add_argument(
        "--speculate",
        type=number(int, 0, MAX_SPECULATE),
        default=SPECULATE,
        help="batched: guessed tokens (looked up in each answer's own text) a step of a batch of at most N rows may carry "
        "and keep where the row's sampling agrees; 0: none",
    )
    g.add_argument("--queue", type=COUNT, default=0, help="thread engine: bound each request's queue to N pieces")
    g.add_argument(
        "--stream-interval",
        type=number(int, 1, MAX_STREAM_INTERVAL),
        default=1,
        help=f"text pieces per event after the first (1 to {MAX_STREAM_INTERVAL}; a request may say its own)",
    )
    g.add_argument(
        "--stream-merge",
        choices=MODES,
        default="adaptive",
        help="adaptive: pieces already waiting for a reader who is behind go as one event (never waits for text)",
    )
    g.add_argument("--served-model-name", default=None, help="the model's id on /v1/ (default: its short name)")


def upstream_options(g):
    g.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="upstream: an OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1 (repeat for several)",
    )
    g.add_argument("--upstream-key", default=None, help="upstream: sent as Authorization: Bearer KEY")
    g.add_argument("--upstream-model", default=None, help="upstream: the model to ask for (default: the first listed)")
    g.add_argument(
        "--upstream-first-text",
        type=SECONDS,
        default=FIRST_TEXT,
        help="upstream: 504 if its first text takes longer than S s (pings and empty chunks do not count)",
    )
    g.add_argument(
        "--upstream-silence",
        type=SECONDS,
        default=SILENCE,
        help="upstream: end the answer with an error after S s without text",
    )


def limit_options(g):
    g.add_argument(
        "--write-timeout", type=SECONDS, default=WRITE_TIMEOUT, help="drop a reader that takes nothing for S s"
    )
    g.add_argument("--ping", type=SECONDS, default=PING_SECONDS, help="keep-alive after S s without an event")
    g.add_argument("--request-timeout", type=SECONDS, default=REQUEST_TIMEOUT, help="408 if a request takes longer")
    g.add_argument("--backlog", type=number(int, 1, 65535), default=BACKLOG, help="connections queued before accept")
    # (under one whole body, a body of the size allowed waits for room that never comes: a 503 for good)
    bodies = number(int, MAX_BODY)
    g.add_argument(
        "--max-body-memory",
        type=bodies,
        default=BODY_MEMORY,
        help=f"bytes all arriving bodies may hold (>= {MAX_BODY})",
    )
    g.add_argument("--keepalive-timeout", type=SECONDS, default=KEEPALIVE_TIMEOUT, help="idle S s, then close")
    g.add_argument(
        "--keepalive-requests", type=AT_LEAST_ONE, default=KEEPALIVE_REQUESTS, help="requests on one connection"
    )
    g.add_argument("--shutdown-grace", type=PAUSE, default=SHUTDOWN_GRACE, help="on SIGTERM, let answers finish S s")
    g.add_argument(
        "--shutdown-end",
        type=PAUSE,
        default=SHUTDOWN_END,
        help="after the grace, S s for the answers cut short to write their end (an error); then they are dropped",
    )
    g.add_argument("--log-keep", type=AT_LEAST_ONE, default=LOG_KEEP, help="answers GET /log keeps (the latest N)")


def access_options(g):
    g.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        help="a page's Origin allowed to call the endpoints (CORS) and open /ws (repeat; * for any)",
    )
    g.add_argument(
        "--allow-host", action="append", default=[], help="a Host name accepted besides the loopback's (repeat; *)"
    )
    g.add_argument(
        "--api-key", default=None, help="required on every endpoint but the page (Bearer, x-api-key, ?api_key=)"
    )


def resume_options(g):
    g.add_argument("--resume-grace", type=PAUSE, default=GRACE_SECONDS, help="generate S s for a reader to come back")
    g.add_argument("--resume-keep", type=PAUSE, default=KEEP_SECONDS, help="keep an ended stream S s for resuming")
    g.add_argument("--resume-streams", type=COUNT, default=KEEP_COUNT, help="keep at most N ended streams")
    g.add_argument(
        "--resume-orphans", type=COUNT, default=ORPHANS, help="live streams nobody reads: past N, stop the oldest"
    )
    g.add_argument(
        "--store",
        type=store_url,
        default="memory",
        help="memory (this process only) or redis://HOST:PORT/DB: streams any replica can resume and take over",
    )


def batch_sizing_options(g):
    """The batch's size and KV budget: left out, sized for the model's device (config_of, the engine)."""
    g.add_argument(
        "--max-batch",
        type=AT_LEAST_ONE,
        default=None,
        help=f"batched: requests per step; more wait (default {MAX_BATCH}; {BF16_CPU_MAX_BATCH} in bfloat16 on a CPU"
        f" with native bfloat16, {GPU_MAX_BATCH} on CUDA)",
    )
    g.add_argument(
        "--kv-memory",
        type=number(float, 0, above=True),
        default=None,
        metavar="GIB",
        help="batched: KV cache the batch may come to hold, in GiB; a request that would pass it waits its turn "
        f"(default {KV_MEMORY / 2**30:g}, on CUDA {GPU_KV_SHARE:g} of the device's memory)",
    )
    g.add_argument(
        "--retain-memory",
        type=number(float, 0),
        default=RETAIN_MEMORY / 2**30,
        metavar="GIB",
        help="batched: ended answers' keys and values kept, in GiB, so that a conversation's next turn copies "
        f"the beginning it shares with them instead of computing it; 0 keeps none (default {RETAIN_MEMORY / 2**30:g})",
    )


def store_url(value):
    if value == "memory" or value.startswith(("redis://", "rediss://", "unix://")):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: give memory or a Redis URL (redis://HOST:PORT/DB)")


def testing_options(g):
    g.add_argument("--token-delay", type=PAUSE, default=0.0, help="sleep S s after each token")
    g.add_argument("--fail-after", type=COUNT, default=None, help="fail generation after N tokens")
    g.add_argument("--first-delay", type=PAUSE, default=0.0, help="S s of silence before the first token")
    g.add_argument("--drop-after", type=COUNT, default=0, help="drop a resumable stream's connection every N events")


def config_of(args, device=None):
    """The server's settings from parsed options (the model's go to lm.configure); what was left
    out sized for `device` (the model's: lm.DEVICE)."""
    device = device or lm.DEVICE
    names = Config.__dataclass_fields__
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(
        allow_origin=tuple(args.allow_origin), allow_host=tuple(args.allow_host), upstream=tuple(args.upstream)
    )
    # (the KV budget left out is sized by the engine, on the model's side: asking a GPU here would
    # give the server process a CUDA context of its own, with --engine process too)
    kv = int(args.kv_memory * 2**30) if args.kv_memory is not None else None
    batch = args.max_batch if args.max_batch is not None else default_max_batch(device, lm.dtype())
    retain = int(args.retain_memory * 2**30)
    return Config(**dict(values, body_memory=args.max_body_memory, kv_memory=kv, max_batch=batch, retain_memory=retain))


def load():
    """Load and warm up the model (in a thread, while the server already answers /ready)."""
    said = load_and_say(lm.handle())
    for _ in lm.tokens("Hello", 2):  # warm up, so the first request's time to first text is honest
        pass
    return said


def main(argv=None):
    outlive_readers()  # a closed log pipe drops lines, never a request or the exit (streaming/lossy.py)
    args = parse_args(argv)
    try:
        lm.configure(args)
    except lm.ModelError as e:
        sys.exit(f"error: {e}")
    config = config_of(args)
    # --engine upstream runs no model here: the upstreams do
    sys.exit(asyncio.run(serve(config, lm.handle(), None if config.engine == "upstream" else load)))


if __name__ == "__main__":
    main()
