"""What one streamed piece of text, "Two", costs on the wire in different formats.

    python scripts/event_bytes.py              # the article's static table
    python scripts/event_bytes.py --live [--port P] [--model M]

The article's event_bytes.py: compact JSON; the Anthropic event is the documented example's
shape; the OpenAI chunk has the fields of the example in OpenAI's cookbook (current chunks also
carry a random-length padding field, which makes them larger still).

--live measures ours: one event carrying "Two" as this server writes it in each of its formats
(the bytes come from the same encoders the server writes with; the OpenAI padding is random, so
its size is the mean of 1,000 draws), next to the article's figures; then a whole 100-token
answer in each format from a running server (the one on --port, or one started here), counting
every byte received, headers included, per byte of text. Saves results/event_bytes.json.
"""

import argparse
import asyncio
import json
import statistics

text = "Two"
ours = b"data: " + json.dumps({"text": text}).encode() + b"\n\n"
anthropic = (
    b"event: content_block_delta\ndata: "
    + json.dumps(
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        separators=(",", ":"),
    ).encode()
    + b"\n\n"
)
openai = (
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-9lMgfRSWPHcw51s6wxKT1YEO2CKpd",
            "object": "chat.completion.chunk",
            "created": 1721075653,
            "model": "gpt-july-test",
            "system_fingerprint": "fp_e9b8ed65d2",
            "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}],
        },
        separators=(",", ":"),
    ).encode()
    + b"\n\n"
)
payload = json.dumps({"text": text}).encode()
websocket = bytes([0x81, len(payload)]) + payload  # a server-to-client frame: 2 bytes of header

ARTICLE = {"ours_sse": len(ours), "anthropic": len(anthropic), "openai": len(openai), "ours_ws": len(websocket)}


def one_event(model_id):
    """One event carrying `text`, from the encoders the server writes with (streaming.wire)."""
    from streaming.wire import sse, websocket
    from streaming.wire.anthropic import AnthropicStream
    from streaming.wire.openai import OpenAIStream

    payload = json.dumps({"text": text})
    padded = [len(OpenAIStream(model_id, obfuscation=True).text(text)) for _ in range(1000)]
    return {
        "ours_sse": len(sse.event(payload)),
        "ours_ws": len(websocket.text_frame(payload)),
        "openai": len(OpenAIStream(model_id, obfuscation=False).text(text)),
        "openai_obfuscated": statistics.mean(padded),
        "openai_obfuscated_range": [min(padded), max(padded)],
        "anthropic": len(AnthropicStream(model_id, 10).text(text)),
    }


async def whole_answers(port, prompt, n):
    """Bytes on the wire per byte of text over one n-token answer, in each format."""
    import client

    url = f"http://127.0.0.1:{port}"
    ask = f"Continue this paragraph for about 300 words: {prompt}"  # a chat model answers a question
    exact = {"ignore_eos": True}  # exactly n tokens in every format, however short the model's answer
    runs = {
        "our /stream": client.post("/stream", prompt, n, port=port, extra=exact),
        "our /ws": client.websocket(prompt, n, port=port, extra=exact),
        "OpenAI chunks, padded": client.api_post("openai", ask, n, url, extra=exact),
        "OpenAI chunks, no padding": client.api_post(
            "openai", ask, n, url, extra=dict(exact, stream_options={"include_obfuscation": False})
        ),
        "Anthropic events": client.api_post("anthropic", ask, n, url, extra=exact),
    }
    out = {}
    for name, run in runs.items():
        r = await run
        chars = len("".join(r.pieces).encode())
        out[name] = {"bytes": r.received, "text_bytes": chars, "pieces": len(r.pieces), "ratio": r.received / chars}
    return out


def live(port, n=100):
    import client

    info = asyncio.run(client.server_info(port=port))
    model_id = asyncio.run(client.get_json("/v1/models", port=port))["data"][0]["id"]
    e = one_event(model_id)
    print(
        f'one event carrying "{text}" ({len(text.encode())} bytes of text): the article\'s, and as this server writes it'
    )
    rows = [
        ("SSE event (/stream)", ARTICLE["ours_sse"], e["ours_sse"]),
        ("WebSocket frame (/ws)", ARTICLE["ours_ws"], e["ours_ws"]),
        ("OpenAI chunk, no padding", ARTICLE["openai"], e["openai"]),
        ("OpenAI chunk, padded (mean)", None, e["openai_obfuscated"]),
        ("Anthropic content_block_delta", ARTICLE["anthropic"], e["anthropic"]),
    ]
    for name, article, here in rows:
        a = f"{article:4d}" if article is not None else "   -"
        print(f"  {name:31s} article {a} bytes, ours {here:6.1f} bytes")
    lo, hi = e["openai_obfuscated_range"]
    print(f"  (the padded OpenAI chunk varies from {lo} to {hi} bytes: that is the point of the padding)")
    prompt = client.prompts(1)[0]
    whole = asyncio.run(whole_answers(port, prompt, n))
    print(f"over a whole {n}-token answer (ignore_eos), every byte received, headers included, per byte of text:")
    for name, w in whole.items():
        print(
            f"  {name:27s} {w['bytes']:7,d} bytes for {w['text_bytes']:5,d} bytes of text in {w['pieces']:3d} pieces ({w['ratio']:.1f}x)"
        )
    return dict(info, one_event=e, article=ARTICLE, whole_answer=whole, max_tokens=n)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--live", action="store_true", help="measure this server's formats (starts one unless --port)")
    p.add_argument("--port", type=int, default=None, help="a running server's port")
    p.add_argument("--model", default=None, help="the model of the server started here (default: $LM_MODEL or bundled)")
    p.add_argument("--max-tokens", type=int, default=100)
    args = p.parse_args(argv)
    if not args.live:
        static()
        return
    import client

    if args.port:
        results = live(args.port, args.max_tokens)
    else:
        from streaming.launch import Server

        model = args.model or __import__("os").environ.get("LM_MODEL", "bundled")
        server = Server("server", "--port", "0", "--model", model).wait()
        try:
            results = live(server.port, args.max_tokens)
        finally:
            server.stop()
    client.save("results/event_bytes.json", results)


def static():
    for name, b in (
        ("this post's SSE event", ours),
        ("Anthropic content_block_delta", anthropic),
        ("OpenAI chat.completion.chunk", openai),
        ("this post's WebSocket frame", websocket),
    ):
        print(f"{name:31s} {len(b):4d} bytes for {len(text.encode())} bytes of text")
    import client

    client.save("results/event_bytes_article.json", {"text": text, **ARTICLE})


if __name__ == "__main__":
    main()
