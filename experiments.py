"""The article's experiments: a reader leaving, a reader saying stop, and the buffering proxy.

    python experiments.py leave|stop|proxy [--port 8765] [--proxy-port 8766]   # against running ones
    python experiments.py all [--model bundled]                                   # starts everything
    python experiments.py nginx [--model bundled]                                 # through a real nginx
    python experiments.py page [--model bundled]                                  # results/page.png
    python experiments.py replicas [--model bundled]                              # Redis, 2 replicas, nginx

`leave` reads 10 pieces of a 100-token /stream, closes, and reads from GET /log how many tokens
the server generated in all; `stop` does the same over /ws with {"stop": true}; `proxy` sends
one /stream through the proxy on --proxy-port. `all` is what a reader of the article would
otherwise start by hand: the server, the same server with --naive, the buffering proxy and the
honoring proxy, each a child process on a free port, waited for until it answers and stopped on
any exit. It runs `client.py measure`, every experiment, checks the article's conclusions on our
numbers, and saves results/experiments.json and results/timeline.png. `nginx` runs the path
through Debian's nginx (streaming/nginxctl.py): honoring X-Accel-Buffering and told to ignore it, a reader
leaving, a /ws stop, and an idle timeout with and without keep-alive pings; it saves
results/nginx.json. `page` saves a screenshot of the browser page mid-stream (results/page.png).
`replicas` (streaming/replicas.py) starts Redis, two replicas with --store redis:// and nginx in
front, and checks resuming on the other replica, following from it, stopping through nginx, a
replica SIGKILLed mid-answer and a rolling restart under 16 readers; it saves results/replicas.json.
"""

import argparse
import asyncio
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import client
from streaming.launch import REPEATS_EXACTLY, Process, Server, python
from streaming.options import AT_LEAST_ONE, PORT, number

PROMPT = client.prompts(1)[0]  # the lighthouse paragraph
N = 100  # tokens asked for, as the article
LEAVE_AFTER = 10  # pieces read before leaving or saying stop
LOG_WAIT = 300  # seconds to wait for a request to appear in /log (a naive server finishing 100 tokens)


def say(message):
    print(f"[experiments] {message}", file=sys.stderr, flush=True)


async def logged(port, host=None):
    """How many answers the server has logged since it started (/log keeps only the latest
    10,000: its length stops growing there)."""
    return (await client.get_json("/metrics.json", host, port))["requests_logged"]


async def new_log_entry(port, before, path, host=None):
    """The server's record of the first request to `path` it logged after its first `before`
    answers, once it has finished (another reader's answers may be logged meanwhile)."""
    deadline = time.monotonic() + LOG_WAIT
    while time.monotonic() < deadline:
        count = await logged(port, host)
        log = await client.get_json("/log", host, port)
        if count > before and await logged(port, host) == count:  # (/log read between two equal counts)
            newer = log[max(0, len(log) - (count - before)) :]
            if entry := next((e for e in newer if e[0] == path), None):
                return entry
        await asyncio.sleep(0.1)
    raise TimeoutError(f"the server on port {port} logged nothing for {path} within {LOG_WAIT} s")


async def leave(port, host=None):
    before = await logged(port, host)
    await client.post("/stream", PROMPT, N, stop_after=LEAVE_AFTER, host=host, port=port)
    path, generated, left = await new_log_entry(port, before, "/stream", host)
    print(f"SSE client left after {LEAVE_AFTER} pieces: the server generated {generated} tokens in all", flush=True)
    return generated


async def stop(port, host=None):
    before = await logged(port, host)
    await client.websocket(PROMPT, N, stop_after=LEAVE_AFTER, host=host, port=port)
    path, generated, stopped = await new_log_entry(port, before, "/ws", host)
    print(
        f"WebSocket client said stop after {LEAVE_AFTER} pieces: the server generated {generated} tokens in all",
        flush=True,
    )
    return generated


async def after_stop(port, experiment):
    """`experiment`'s tokens generated in all, and those generated after the server had the stop
    (the reader gone or its {"stop": true} read; the server's own count). The first depends on how
    fast the model is against the wire: with the article's model a token takes longer than the
    stop takes to arrive, so it is at most LEAVE_AFTER + 1; with the tiny test model a few more
    tokens can be made while the stop is on its way. The second is at most one on any model."""
    counted = (await client.get_json("/metrics.json", None, port))["tokens_after_stop"]
    generated = await experiment(port)
    return generated, (await client.get_json("/metrics.json", None, port))["tokens_after_stop"] - counted


async def proxy(port, host=None):
    r = await client.post("/stream", PROMPT, N, host=host, port=port)
    first, total, received, pieces = r
    print(
        f"through the proxy: first text after {first:.2f} s, the end after {total:.2f} s, "
        f"{len(pieces)} pieces, {received:,} bytes",
        flush=True,
    )
    return r


# --- `nginx`: the same path through a real nginx (streaming/nginxctl.py, nginx/streaming.conf) -

QUIET_S = 4.0  # nginx case (d): seconds of silence before the first token, as a long prompt's prefill
READ_TIMEOUT = "2s"  # nginx case (d): proxy_read_timeout, shorter than that silence
QUIET_TOKENS = 20  # nginx case (d): a short answer after the silence


async def through_nginx(server, quiet, pinging):
    """The five nginx cases; `server` is a plain server's port, `quiet` and `pinging` servers that
    stay silent QUIET_S s before the first token, without and with keep-alive pings every second."""
    from streaming.nginxctl import Nginx

    r, c = {}, []
    with Nginx(server) as n:
        a = await client.post("/stream", PROMPT, N, port=n.port)
    r["honored"] = timing(a)
    print(
        f"through nginx, X-Accel-Buffering: no honored: first text after {a.first:.2f} s, "
        f"the end after {a.total:.2f} s, {len(a.pieces)} pieces",
        flush=True,
    )
    with Nginx(server, ["proxy_ignore_headers X-Accel-Buffering;"]) as n:
        b = await client.post("/stream", PROMPT, N, port=n.port)
    r["ignored"] = timing(b)
    print(
        f"through nginx told to ignore it (proxy_ignore_headers): first text after {b.first:.2f} s, "
        f"the end after {b.total:.2f} s",
        flush=True,
    )
    with Nginx(server) as n:
        print("through nginx:", end=" ", flush=True)
        r["leave"] = await leave(n.port)
        print("through nginx:", end=" ", flush=True)
        r["ws_stop"] = await stop(n.port)
    idle = {}
    for name, port in (("without pings", quiet), ("with --ping 1", pinging)):
        with Nginx(port, [f"proxy_read_timeout {READ_TIMEOUT};"]) as n:
            t0 = time.perf_counter()
            try:
                d = await client.post("/stream", PROMPT, QUIET_TOKENS, port=n.port)
                idle[name] = {"survived": True, "seconds": d.total, "pieces": len(d.pieces)}
            except client.ServerError as e:
                idle[name] = {"survived": False, "seconds": time.perf_counter() - t0, "error": str(e)}
    r["idle"] = idle
    w, p = idle["without pings"], idle["with --ping 1"]
    print(
        f"through nginx with proxy_read_timeout {READ_TIMEOUT} and {QUIET_S:g} s before the first token: "
        f"without pings the stream {'ended with [DONE]' if w['survived'] else 'died'} after {w['seconds']:.1f} s; "
        f"with --ping 1 it {'ended with [DONE]' if p['survived'] else 'died'} after {p['seconds']:.1f} s",
        flush=True,
    )
    share = a.first / a.total
    check(c, "nginx honoring X-Accel-Buffering: first text well before the end", share <= 0.10, f"{share:.1%}")
    late = (b.total - b.first) / b.total
    check(c, "nginx ignoring it: first text within 5% of the end", late <= 0.05, f"{late:.1%} before the end")
    check(c, "nginx: a reader leaving after 10 pieces, at most 11 tokens", r["leave"] <= 11, r["leave"])
    check(c, "nginx: /ws stop after 10 pieces, at most 11 tokens", r["ws_stop"] <= 11, r["ws_stop"])
    check(c, "nginx idle timeout: dies without pings", not w["survived"], f"{w['seconds']:.1f} s")
    check(c, "nginx idle timeout: survives with pings", p["survived"], f"{p['seconds']:.1f} s")
    r["conclusions"] = c
    held = sum(x["holds"] for x in c)
    print(f"through nginx, on our numbers: {held} of {len(c)} hold", flush=True)
    for x in c:
        print(f"  {'holds' if x['holds'] else 'DOES NOT HOLD'}: {x['conclusion']} {x['detail']}".rstrip(), flush=True)
    return r


def nginx_(args):
    from streaming import nginxctl

    if not nginxctl.available():
        print("nginx is not installed: skipping the nginx experiments (apt-get install nginx)", flush=True)
        return None
    children = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    try:
        model_args = ["--model", args.model] + (["--dtype", args.dtype] if args.dtype else [])
        quiet = ["--first-delay", str(QUIET_S)]
        say(f"starting the server and two that stay quiet {QUIET_S:g} s before the first token (model {args.model})")
        children = [
            Server("server", "--port", str(args.port), *model_args, "--token-delay", str(args.token_delay)),
            Server("quiet server", "--port", "0", "--ping", "60", *quiet, *model_args),
            Server("pinging server", "--port", "0", "--ping", "1", *quiet, *model_args),
        ]
        ports = [child.wait().port for child in children]
        for child in children:
            say(f"{child.name} :{child.port}: {child.loaded}")
        info = asyncio.run(client.server_info(port=ports[0]))
        results = {"prompt": PROMPT, "max_tokens": N, **info, **asyncio.run(through_nginx(*ports))}
    finally:
        for child in children:
            child.stop()
    client.save(Path(args.results) / "nginx.json", results)
    say(f"saved {Path(args.results) / 'nginx.json'}")
    return results


def replicas_(args):
    from streaming import nginxctl, redisctl, replicas

    missing = [name for name, m in (("redis-server", redisctl), ("nginx", nginxctl)) if not m.available()]
    if missing:
        print(f"not installed: {', '.join(missing)} (apt-get install redis-server nginx): skipping", flush=True)
        return None
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    tokens = args.max_tokens or replicas.MAX_TOKENS
    return replicas.run(args.model, tokens, args.token_delay, args.results, args.dtype)


# --- `page`: the browser page mid-stream, as a picture --------------------------------------------

CHROMIUM_ARGS = ["--no-sandbox", "--disable-background-networking", "--disable-component-update", "--no-first-run"]


def page_(args):
    """Open GET / in Debian's Chromium (playwright), stream the lighthouse prompt over fetch, and
    save a screenshot once 30 pieces have arrived: results/page.png."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("playwright is not installed: no page.png (pip install playwright)", flush=True)
        return None
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        print("chromium is not installed: no page.png (apt-get install chromium)", flush=True)
        return None
    server = Server("server", "--port", str(args.port), "--model", args.model)
    try:
        server.wait()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 900, "height": 640})
            page.goto(f"http://127.0.0.1:{server.port}/")
            page.fill("#prompt", PROMPT)
            page.click("#start")
            page.wait_for_function("window.run && window.run.pieces >= 30", timeout=300_000)
            out = Path(args.results) / "page.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
            figures = page.evaluate("({ttft: run.ttft, pieces: run.pieces})")
            page.click("#stop")
            browser.close()
    finally:
        server.stop()
    print(
        f"the page mid-stream: first text after {figures['ttft'] / 1000:.2f} s in the browser, "
        f"{figures['pieces']} pieces shown; saved {out}",
        flush=True,
    )
    return str(out)


# --- `all`: children on free ports (streaming.launch) ------------------------------------------


def timing(r):
    """A client.Result as saved in the results: first text, the end, pieces, bytes."""
    return {"first_s": r.first, "total_s": r.total, "pieces": len(r.pieces), "bytes": r.received}


def check(conclusions, name, holds, detail):
    conclusions.append({"conclusion": name, "holds": bool(holds), "detail": detail})


def conclusions(results, b, h):
    """The article's conclusions, each checked on this run's figures (`b`, `h`: the buffering and
    the honoring proxy's timings)."""
    c = []
    m = results["measure"]
    check(c, "/complete: first text equals all of it", m["/complete"]["first_s"] == m["/complete"]["total_s"], "")
    for path in ("/stream", "/ws"):
        share = m[path]["first_s"] / m[path]["total_s"]
        check(c, f"{path}: first text at most 10% of all of it", share <= 0.10, f"{share:.1%}")
    check(c, "the same text all three ways", m["same_text"], "")
    check(c, "leave: the watching server generated at most 11 tokens", results["leave"] <= 11, results["leave"])
    check(c, "leave: the --naive server generated all 100", results["leave_naive"] == N, results["leave_naive"])
    check(c, "stop: at most 11 tokens", results["stop"] <= 11, results["stop"])
    for name in ("leave", "stop"):
        late = results[f"{name}_after_stop"]
        check(c, f"{name}: at most one token after the server had the stop", late <= 1, late)
    late = (b.total - b.first) / b.total
    check(c, "buffering proxy: first text within 5% of the end", late <= 0.05, f"{late:.1%} before the end")
    ratio = h.first / m["/stream"]["first_s"]
    check(c, "--honor: first text within 2x of no proxy", ratio <= 2, f"{ratio:.2f}x")
    check(c, "bytes: /complete under 2x the text", m["/complete"]["ratio"] < 2, f"{m['/complete']['ratio']:.1f}x")
    for path in ("/stream", "/ws"):
        check(c, f"bytes: {path} several times the text", m[path]["ratio"] >= 2.5, f"{m[path]['ratio']:.1f}x")
    return c


async def run_all(ports, prompts, measure_tokens):
    server, naive, buffering, honoring = ports
    info = await client.server_info(port=server)
    results = {"prompt": PROMPT, "max_tokens": N, **info}

    say(f"measure: {prompts} prompts x 3 ways x {measure_tokens} tokens (the slow part)")
    rows = await client.measure_rows(
        client.prompts(prompts), measure_tokens, port=server, progress=lambda s: say(s.strip())
    )
    lines, figures = client.summarize(rows)
    print("\n".join(lines), flush=True)
    results["measure"] = figures

    say("leave: the watching server, then the naive one")
    results["leave"], results["leave_after_stop"] = await after_stop(server, leave)
    print("Started with --naive:", flush=True)
    results["leave_naive"] = await leave(naive)
    say("stop over /ws")
    results["stop"], results["stop_after_stop"] = await after_stop(server, stop)
    say("through the buffering proxy, then the honoring one")
    print("Buffering:", flush=True)
    b = await proxy(buffering)
    print("With --honor:", flush=True)
    h = await proxy(honoring)
    results["proxy"] = timing(b)
    results["proxy_honor"] = timing(h)

    results["conclusions"] = c = conclusions(results, b, h)
    held = sum(x["holds"] for x in c)
    print(f"the article's conclusions on our numbers: {held} of {len(c)} hold", flush=True)
    for x in c:
        print(f"  {'holds' if x['holds'] else 'DOES NOT HOLD'}: {x['conclusion']} {x['detail']}".rstrip(), flush=True)

    timeline = {
        "/complete": rows["/complete"][0].arrivals,
        "/stream": rows["/stream"][0].arrivals,
        "/ws": rows["/ws"][0].arrivals,
        "buffering proxy": b.arrivals,
        "honoring proxy": h.arrivals,
    }
    results["timeline"] = timeline
    return results


def plot_timeline(timeline, info, path):
    """One row per way of delivery: a tick when each piece of text arrived."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no timeline.png (pip install matplotlib)")
        return None
    names = list(timeline)
    fig, ax = plt.subplots(figsize=(10, 3.6))
    for i, name in enumerate(names):
        times = timeline[name]
        ax.eventplot([times], lineoffsets=len(names) - 1 - i, linelengths=0.6, colors=f"C{i}")
        if times:
            ax.annotate(f"first {times[0]:.2f} s", (times[0], len(names) - 1 - i + 0.35), fontsize=8)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlabel("seconds since the request was sent")
    ax.set_title(
        f"When each piece of text arrived: one prompt, {N} tokens ({info.get('model')}, {info.get('device')}, {info.get('dtype')})",
        fontsize=10,
    )
    ax.set_xlim(0, 1.15 * max((t[-1] for t in timeline.values() if t), default=1))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def all_(args):
    children = []

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    try:
        model_args = ["--model", args.model] + (["--dtype", args.dtype] if args.dtype else [])
        say(f"starting the server and the --naive server (model {args.model})")
        # the article's check of "the same text all three ways" compares the transports, so each
        # request gets the same arithmetic
        server = Server("server", "--port", str(args.port), *model_args, *REPEATS_EXACTLY)
        naive = Server("naive server", "--naive", "--port", str(args.naive_port), *model_args)
        children += [server, naive]
        for child in (server, naive):
            child.wait()
            say(f"{child.name} :{child.port}: {child.loaded}")
        up = ["--upstream-port", str(server.port)]
        buffering = Process("buffering proxy", python("proxy.py", "--port", str(args.proxy_port), *up))
        honoring = Process("honoring proxy", python("proxy.py", "--honor", "--port", str(args.honor_port), *up))
        children += [buffering, honoring]
        buffering.wait()
        honoring.wait()
        say(f"server :{server.port}, naive :{naive.port}, proxy :{buffering.port}, --honor proxy :{honoring.port}")
        ports = (server.port, naive.port, buffering.port, honoring.port)
        args.max_tokens = args.max_tokens or N
        results = asyncio.run(run_all(ports, args.prompts, args.max_tokens))
        info = {k: results.get(k) for k in ("model", "device", "dtype", "quantize")}
        measured = dict(info, prompts=args.prompts, max_tokens=args.max_tokens, **results["measure"])
        client.save(Path(args.results) / "measure.json", measured)  # as `client.py measure` saves it
        say("event_bytes.py --live: the bytes of each wire format, one event and a whole answer")
        from scripts import event_bytes

        results["event_bytes"] = event_bytes.live(server.port, args.max_tokens)
        client.save(Path(args.results) / "event_bytes.json", results["event_bytes"])
    finally:
        for child in children:
            child.stop()
    out = Path(args.results)
    client.save(out / "experiments.json", results)
    picture = plot_timeline(results["timeline"], results, out / "timeline.png")
    say(f"saved {out / 'experiments.json'}" + (f" and {picture}" if picture else ""))
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", choices=["leave", "stop", "proxy", "nginx", "page", "replicas", "all"])
    p.add_argument("--host", default=client.HOST)
    p.add_argument("--port", type=PORT, default=None, help="the server's port (default 8765; `all`: a free one)")
    p.add_argument("--proxy-port", type=PORT, default=None, help="the proxy's port (default 8766; `all`: a free one)")
    p.add_argument("--naive-port", type=PORT, default=0, help="`all`: the --naive server's port")
    p.add_argument("--honor-port", type=PORT, default=0, help="`all`: the honoring proxy's port")
    p.add_argument("--model", default=os.environ.get("LM_MODEL", "bundled"), help="`all`: the servers' model")
    p.add_argument("--dtype", default=None, help="`all`, `replicas`: the servers' dtype")
    p.add_argument("--prompts", type=AT_LEAST_ONE, default=5, help="`all`: prompts for the measure table")
    p.add_argument(
        "--max-tokens",
        type=AT_LEAST_ONE,
        default=None,
        help="tokens per answer: `all`'s measure table (100), `replicas` (200)",
    )
    p.add_argument(
        "--token-delay",
        type=number(float, 0, 60),
        default=0.0,
        help="`replicas`, `nginx`: the replicas' or the plain server's --token-delay",
    )
    p.add_argument("--results", default="results", help="`all`: folder for experiments.json and timeline.png")
    args = p.parse_args(argv)
    if args.experiment in ("all", "nginx", "page", "replicas"):
        args.port = args.port or 0
        args.proxy_port = args.proxy_port or 0
        return {"all": all_, "nginx": nginx_, "page": page_, "replicas": replicas_}[args.experiment](args)
    port = args.port or 8765
    if args.experiment == "proxy":
        port = args.proxy_port or 8766  # the article's proxy port
    run = {"leave": leave, "stop": stop, "proxy": proxy}[args.experiment]

    async def when_ready():
        await client.wait_ready(args.host, port)  # (through the proxy: it passes /ready on)
        return await run(port, args.host)

    try:
        asyncio.run(when_ready())
    except (client.ServerError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
