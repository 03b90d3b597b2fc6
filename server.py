"""The article's streaming server: HTTP/1.1, SSE and WebSocket on asyncio, no framework.

    python server.py [--naive] [--host 127.0.0.1] [--port 8765] [--model NAME] ...

POST /complete answers with the whole text as JSON at the end; POST /stream sends server-sent
events, `data: {"text": piece}` per piece then `data: [DONE]`; GET /ws opens a WebSocket
(first message {"prompt", "max_tokens"}, then {"text"} messages, {"done": true}, a close 1000;
the client may send {"stop": true}). GET /log is the record of finished requests, a list of
[path, generated_tokens, client_left_early]; GET /metrics counts what is running now. GET / is
the browser page; GET /stream?prompt=... is the stream for EventSource, resumable with
Last-Event-ID (resume.py), and POST /stop stops such a stream.

Generation runs in one engine thread that steps every request at once (engine.py), or with
--engine thread in a thread per request (generation.py). Without --naive the server stops it
the moment the reader leaves: end-of-file or a failed write on /stream and /complete, a stop
message, close frame or end-of-file on /ws. With --naive it is the article's naive server, which
notices nothing and generates every token for nobody.

This file only reads, writes and dispatches: parsing and framing live in http11.py, sse.py and
ws.py, and every ProtocolError becomes a response in one place per protocol (`fail`). Leaves out:
keep-alive (every response closes its connection, so an SSE stream ends with the connection, as
in the article), TLS, HTTP/2, and chunked request bodies.
"""

import argparse
import asyncio
import json
import signal
import sys
import threading
import time
from pathlib import Path

import apis
import engine
import lm
import resume
import sse
import ws
from engine import BatchedJob, FreeJob
from generation import ACTIVE, STOPS, Job, encode_chat, encode_prompt, flag, parse_params, query_body
from http11 import REQUEST_TIMEOUT, ProtocolError, RequestParser, error_body, error_response, json_response, response
from resume import RETRY_MS

ROUTES = {
    "/": ("GET",),  # the browser page (page.html)
    "/complete": ("POST",),
    "/stream": ("POST", "GET"),  # GET ?prompt=...: EventSource's way, resumable
    "/stop": ("POST",),  # {"id": stream}: stop a resumable stream now (closing it only pauses it)
    "/ws": ("GET",),
    "/log": ("GET",),
    "/metrics": ("GET",),
    "/v1/chat/completions": ("POST",),  # OpenAI's wire format (apis.py)
    "/v1/messages": ("POST",),  # Anthropic's
    "/v1/models": ("GET",),
}
PAGE = Path(__file__).with_name("page.html")
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"X-Accel-Buffering: no\r\nConnection: close\r\n\r\n"
)
CLOSE_WAIT = 2.0  # seconds to wait for the peer's close frame before closing TCP anyway (RFC 6455 §7.1.1)
READ_SIZE = 65536


class Connection:
    """One client: its streams, and whether the response has started (after which an error can
    no longer be an HTTP status)."""

    def __init__(self, reader, writer):
        self.reader, self.writer = reader, writer
        self.started = False
        self.ws = None
        self.gone = False  # the watcher saw end-of-file: the client left


class Server:
    def __init__(self, args):
        self.args = args
        self.log = []  # [path, generated tokens, client left early], one per finished request
        self.connections = set()  # handler tasks
        self.websockets = set()  # open WebSocket sessions, closed with 1001 at shutdown
        self.served = 0
        self.streams = resume.Store(args.resume_streams, args.resume_keep)  # resumable streams
        self.pumps = set()  # their tasks, which outlive their readers

    # --- the connection: read one request, dispatch, turn errors into responses ------------

    async def handle(self, reader, writer):
        task = asyncio.current_task()
        self.connections.add(task)
        conn = Connection(reader, writer)
        try:
            request, trailing = await self.read_request(conn)
            if request is not None:
                self.served += 1
                await self.dispatch(conn, request, trailing)
        except ProtocolError as e:
            await self.fail(conn, e)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            if conn.ws is not None:
                await conn.ws.close(1001, "server shutting down")
        except Exception as e:  # noqa: BLE001 - a bug must cost one request, not the server
            print(f"internal error: {e!r}", file=sys.stderr, flush=True)
            await self.fail(conn, ProtocolError(f"internal error: {e}", 500, close_code=1011))
        finally:
            self.connections.discard(task)
            writer.close()
            try:
                await writer.wait_closed()
            except (ConnectionError, asyncio.CancelledError):
                pass

    async def fail(self, conn, err):
        """The one place a ProtocolError becomes what the client sees."""
        try:
            if conn.ws is not None:
                await conn.ws.close(err.close_code, err.message)
            elif not conn.started:
                conn.writer.write(error_response(err))
                await conn.writer.drain()
        except ConnectionError:
            pass

    async def read_request(self, conn):
        """The request and any bytes after it; (None, b'') if the client left first; 408 if slow."""
        parser, continued = RequestParser(), False

        async def read():
            nonlocal continued
            while (request := parser.next_request()) is None:
                if parser.expects_continue() and not continued:
                    conn.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    continued = True
                data = await conn.reader.read(READ_SIZE)
                if not data:
                    return None
                parser.feed(data)
            return request

        try:
            request = await asyncio.wait_for(read(), self.args.request_timeout)
        except asyncio.TimeoutError:
            raise ProtocolError(f"the request took over {self.args.request_timeout:g} s to arrive", 408) from None
        return request, parser.trailing

    async def dispatch(self, conn, request, trailing):
        methods = ROUTES.get(request.path)
        if methods is None:
            raise ProtocolError(f"no such path: {request.path}", 404)
        if request.method not in methods:
            allow = ", ".join(methods)
            raise ProtocolError(f"{request.path} takes {' or '.join(methods)}", 405, headers=[("Allow", allow)])
        if request.path.startswith("/v1/"):
            await self.api(conn, request)
        elif request.path == "/log":
            conn.writer.write(json_response(200, self.log))
        elif request.path == "/metrics":
            conn.writer.write(json_response(200, self.metrics()))
        elif request.path == "/ws":
            await self.websocket(conn, request, trailing)
        elif request.path == "/":
            page = await asyncio.to_thread(PAGE.read_bytes)
            conn.writer.write(response(200, page, "text/html; charset=utf-8", [("Cache-Control", "no-cache")]))
        elif request.path == "/stop":
            self.stop_stream(conn, request.json())
        elif request.path == "/stream" and (request.method == "GET" or self.wants_resume(request)):
            await self.resumable(conn, request)
        else:
            params = parse_params(request.json())
            ids = await asyncio.to_thread(encode_prompt, params)
            job = self.job(ids, params)
            try:
                if request.path == "/complete":
                    await self.complete(conn, job)
                else:
                    await self.stream(conn, job)
            finally:
                job.stop.set()  # whatever happened, this request's thread must end
        await conn.writer.drain()

    def job(self, ids, params):
        a = self.args
        return {"batched": BatchedJob, "thread": Job, "free": FreeJob}[a.engine](
            ids,
            params,
            queue_size=a.queue,
            token_delay=a.token_delay,
            fail_after=a.fail_after,
            first_delay=a.first_delay,
        ).start()

    def metrics(self):
        return {
            "model": lm.model_name(),
            "device": lm.DEVICE,
            "dtype": str(lm.dtype()).removeprefix("torch."),
            "quantize": lm.quantization(),
            "naive": self.args.naive,
            "active_generations": len(ACTIVE),
            "generation_threads": sum(t.name == "generate" for t in threading.enumerate()),
            "open_connections": len(self.connections),
            "requests_served": self.served,
            "requests_logged": len(self.log),
            "requests_stopped": STOPS["stopped"],  # early: the reader left or said stop
            "tokens_after_stop": STOPS["tokens_after_stop"],  # generated for nobody after those stops
            "resumable_streams": len(self.streams.streams),
            **(engine.ENGINE.metrics() if self.args.engine == "batched" else {"engine": self.args.engine}),
        }

    def record(self, path, produced, left, what="client left early"):
        self.log.append([path, produced, left])
        print(f"{path}: generated {produced} tokens, {what}: {left}", flush=True)

    # --- writing, and noticing the reader leaving -------------------------------------------

    async def send(self, conn, data):
        """Write and drain; False if the client is gone or cannot take it for --write-timeout."""
        if conn.writer.transport.is_closing():
            return False
        conn.writer.write(data)
        transport = conn.writer.transport
        if transport.get_write_buffer_size() < transport.get_write_buffer_limits()[1]:
            return True  # under the high-water mark drain() would not wait: skip its timer (per event)
        try:
            await asyncio.wait_for(conn.writer.drain(), self.args.write_timeout)
        except asyncio.TimeoutError:
            conn.writer.transport.abort()  # a reader that stopped reading: drop it
            return False
        except ConnectionError:
            return False
        return True

    async def watch(self, conn, job):
        """End-of-file on the request side means the client closed: stop at once.
        (A client that half-closes after its request looks the same: see the README.)"""
        try:
            while await conn.reader.read(READ_SIZE):
                pass
        except ConnectionError:
            pass
        conn.gone = True
        if job is not None:
            job.stop.set()

    def watcher(self, conn, job):
        return None if self.args.naive else asyncio.create_task(self.watch(conn, job))

    async def pieces(self, job, on_silence=None):
        """Yield the job's text pieces until its end. Raise ProtocolError(500) if its thread
        failed. After --ping seconds without a piece, call on_silence(); if that says the reader
        is gone (False), stop the job and return early."""
        while True:
            if not job.out.empty():  # a piece is ready: take it without a task or a timer
                item = await job.get()
            else:
                getter = asyncio.ensure_future(job.get())
                while not getter.done():
                    done, _ = await asyncio.wait({getter}, timeout=self.args.ping)
                    if not done and on_silence is not None and not await on_silence():
                        getter.cancel()
                        job.stop.set()
                        return
                item = getter.result()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise ProtocolError(f"generation failed: {item}", 500, close_code=1011, kind="generation_failed")
            yield item

    # --- POST /complete ----------------------------------------------------------------------

    async def complete(self, conn, job):
        watcher = self.watcher(conn, job)
        try:
            text = "".join([piece async for piece in self.pieces(job)])
        finally:
            left = job.stop.is_set()
            if watcher:
                watcher.cancel()
            self.record("/complete", await job.done, left)
        if not left:
            conn.writer.write(json_response(200, {"text": text}))

    # --- POST /stream: server-sent events ------------------------------------------------------

    async def stream(self, conn, job):
        conn.writer.write(SSE_HEAD)
        conn.started = True
        watcher = self.watcher(conn, job)
        try:
            left = await self.relay(
                conn, job, lambda piece: sse.event(json.dumps({"text": piece})), sse.comment("ping")
            )
            end = b"data: [DONE]\n\n"
        except ProtocolError as e:  # after the 200 the status can't change: an error event
            left, end = False, sse.event(json.dumps(error_body(e)), event="error")
        if watcher:
            watcher.cancel()
        left = left or conn.gone
        if not left:
            await self.send(conn, end)
        self.record("/stream", await job.done, left)

    async def relay(self, conn, job, frame, keep_alive, matcher=None):
        """Send each piece of the job as `frame(piece)` (through a StopMatcher if given), and
        `keep_alive` during silence; return whether the reader left. Without --naive a failed
        write stops the job; with it, the job goes on for nobody. Raises the job's failure."""
        left = False

        async def silence():
            nonlocal left
            left = left or not await self.send(conn, keep_alive)
            return not left

        async for piece in self.pieces(job, on_silence=silence):
            if left:
                continue  # --naive: keep generating for nobody
            text = matcher.push(piece) if matcher else piece
            if text and not await self.send(conn, frame(text)):
                left = True
                if not self.args.naive:
                    job.stop.set()
                    break
            if matcher and matcher.matched is not None:
                job.stop.set()
                break
        if matcher and not left and (rest := matcher.flush()):
            left = not await self.send(conn, frame(rest))
        return left

    # --- resumable streams: GET /stream, Last-Event-ID, POST /stop (resume.py) -----------------

    def wants_resume(self, request):
        """A POST /stream is the article's (it stops when its reader leaves) unless it resumes an
        earlier stream or its body asks for {"resumable": true}."""
        if "last-event-id" in request.headers or "last_event_id" in request.query:
            return True
        return flag(request.json(), "resumable")

    async def resumable(self, conn, request):
        last = request.headers.get("last-event-id", request.query.get("last_event_id"))
        if last is not None:  # a reader coming back: what it missed, then the live rest
            found = self.streams.find(last)
            if found is None:  # unknown, forgotten, or already complete: 204 stops EventSource
                conn.writer.write(response(204, content_type=None))
                return
            await self.follow(conn, *found)
            return
        body = query_body(request.query) if request.method == "GET" else request.json()
        body.pop("resumable", None)
        params = parse_params(body)
        ids = await asyncio.to_thread(encode_prompt, params)
        rec = self.streams.create(self.job(ids, params))
        rec.add(json.dumps({"id": rec.id}), event="stream")  # event 0 names the stream, for /stop
        pump = asyncio.create_task(self.pump(rec))
        self.pumps.add(pump)
        pump.add_done_callback(self.pumps.discard)
        await self.follow(conn, rec, -1)

    async def pump(self, rec):
        """Move the job's pieces into its recording, whoever is reading (or nobody, for a while)."""
        job = rec.job
        try:
            async for piece in self.pieces(job):
                rec.add(json.dumps({"text": piece}))
            rec.add("[DONE]")
        except ProtocolError as e:
            rec.add(json.dumps(error_body(e)), event="error")
        finally:
            job.stop.set()
            rec.end()
            self.record("/stream", await job.done, job.reason == "stopped", "stopped early")

    async def follow(self, conn, rec, after):
        """Send a recording's events after number `after`, then each new one as it comes, with a
        keep-alive during silence, until its end or until this reader leaves (which starts the
        grace period if it was the last reader)."""
        conn.writer.write(SSE_HEAD + f"retry: {RETRY_MS}\n\n".encode())
        conn.started = True
        rec.attach()
        watcher = asyncio.create_task(self.watch(conn, None))
        k, sent = after + 1, 0
        try:
            while True:
                while k < len(rec.events):
                    if not await self.send(conn, rec.events[k]):
                        return
                    k, sent = k + 1, sent + 1
                    if (
                        self.args.drop_after
                        and sent >= self.args.drop_after
                        and not (rec.ended and k == len(rec.events))
                    ):
                        conn.writer.transport.abort()  # testing: the network blinks
                        return
                if rec.ended:
                    return
                grew = asyncio.ensure_future(rec.grew.wait())
                done, _ = await asyncio.wait(
                    {grew, watcher}, timeout=self.args.ping, return_when=asyncio.FIRST_COMPLETED
                )
                grew.cancel()
                if watcher in done:
                    return
                if not done and not await self.send(conn, sse.comment("ping")):
                    return
        finally:
            watcher.cancel()
            rec.detach(None if self.args.naive else self.args.resume_grace)

    def stop_stream(self, conn, body):
        rec = self.streams.streams.get(body.get("id")) if isinstance(body.get("id"), str) else None
        if rec is None:
            raise ProtocolError("no such stream (or it was forgotten)", 404)
        rec.job.stop.set()
        conn.writer.write(json_response(200, {"id": rec.id, "stopped": not rec.ended}))

    # --- GET /ws: WebSocket ------------------------------------------------------------------

    async def websocket(self, conn, request, trailing):
        conn.writer.write(ws.handshake(request, self.args.allow_origin))  # ProtocolError: an HTTP answer
        conn.started = True
        session = conn.ws = WebSocket(conn, trailing)
        self.websockets.add(session)
        try:
            await self.ws_session(session)
        finally:
            self.websockets.discard(session)

    async def ws_request(self, s):
        """The first message: the request's parameters and prompt ids, or a close 1008."""
        try:
            first = await asyncio.wait_for(s.receive(), self.args.request_timeout)
        except asyncio.TimeoutError:
            raise ProtocolError("no request message arrived in time", close_code=1008) from None
        if first is None:
            return None  # the client left before asking anything
        try:
            body = json.loads(first)
            if not isinstance(body, dict):
                raise ValueError
        except ValueError:
            raise ProtocolError("the first message must be a JSON object", close_code=1008) from None
        try:
            params = parse_params(body)
            return params, await asyncio.to_thread(encode_prompt, params)
        except ProtocolError as e:
            s.send_text(json.dumps(error_body(e)))  # the details, then the close code
            raise ProtocolError(e.message, close_code=1008) from None

    async def ws_session(self, s):
        request = await self.ws_request(s)
        if request is None:
            return
        job = self.job(request[1], request[0])
        listener = asyncio.create_task(s.listen(job))

        async def ping():
            return s.send_ping()

        try:
            async for piece in self.pieces(job, on_silence=ping):
                s.send_text(json.dumps({"text": piece}))
                if not await s.drain(self.args.write_timeout):
                    job.stop.set()
            stopped = job.stop.is_set()
            s.send_text(json.dumps({"done": True}))
            await s.close(1000)
        except ProtocolError as e:
            stopped = job.stop.is_set()
            s.send_text(json.dumps(error_body(e)))
            await s.close(1011, "generation failed")
        finally:
            job.stop.set()
            listener.cancel()
        self.record("/ws", await job.done, stopped, "client said stop")

    # --- /v1/...: the OpenAI and Anthropic wire formats (apis.py) ------------------------------

    def model_id(self):
        name = lm.model_name()
        return {"bundled": lm.BUNDLED_NAME.removesuffix("-q4_k_m")}.get(name, name)

    async def api(self, conn, request):
        openai = request.path != "/v1/messages"
        fail = apis.openai_error if openai else apis.anthropic_error
        if self.args.api_key:
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if given != self.args.api_key:
                raise fail("invalid or missing API key", 401, **({"code": "invalid_api_key"} if openai else {}))
        if request.path == "/v1/models":
            model = {"id": self.model_id(), "object": "model", "created": 0, "owned_by": "streaming-tokens"}
            if not openai:
                model = {"id": self.model_id(), "type": "model", "display_name": self.model_id()}
            conn.writer.write(json_response(200, {"object": "list", "data": [model]}))
            return
        try:
            messages, params, options = (apis.openai_request if openai else apis.anthropic_request)(request.json())
            ids = await asyncio.to_thread(encode_chat, messages, params)
        except ProtocolError as e:
            raise (e if getattr(e, "body", None) else fail(e.message, 400)) from None
        job = self.job(ids, params)
        try:
            if options["stream"]:
                await self.api_stream(conn, request.path, job, options, openai, len(ids))
            else:
                await self.api_whole(conn, request.path, job, options, openai, len(ids))
        finally:
            job.stop.set()

    def finish(self, job, matcher, openai):
        """(finish/stop reason, stop sequence) in each API's words."""
        if matcher.matched is not None:
            return ("stop", None) if openai else ("stop_sequence", matcher.matched)
        if job.reason == "length":
            return ("length", None) if openai else ("max_tokens", None)
        return ("stop", None) if openai else ("end_turn", None)

    async def api_whole(self, conn, path, job, options, openai, prompt_tokens):
        watcher = self.watcher(conn, job)
        matcher, parts = apis.StopMatcher(options["stop"]), []
        try:
            async for piece in self.pieces(job):
                parts.append(matcher.push(piece))
                if matcher.matched is not None:
                    job.stop.set()
                    break
            parts.append(matcher.flush())
        except ProtocolError as e:
            raise (apis.openai_error if openai else apis.anthropic_error)(e.message, 500) from None
        finally:
            if watcher:
                watcher.cancel()
            produced = await job.done
            self.record(path, produced, conn.gone)
        reason, sequence = self.finish(job, matcher, openai)
        model, text = self.model_id(), "".join(parts)
        if openai:
            value = apis.openai_completion(model, text, reason, prompt_tokens, produced)
        else:
            value = apis.anthropic_message(model, text, reason, sequence, prompt_tokens, produced)
        if not conn.gone:
            conn.writer.write(json_response(200, value))

    async def api_stream(self, conn, path, job, options, openai, prompt_tokens):
        if openai:
            enc = apis.OpenAIStream(self.model_id(), options["include_usage"], options["obfuscation"])
        else:
            enc = apis.AnthropicStream(self.model_id(), prompt_tokens)
        conn.writer.write(SSE_HEAD)
        conn.started = True
        watcher = self.watcher(conn, job)
        matcher = apis.StopMatcher(options["stop"])
        first = await self.send(conn, enc.role() if openai else enc.start())
        # Anthropic sends ping events during silence; for OpenAI's clients a comment does.
        keep_alive = sse.comment("ping") if openai else enc.ping()
        end = None
        try:
            left = await self.relay(conn, job, enc.text, keep_alive, matcher) or not first
        except ProtocolError as e:  # after the 200: the API's own error event
            left, end = not first, enc.error(e.message)
        if watcher:
            watcher.cancel()
        produced = await job.done
        left = left or conn.gone
        if end is None:
            reason, sequence = self.finish(job, matcher, openai)
            end = enc.end(reason, prompt_tokens, produced) if openai else enc.end(reason, sequence, produced)
        if not left:
            await self.send(conn, end)
        self.record(path, produced, left)

    # --- shutdown ------------------------------------------------------------------------------

    async def shutdown(self, server):
        server.close()
        for job in list(ACTIVE):
            job.stop.set()
        await asyncio.gather(*(s.close(1001, "server shutting down") for s in list(self.websockets)))
        for task in list(self.connections) + list(self.pumps):
            task.cancel()
        await asyncio.gather(*self.connections, *self.pumps, return_exceptions=True)
        deadline = time.monotonic() + 5
        for job in list(ACTIVE):
            await asyncio.to_thread(job.thread.join, max(0.0, deadline - time.monotonic()))


class WebSocket:
    """A server-side WebSocket session over a Connection: receive messages (answering pings and
    close frames on the way), send text, and close with the handshake both ways (RFC 6455 §7)."""

    def __init__(self, conn, trailing=b""):
        self.conn = conn
        self.parser = ws.Parser(mask_required=True)
        self.parser.feed(trailing)
        self.close_sent = False
        self.peer_closed = asyncio.Event()  # the client's close frame (or end-of-file) arrived
        self.listening = False  # listen() is reading frames, so it will see the client's close

    async def receive(self):
        """The next text message, or None when the client closed. Raises ProtocolError."""
        while True:
            item = self.parser.next()
            if item is None:
                data = await self.conn.reader.read(READ_SIZE)
                if not data:
                    self.peer_closed.set()
                    return None
                self.parser.feed(data)
                continue
            if isinstance(item, ws.Message):
                if item.opcode == ws.BINARY:
                    raise ProtocolError("binary messages are not supported; send JSON text", close_code=1003)
                return item.text()
            if item.opcode == ws.PING:
                self.write(ws.serialize(ws.Frame(ws.PONG, item.data)))  # §5.5.3: same payload
            elif item.opcode == ws.CLOSE:
                code, _ = ws.parse_close(item.data)
                if not self.close_sent:  # §5.5.1: answer with a close, echoing the code
                    self.close_sent = True
                    payload = b"" if code == 1005 else ws.close_payload(code)
                    self.write(ws.serialize(ws.Frame(ws.CLOSE, payload)))
                self.peer_closed.set()
                return None
            # a pong (ours are unsolicited keep-alives): nothing to do

    async def listen(self, job):
        """While the server streams: {"stop": true}, a close frame or end-of-file stop the job."""
        self.listening = True
        try:
            while (message := await self.receive()) is not None:
                try:
                    value = json.loads(message)
                except json.JSONDecodeError:
                    raise ProtocolError("messages must be JSON", close_code=1008) from None
                if isinstance(value, dict) and value.get("stop"):
                    job.stop.set()
        except ProtocolError as e:
            job.stop.set()
            await self.close(e.close_code, e.message)
        except ConnectionError:
            pass
        finally:
            self.listening = False
        job.stop.set()

    def write(self, data):
        if not self.conn.writer.transport.is_closing():
            self.conn.writer.write(data)

    def send_text(self, text):
        if not self.close_sent:
            self.write(ws.text_frame(text))

    def send_ping(self):
        if self.close_sent or self.conn.writer.transport.is_closing():
            return False
        self.write(ws.serialize(ws.Frame(ws.PING, b"keep-alive")))
        return True

    async def drain(self, timeout):
        try:
            await asyncio.wait_for(self.conn.writer.drain(), timeout)
            return not self.conn.writer.transport.is_closing()
        except asyncio.TimeoutError:
            self.conn.writer.transport.abort()
            return False
        except ConnectionError:
            return False

    async def close(self, code=1000, reason=""):
        """Send our close frame (once) and close TCP. After a normal end (1000) or at shutdown
        (1001), first wait briefly for the client's close frame, which listen() reads (§7.1.1);
        after a protocol error the connection is failed at once (§7.1.7)."""
        if not self.close_sent:
            self.close_sent = True
            self.write(ws.close_frame(code, reason))
        await self.drain(CLOSE_WAIT)
        if self.listening and code in (1000, 1001) and not self.peer_closed.is_set():
            try:
                await asyncio.wait_for(self.peer_closed.wait(), CLOSE_WAIT)
            except asyncio.TimeoutError:
                pass
        self.conn.writer.close()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--naive", action="store_true", help="the article's naive server: never notices a reader leaving")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 picks a free port (printed)")
    lm.add_arguments(p)
    p.add_argument(
        "--engine",
        choices=["batched", "thread", "free"],
        default="batched",
        help="batched: one thread steps every request at once (engine.py); thread: the article's thread per "
        "request; free: no model, ' x' pieces at once (measures the server's own cost per event)",
    )
    p.add_argument("--max-batch", type=int, default=engine.MAX_BATCH, help="batched: requests per step; more wait")
    p.add_argument("--prefill-chunk", type=int, default=engine.PREFILL_CHUNK, help="batched: prompt tokens per step")
    p.add_argument("--queue", type=int, default=0, help="thread engine: bound each request's queue to N pieces")
    p.add_argument("--write-timeout", type=float, default=30.0, help="drop a client whose writes can't drain for S s")
    p.add_argument("--ping", type=float, default=15.0, help="keep-alive after S s without an event")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT, help="408 if a request takes longer")
    p.add_argument(
        "--allow-origin", action="append", default=[], help="a browser Origin allowed to open /ws (repeat; * for any)"
    )
    p.add_argument("--api-key", default=None, help="require this key on /v1/ (Authorization: Bearer, or x-api-key)")
    p.add_argument("--token-delay", type=float, default=0.0, help="testing: sleep S s after each token")
    p.add_argument("--fail-after", type=int, default=None, help="testing: fail generation after N tokens")
    p.add_argument("--first-delay", type=float, default=0.0, help="testing: S s of silence before the first token")
    p.add_argument(
        "--drop-after", type=int, default=0, help="testing: drop a resumable stream's connection every N events"
    )
    p.add_argument(
        "--resume-grace", type=float, default=resume.GRACE_SECONDS, help="keep generating S s for a reader to come back"
    )
    p.add_argument(
        "--resume-keep", type=float, default=resume.KEEP_SECONDS, help="keep an ended stream S s for resuming"
    )
    p.add_argument("--resume-streams", type=int, default=resume.KEEP_COUNT, help="keep at most N ended streams")
    args = p.parse_args(argv)
    if args.queue and args.engine == "batched":
        p.error("--queue bounds a generation thread; use it with --engine thread")
    if args.max_batch < 1 or args.prefill_chunk < 1:
        p.error("--max-batch and --prefill-chunk must be at least 1")
    return args


async def serve(args):
    srv = Server(args)
    server = await asyncio.start_server(srv.handle, args.host, args.port)  # asyncio sets TCP_NODELAY
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://{args.host}:{port}{' (naive)' if args.naive else ''}", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, done.set)
    async with server:
        await done.wait()
        await srv.shutdown(server)
    print("shut down", flush=True)


def main(argv=None):
    args = parse_args(argv)
    lm.configure(args)
    engine.configure(args.max_batch, args.prefill_chunk, args.token_delay)
    t0 = time.perf_counter()
    lm.model()
    for _ in lm.tokens("Hello", 2):  # warm up, so the first request's time to first text is honest
        pass
    dtype = str(lm.dtype()).removeprefix("torch.")
    dtype += ", int8 Linear layers" if lm.quantization() == "int8" else ""
    print(f"model {lm.model_name()} on {lm.DEVICE} in {dtype}, ready in {time.perf_counter() - t0:.1f} s", flush=True)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
