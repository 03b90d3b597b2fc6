"""The page and the status endpoints: GET / (page.html), GET /log, GET /metrics.

/log is the record of finished requests, a list of [path, generated_tokens, client_left_early];
/metrics is JSON: the model, the counts of requests, generations and connections, and the
engine's own. Leaves out Prometheus' format.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lm
from streaming.server.connection import Connection
from streaming.wire.http11 import Request, json_response, response

if TYPE_CHECKING:
    from streaming.server.app import Server

PAGE = Path(__file__).with_name("page.html")


def model_facts() -> dict[str, Any]:
    return {
        "model": lm.model_name(),
        "device": lm.DEVICE,
        "dtype": str(lm.dtype()).removeprefix("torch."),
        "quantize": lm.quantization(),
    }


async def page(_srv: Server, conn: Connection, _request: Request) -> None:
    body = await asyncio.to_thread(PAGE.read_bytes)
    conn.write(response(200, body, "text/html; charset=utf-8", [("Cache-Control", "no-cache")]))


async def log(srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(json_response(200, srv.log))


async def metrics(srv: Server, conn: Connection, _request: Request) -> None:
    conn.write(json_response(200, srv.metrics()))
