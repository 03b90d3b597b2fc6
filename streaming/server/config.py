"""Every setting of a server, as one frozen value made from the command line (server.py).

Leaves out the model's settings (--model, --device, --dtype, --quantize), which lm.configure
takes (streaming/model/choice.py), since the scripts that load a model without a server take
them too.
"""

from __future__ import annotations

from dataclasses import dataclass

from streaming.generation.batched import MAX_BATCH, MAX_WAITING, PREFILL_CHUNK
from streaming.generation.job import JobOptions
from streaming.generation.kv import KV_MEMORY
from streaming.generation.policy import PREFILL_BUDGET
from streaming.generation.prefixes import RETAIN_MEMORY
from streaming.generation.speculation import SPECULATE
from streaming.generation.upstream.pool import FIRST_TEXT, SILENCE
from streaming.server.answer import LOG_KEEP
from streaming.server.merging import Merging
from streaming.server.resumable.recordings import GRACE_SECONDS, KEEP_COUNT, KEEP_SECONDS, ORPHANS
from streaming.wire.http11 import REQUEST_TIMEOUT

WRITE_TIMEOUT = 30.0  # seconds a write may wait for a reader before it is dropped
PING_SECONDS = 15.0  # a keep-alive after this long without an event: under proxies' 60 s idle timeouts
BACKLOG = 1024  # connections the kernel queues before accept: asyncio's 100 drops a burst's connects
BODY_MEMORY = 64 * 1024 * 1024  # bytes all request bodies still arriving may hold together: 503 past it
SHUTDOWN_GRACE = 30.0  # seconds in-flight answers may take to finish after SIGTERM
KEEPALIVE_TIMEOUT = 5.0  # seconds an idle keep-alive connection waits for its next request (uvicorn's 5)
KEEPALIVE_REQUESTS = 1000  # requests on one connection, then it closes (nginx's keepalive_requests)
SHUTDOWN_END = (
    5.0  # seconds the answers cut at the grace's end have to write their end (an error) before they are dropped
)


@dataclass(frozen=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8765  # 0 picks a free port (printed)
    naive: bool = False  # the article's naive server: never notices a reader leaving
    engine: str = "batched"  # batched, thread, free or upstream (streaming.generation.backend.ENGINES)
    max_batch: int = MAX_BATCH
    max_waiting: int = MAX_WAITING  # requests waiting for a place in the batch: past it 503 with Retry-After
    # bytes of KV cache the batch may come to hold: past it a request waits (None: sized for the
    # model's device by the engine, kv.default_kv_memory)
    kv_memory: int | None = KV_MEMORY
    retain_memory: int = RETAIN_MEMORY  # bytes of ended answers' keys and values kept for a next turn
    prefill_chunk: int = PREFILL_CHUNK
    prefill_budget: int = PREFILL_BUDGET
    speculate: int = SPECULATE  # guessed tokens a small decode step may carry (speculation.py)
    schedule: str = "qoe"  # or fifo (streaming.generation.policy): qoe measured better for readers in bursts
    queue: int = 0  # thread engine: bound each request's queue to N pieces
    write_timeout: float = WRITE_TIMEOUT
    ping: float = PING_SECONDS
    stream_interval: int = 1  # pieces per event after the first (vLLM's --stream-interval); per request too
    stream_merge: str = "adaptive"  # or off: join pieces already waiting for a reader who is behind (merging.py)
    request_timeout: float = REQUEST_TIMEOUT
    allow_origin: tuple[str, ...] = ()  # browser Origins allowed to open /ws (* for any)
    allow_host: tuple[str, ...] = ()  # Host names accepted besides the loopback's (* for any)
    api_key: str | None = None  # required on every endpoint but the page when set
    served_model_name: str | None = None  # the model's id on /v1/ (default: its short name)
    backlog: int = BACKLOG
    body_memory: int = BODY_MEMORY
    shutdown_grace: float = SHUTDOWN_GRACE
    shutdown_end: float = SHUTDOWN_END
    log_keep: int = LOG_KEEP  # answers GET /log keeps (the latest)
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    keepalive_requests: int = KEEPALIVE_REQUESTS
    token_delay: float = 0.0  # testing: sleep S s after each token
    fail_after: int | None = None  # testing: fail generation after N tokens
    first_delay: float = 0.0  # testing: S s of silence before the first token
    drop_after: int = 0  # testing: drop a resumable stream's connection every N events
    resume_grace: float = GRACE_SECONDS
    resume_keep: float = KEEP_SECONDS
    resume_streams: int = KEEP_COUNT
    resume_orphans: int = ORPHANS
    upstream: tuple[str, ...] = ()  # --engine upstream: OpenAI-compatible base URLs (http://host:8000/v1)
    upstream_key: str | None = None  # sent as `Authorization: Bearer` to the upstreams
    upstream_model: str | None = None  # the model to ask them for (default: the first they list)
    upstream_first_text: float = FIRST_TEXT  # seconds an upstream may take to its first text: then 504
    upstream_silence: float = SILENCE  # seconds an upstream may go without text mid-answer: then an error event
    store: str = "memory"  # or redis://HOST:PORT/DB: resumable streams shared by replicas (resumable/store.py)

    @property
    def replicated(self) -> bool:
        """Resumable streams are shared with other replicas (through Redis)."""
        return self.store != "memory"

    def job_options(self) -> JobOptions:
        return JobOptions(self.queue, self.token_delay, self.fail_after, self.first_delay)

    def merging(self, interval: int | None = None) -> Merging:
        """How one streamed answer's pieces become events: the request's interval, else the server's."""
        return Merging(interval or self.stream_interval, adaptive=self.stream_merge == "adaptive")
