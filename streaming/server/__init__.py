"""The asyncio server: connection I/O, routing, and one module per endpoint family.

- config.py: `Config`, every setting of a server as one frozen value.
- connection.py: one client's reads and writes, and the one place an error becomes a response.
- app.py: `Server`: the route table, the state a server owns (its Runner, log, streams), relaying
  a job's pieces, shutdown; and `serve()`.
- plain.py: POST /complete and POST /stream, the article's endpoints.
- resumable.py (and streams.py, the record it keeps): GET /stream, Last-Event-ID, POST /stop.
- websocket.py: GET /ws, driving the sans-I/O session of streaming.wire.session.
- apis.py: /v1/, driving a wire format object (OpenAI's or Anthropic's) with no branch on which.
- info.py: the page (page.html), /log and /metrics.

A new endpoint is a handler in the family's module (or a new module) and a line in app.ROUTES.
"""
