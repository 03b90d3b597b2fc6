"""The two errors of the wire layer: what a client got wrong, and a request that fails its checks.

`ProtocolError` carries how to say so on every transport: an HTTP status, a WebSocket close code
(RFC 6455 §7.4.1), a machine-readable kind, extra headers, and for the APIs the offending
parameter and an error code. What the body looks like is the endpoint's business (its error
shape); the server turns every error into a response in one place.

`InvalidRequest` is a request whose values fail their checks (a missing prompt, a temperature out
of range, a prompt too long for the context). It is not an HTTP error: each endpoint family maps
it to its own status (422 for ours, 400 for the APIs, a close 1008 on a WebSocket).
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus


class ProtocolError(Exception):
    """Anything a client got wrong (or we failed at), carrying how to say so."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        close_code: int = 1002,
        kind: str | None = None,
        headers: Iterable[tuple[str, str]] = (),
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.close_code = message, status, close_code
        self.kind = kind or HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
        self.headers = list(headers)
        self.param, self.code = param, code


class InvalidRequest(ValueError):
    """A request value that fails its check. `status` is what our own endpoints answer (422, or
    400 when a required field is missing); `param` names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 422) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def problem(self, status: int | None = None) -> ProtocolError:
        """This check's failure as a ProtocolError: `status` as the endpoint family says it (the
        APIs say 400), else ours; a WebSocket closes with 1008."""
        return ProtocolError(
            self.message, status or self.status, close_code=1008, kind="invalid_request", param=self.param
        )


def error_body(err: ProtocolError) -> dict[str, object]:
    """Our own endpoints' error body; the APIs have theirs (openai.py, anthropic.py)."""
    return {"error": {"status": err.status, "type": err.kind, "message": err.message}}
