"""Who may use the server, checked before any endpoint runs: the Host a request names (against
DNS rebinding), the API key, and JSON-only POSTs (against cross-site form posts).

A page on a rebinding domain (evil.example resolving to 127.0.0.1) reaches a server on the
loopback with `Host: evil.example:PORT`, so a server bound to a loopback address accepts only
the names that address is reached by (`127.0.0.1`, `localhost`, `[::1]`, on any port: a proxy in
front passes its own; the port is no defence anyway, a browser names the port it connects to),
plus `--allow-host` names; `*` accepts any (behind a proxy that checks them). Bound elsewhere it
accepts any host unless --allow-host names some. A browser sends a cross-site POST without a
preflight only as text/plain or a form; requiring `application/json` on every POST that carries
a body makes a preflight necessary, which CORS then refuses. With --api-key, every endpoint that
generates or reveals requests needs the key: `Authorization: Bearer KEY`, `x-api-key: KEY`, or
`?api_key=KEY` (for EventSource and WebSocket, which cannot set headers from a browser).
Leaves out: TLS, users, rate limits.
"""

from __future__ import annotations

import hmac
import ipaddress

from streaming.wire.errors import ProtocolError
from streaming.wire.http11 import Request
from streaming.wire.websocket import authority

LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def allowed_hosts(bind_host: str, extra: tuple[str, ...]) -> frozenset[str] | None:
    """The Host names accepted (lower-case, IPv6 without brackets), or None for any."""
    if "*" in extra:
        return None
    names = frozenset(name.lower().strip("[]") for name in extra)
    if loopback(bind_host):
        return LOOPBACK_NAMES | names
    return names or None


def loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_host(request: Request, allowed: frozenset[str] | None) -> None:
    """421 for a Host this server is not meant to be reached by; 400 for one that does not parse."""
    value = request.headers.get("host")
    if value is None:
        return  # HTTP/1.0 without Host: the parser allows it
    parsed = authority(value, 0)
    if parsed is None:
        raise ProtocolError("the Host header is malformed", 400)
    name, _ = parsed
    if allowed is not None and name not in allowed:
        message = f"this server is not reached as {value} (--allow-host adds a name)"
        raise ProtocolError(message, 421, kind="misdirected_request")


def check_key(request: Request, key: str | None) -> None:
    """401 unless the request carries the API key (header or query parameter)."""
    if not key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
    given = given or request.query.get("api_key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise ProtocolError(
            "invalid or missing API key (Authorization: Bearer, x-api-key, or ?api_key=)",
            401,
            headers=[("WWW-Authenticate", "Bearer")],
            code="invalid_api_key",
        )


def check_json(request: Request) -> None:
    """415 for a POST whose body is not declared as JSON (a cross-site form's can't be). A POST
    with no body has nothing to declare (the SDKs send POST .../cancel bare)."""
    if request.method != "POST" or not request.body:
        return
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise ProtocolError(
            "send the body as Content-Type: application/json", 415, headers=[("Accept", "application/json")]
        )


# --- CORS: --allow-origin governs which other origins' pages may call the HTTP endpoints ------

EXPOSED = "Content-Type, Retry-After, X-Accel-Buffering"  # what a streaming client may read
PREFLIGHT_SECONDS = "600"  # how long a browser may cache a preflight's answer


def origin_allowed(request: Request, allowed: tuple[str, ...]) -> bool:
    origin = request.headers.get("origin")
    return origin is not None and bool(allowed) and ("*" in allowed or origin in allowed)


def cors(request: Request, allowed: tuple[str, ...]) -> list[tuple[str, str]]:
    """The CORS header fields of an answer: with --allow-origin set, every answer varies by
    Origin (else a shared cache could hand one origin's answer to another); a page of an origin
    it lists (or *) may read the answer; any other origin's page may not (the browser keeps it)."""
    if not allowed:
        return []
    if not origin_allowed(request, allowed):
        return [("Vary", "Origin")]
    origin = request.headers["origin"]
    return [("Access-Control-Allow-Origin", origin), ("Vary", "Origin"), ("Access-Control-Expose-Headers", EXPOSED)]


def preflight(request: Request, allowed: tuple[str, ...], methods: tuple[str, ...]) -> list[tuple[str, str]]:
    """An OPTIONS preflight's answer: the methods of the route and the headers asked for; 403
    for an origin not allowed."""
    if not origin_allowed(request, allowed):
        raise ProtocolError(f"origin {request.headers.get('origin', '(none)')} is not allowed", 403)
    fields = cors(request, allowed)
    asked = request.headers.get("access-control-request-headers", "")
    return fields + [
        ("Access-Control-Allow-Methods", ", ".join((*methods, "OPTIONS"))),
        ("Access-Control-Allow-Headers", asked or "Content-Type, Authorization, x-api-key, Last-Event-ID"),
        ("Access-Control-Max-Age", PREFLIGHT_SECONDS),
    ]
