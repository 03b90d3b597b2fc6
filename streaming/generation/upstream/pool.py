"""The upstreams of --engine upstream: which to ask, which to leave out, and how they fail.

- Choosing: the upstream with the fewest requests in flight; one that failed is taken out for
  TAKE_OUT seconds (doubling while it keeps failing, to MAX_OUT) and a probe (GET /models) brings
  it back early once it answers.
- Failing: `UpstreamError` carries the status our endpoint answers (502 unreachable, a 5xx or a
  broken answer; 503 overloaded: 429/503; 504 no answer in time; an upstream's 400, 413 or 422,
  about the request, keeps its status) and whether another upstream may do better (any other
  refusal is the upstream's: a redirect, a 401 for a wrong key, a 404 for a model it lacks, so
  it is taken out and the next one asked).
- Naming: an upstream is shown (log, /metrics.json) without the user and password of its URL,
  which are sent as Basic credentials where no --upstream-key is given.

Leaves out: weights, sticky sessions, and health beyond "it answers GET /models".
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, unquote, urlsplit

from streaming import http_client
from streaming.http_client import failure
from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Response
from streaming.wire.openai import error_text

CONNECT_TIMEOUT = 5.0  # seconds to connect to an upstream (and for a probe's answer) before trying the next
# A small GET (a probe, /models) whole, head and body: its reads each within CONNECT_TIMEOUT were no
# bound on the whole, and an upstream trickling a byte every few seconds held /models (and every
# request waiting on the model's name) for hours.
GET_TIMEOUT = 10.0
# An upstream's answer must show life within FIRST_TEXT seconds of the request (its head, any
# comments and empty chunks included: a long prompt's prefill, or a wait in a loaded engine's
# queue, fits), and then never go more than SILENCE seconds without it; past either it is a 504
# (before any text) or the answer's error event. Life is a chunk whose delta carries something
# (text, a reasoning model's reasoning, a tool call); pings do not count: an upstream that sends
# only comments would otherwise hold its reader forever.
FIRST_TEXT = 60.0
SILENCE = 30.0
TAKE_OUT = 2.0  # seconds a failed upstream is left out at first, doubling while it keeps failing
MAX_OUT = 60.0
PROBE_EVERY = 1.0  # seconds between probes of the upstreams left out
ERROR_BODY = 64 * 1024  # bytes of an upstream's error answer (or a probe's) read for its message
OVERLOADED = {429, 503}
THE_READERS = {400, 413, 422}  # refusals of the request itself: no other upstream would take it


class UpstreamError(Exception):
    """An upstream failed a request: `status` is what our endpoint answers, `retry` whether
    another upstream may do better."""

    def __init__(self, message: str, status: int = 502, retry: bool = True, url: str | None = None) -> None:
        """`url`: the upstream that failed, which str() names before `message` (for the log)."""
        super().__init__(f"upstream {url} {message}" if url else message)
        self.status, self.retry, self.url, self.message = status, retry, url, message

    def protocol(self) -> ProtocolError:
        """As the reader is told it: the upstream unnamed (its address, any user:password in it,
        is the operator's: the log names it)."""
        kind = {502: "upstream_failed", 503: "upstream_overloaded", 504: "upstream_timeout"}.get(self.status)
        told = f"the upstream {self.message}" if self.url else self.message
        return ProtocolError(told, self.status, close_code=1011, kind=kind)


@dataclass
class Upstream:
    url: str  # as shown: its user and password left out (they go in `basic`)
    in_flight: int = 0
    out_until: float = 0.0  # time.monotonic() before which it is left out
    out_for: float = 0.0  # its present take-out period
    served: int = 0
    failures: int = 0
    parts: SplitResult = field(init=False)
    basic: str | None = field(init=False)  # the URL's user:password, as an Authorization value

    def __post_init__(self) -> None:
        self.parts = urlsplit(self.url.rstrip("/"))
        self.basic = None
        if self.parts.username is not None or self.parts.password is not None:
            pair = f"{unquote(self.parts.username or '')}:{unquote(self.parts.password or '')}"
            self.basic = "Basic " + base64.b64encode(pair.encode()).decode()
        self.url = self.parts._replace(netloc=self.host).geturl()
        if self.parts.scheme not in ("http", "https") or not self.parts.hostname:
            raise ValueError(f"{self.url!r}: an upstream is an http:// or https:// URL, e.g. http://host:8000/v1")

    @property
    def host(self) -> str:
        return self.parts.netloc.rpartition("@")[2]

    def status(self) -> dict[str, Any]:
        out = max(0.0, self.out_until - time.monotonic())
        return {
            "url": self.url,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "out_s": round(out, 1),
        }


async def connect(u: Upstream) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        return await http_client.connect(u.parts, CONNECT_TIMEOUT)
    except asyncio.TimeoutError:
        raise UpstreamError(f"did not accept a connection in {CONNECT_TIMEOUT:g} s", 504, url=u.url) from None
    except OSError as e:
        raise UpstreamError(f"cannot be reached: {failure(e)}", url=u.url) from None


def request_bytes(u: Upstream, method: str, path: str, body: bytes | None, key: str | None) -> bytes:
    fields = [("Accept", "text/event-stream")]
    if key:
        fields.append(("Authorization", f"Bearer {key}"))
    elif u.basic:
        fields.append(("Authorization", u.basic))
    if body is not None:
        fields.append(("Content-Type", "application/json"))
    return http_client.request_bytes(method, f"{u.parts.path}{path}", u.host, fields, body)


async def get(u: Upstream, path: str, key: str | None) -> tuple[Response, bytes]:
    """A small GET's head and body (the probe, /models), within CONNECT_TIMEOUT each step and
    GET_TIMEOUT in all (past it a 504)."""
    try:
        return await asyncio.wait_for(get_within(u, path, key), GET_TIMEOUT)
    except asyncio.TimeoutError:
        raise UpstreamError(f"did not answer GET {path} in {GET_TIMEOUT:g} s", 504, url=u.url) from None


async def get_within(u: Upstream, path: str, key: str | None) -> tuple[Response, bytes]:
    reader, writer = await connect(u)
    try:
        writer.write(request_bytes(u, "GET", path, None, key))
        reply = http_client.Reply(reader, CONNECT_TIMEOUT)
        head = await asyncio.wait_for(reply.read_head(), CONNECT_TIMEOUT)
        return head, await reply.body(ERROR_BODY)
    finally:
        writer.transport.abort()  # close() would wait for bytes an upstream that reads nothing never takes


def error_message(body: bytes) -> str:
    """An upstream's error answer in a line: its JSON's message (OpenAI's error.message, FastAPI's
    detail), else the JSON, else its text (openai.error_text's bound and form)."""
    try:
        err = json.loads(body)
        inner = err.get("error", err) if isinstance(err, dict) else err
        found = (inner.get("message") if isinstance(inner, dict) else None) or (
            err.get("detail") if isinstance(err, dict) else None
        )
        return error_text(found if found is not None else json.dumps(err))  # (a JSON string body: quoted, as before)
    except (ValueError, RecursionError):  # not JSON, or nested past Python's recursion limit
        return error_text(body.decode("utf-8", "replace"))


def refusal(u: Upstream, status: int, body: bytes) -> UpstreamError:
    """An upstream's non-200 answer as our error: its message, our status. Only a refusal of the
    request itself is the reader's; any other (a redirect, 401, 403, 404, 405, 501, a 5xx) says
    the upstream cannot serve: another may (taken out, the next one asked)."""
    message = error_message(body)
    if status in THE_READERS:
        return UpstreamError(f"the upstream refused the request: {message}", status, retry=False)
    return UpstreamError(f"answered {status}: {message}", 503 if status in OVERLOADED else 502, url=u.url)


# What a probe or a /models request may fail with: the connection, the parser, silence.
PROBE_FAILURES = (UpstreamError, ProtocolError, OSError, asyncio.TimeoutError)


class Pool:
    """The upstreams: least in flight first, failed ones left out and probed back."""

    def __init__(
        self,
        urls: list[str],
        key: str | None = None,
        model: str | None = None,
        first_text: float = FIRST_TEXT,
        silence: float = SILENCE,
    ) -> None:
        if not urls:
            raise ValueError("--engine upstream needs at least one --upstream URL")
        self.upstreams = [Upstream(u) for u in urls]
        self.key, self.model = key, model
        self.first_text, self.silence = first_text, silence
        self.prober: asyncio.Task[None] | None = None

    def order(self) -> list[Upstream]:
        """Those to try, in order: the ones in, fewest in flight first; then the ones out, soonest back first."""
        now = time.monotonic()
        ins = sorted((u for u in self.upstreams if u.out_until <= now), key=lambda u: u.in_flight)
        outs = sorted((u for u in self.upstreams if u.out_until > now), key=lambda u: u.out_until)
        return ins + outs

    def failed(self, u: Upstream, e: UpstreamError) -> None:
        u.failures += 1
        if e.retry:  # a request the upstream refused as the reader's (400, 413, 422) says nothing of its health
            u.out_for = min(MAX_OUT, u.out_for * 2 or TAKE_OUT)
            u.out_until = time.monotonic() + u.out_for
            print(f"upstream {u.url} failed ({e}): left out for {u.out_for:g} s", file=sys.stderr, flush=True)
        if self.prober is None or self.prober.done():
            self.prober = asyncio.get_running_loop().create_task(self.probe())

    def worked(self, u: Upstream) -> None:
        if u.out_for:
            print(f"upstream {u.url} is back", flush=True)
        u.out_for, u.out_until = 0.0, 0.0

    async def probe(self) -> None:
        """While some upstream is out: ask each GET /models; one that answers 200 is back."""
        while any(u.out_until > time.monotonic() for u in self.upstreams):
            await asyncio.sleep(PROBE_EVERY)
            for u in [u for u in self.upstreams if u.out_until > time.monotonic()]:
                try:
                    head, _ = await get(u, "/models", self.key)
                except PROBE_FAILURES:
                    continue
                if head.status == 200:
                    self.worked(u)

    async def model_name(self) -> str:
        """--upstream-model, else the first model the upstreams list."""
        if self.model is None:
            for u in self.order():
                try:
                    head, body = await get(u, "/models", self.key)
                    if head.status == 200:
                        self.model = json.loads(body)["data"][0]["id"]
                        break
                except (*PROBE_FAILURES, ValueError, LookupError, TypeError, RecursionError):
                    continue
        return self.model or "default"

    def status(self) -> list[dict[str, Any]]:
        return [u.status() for u in self.upstreams]
