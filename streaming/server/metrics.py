"""What operators scrape: GET /metrics in Prometheus' text format (prometheus_client encodes it).

Per server (its own registry): histograms of the time to first text by endpoint, of the gaps
between pieces, of the whole answer's time, of prompt and answer tokens; counters of requests by
endpoint and outcome (finished, reader_left, stopped, error) and of the tokens generated after a
stop; gauges, read at scrape time, of the requests generating and waiting and the open
connections. The same counts as JSON are at /metrics.json (what the tests and tools read).
Leaves out: per-model labels (one model a server) and the engine's internals.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from streaming.qoe import qoe

SECONDS = (0.025, 0.05, 0.1, 0.18, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # 0.18 s: a reader's pace
LONG_SECONDS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 32768)
QOE = (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
OUTCOMES = ("finished", "reader_left", "stopped", "error")
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, active: Callable[[], float], waiting: Callable[[], float], connections: Callable[[], float]):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "streaming_time_to_first_text_seconds",
            "From the request to its first text",
            ["endpoint"],
            registry=r,
            buckets=SECONDS,
        )
        self.gaps = Histogram("streaming_gap_seconds", "Between two pieces of one answer", registry=r, buckets=SECONDS)
        self.answer = Histogram(
            "streaming_answer_seconds",
            "From the request to its last piece",
            ["endpoint"],
            registry=r,
            buckets=LONG_SECONDS,
        )
        self.prompt_tokens = Histogram("streaming_prompt_tokens", "Tokens of a prompt", registry=r, buckets=TOKENS)
        self.answer_tokens = Histogram(
            "streaming_answer_tokens", "Tokens generated for a request", registry=r, buckets=TOKENS
        )
        self.requests = Counter("streaming_requests", "Requests that ended", ["endpoint", "outcome"], registry=r)
        self.qoe = Histogram(
            "streaming_qoe",
            "A finished answer's QoE as the reader felt it (Andes)",
            ["endpoint"],
            registry=r,
            buckets=QOE,
        )
        self.after_stop = Counter(
            "streaming_tokens_after_stop", "Tokens generated after a request was stopped (for nobody)", registry=r
        )
        self.store_errors = Counter(
            "streaming_store_errors", "Commands to the stream store (Redis) that failed", registry=r
        )
        self.takeovers = Counter(
            "streaming_streams_taken_over", "Streams this replica took over from one that died", registry=r
        )
        Gauge("streaming_requests_active", "Requests generating now", registry=r).set_function(active)
        Gauge("streaming_requests_waiting", "Requests waiting for a place in the batch", registry=r).set_function(
            waiting
        )
        Gauge("streaming_connections_open", "Open client connections", registry=r).set_function(connections)

    def ended(
        self,
        endpoint: str,
        outcome: str,
        arrivals: list[float],
        whole: bool,
        prompt_tokens: int,
        answer_tokens: int,
        after_stop: int,
    ) -> None:
        """One answer's figures, when it is logged: `arrivals`, when each piece reached the loop
        (seconds since the request). The QoE is the server's estimate: a piece is a token, sent when
        it reached the loop (`whole`, an answer sent at once: all of it at its last piece)."""
        if arrivals:
            self.ttft.labels(endpoint).observe(arrivals[0])
            self.answer.labels(endpoint).observe(arrivals[-1])
            pieces = [(t, 1.0) for t in arrivals] if not whole else [(arrivals[-1], float(len(arrivals)))]
            if outcome == "finished":  # a reader who left or stopped has no experience to rate
                self.qoe.labels(endpoint).observe(qoe(pieces))
        self.prompt_tokens.observe(prompt_tokens)
        self.answer_tokens.observe(answer_tokens)
        self.requests.labels(endpoint, outcome).inc()
        if after_stop:
            self.after_stop.inc(after_stop)

    def text(self) -> bytes:
        return generate_latest(self.registry)
