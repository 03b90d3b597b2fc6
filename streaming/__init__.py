"""The streaming server's package, by layer; the top-level scripts of the article drive it.

- `streaming.wire`: the formats on the wire over bytes, with no asyncio and no torch: HTTP/1.1
  (requests, responses, chunked bodies), server-sent events, RFC 6455 (frames and a sans-I/O
  session), OpenAI's and Anthropic's APIs, and a request's checked generation parameters. A new
  wire format goes here.
- `streaming.generation`: turning token ids into text pieces on an asyncio queue: the job every
  engine runs (one per-token routine), the article's thread per request, the step-batched engine,
  and the model-less one. A new engine goes here.
- `streaming.server`: the asyncio server: the connection's I/O, routing, and one module per
  endpoint family (plain streams, resumable streams, WebSocket, the /v1/ APIs, the page and
  status). A new endpoint goes here.
- `streaming.qoe`: what a reader feels of one streamed answer (the Andes QoE), from arrival times.
- `streaming.launch` and `streaming.nginxctl`: child processes (servers, proxies, nginx) for the
  experiments, the benchmarks and the tests.
"""
