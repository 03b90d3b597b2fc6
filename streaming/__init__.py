"""The streaming server's package, by layer, each importing only the ones below it; the brief's
top-level scripts drive it, and nothing here imports them.

- `streaming.wire`: the formats on the wire over bytes, with no asyncio, no torch and no I/O.
- `streaming.model`: choosing and loading a model; `Model`, the handle the engines receive.
- `streaming.generation`: token ids into text pieces on an asyncio queue: the job every engine
  runs, the engines, and the `Backend` a server owns.
- `streaming.server`: the asyncio server: connections, exchanges, routes, one answer lifecycle,
  the endpoint families, resumable streams.
- beside them: an HTTP client on asyncio, the reader's QoE, and the child processes and readers
  the experiments, benchmarks and tests start.

Every module, with what it does, is listed once: in the README's Layout section (a test holds the
two together).
"""
