"""A generation request: its checked parameters, and the thread that feeds its queue.

As the article's `generate`: a thread per request samples with `choose` (through lm.tokens),
checks a stop flag before every token, and hands text through the incremental detokenizer
(flushed at the end) to the request's asyncio queue with `call_soon_threadsafe`. `None` marks
the end; an exception in the thread arrives on the queue as that exception, not as an end.
The event loop never waits on the model.

The queue is unbounded by default, as the article's: a slow reader makes it grow while the model
runs at full speed. With `queue_size`, a thread that is that many pieces ahead waits (checking
its stop flag) until the reader catches up. One thread, one sequence: engine.py batches.
"""

import asyncio
import json
import threading
import time

import lm
from detokenizer import StreamDetokenizer
from http11 import ProtocolError

MAX_TOKENS = 4096  # per request: 422 past it. Bounds one request's KV cache and thread time.
DEFAULT_MAX_TOKENS = 100  # the article's


def number(body, name, default, low, high, integer=False):
    value = body.get(name, default)
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise ProtocolError(f"{name} must be {kind} from {low} to {high}", 422, kind="invalid_request")
    return value


def parse_params(body):
    """Check a request's JSON object; return the generation parameters or raise 400/422."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ProtocolError("prompt must be a string", 422 if "prompt" in body else 400, kind="invalid_request")
    if not prompt:
        raise ProtocolError("prompt must not be empty", 422, kind="invalid_request")
    return {
        "prompt": prompt,
        "max_tokens": number(body, "max_tokens", DEFAULT_MAX_TOKENS, 1, MAX_TOKENS, integer=True),
        "seed": number(body, "seed", 0, 0, 2**63 - 1, integer=True),
        "temperature": number(body, "temperature", 1.0, 0, 100),
        "top_p": number(body, "top_p", 0.9, 1e-6, 1.0),
        "ignore_eos": flag(body, "ignore_eos"),
    }


def query_body(query):
    """A GET request's parameters (`?prompt=...&max_tokens=20`) as the JSON body a POST sends:
    every value but the prompt read as JSON (numbers, true/false), else kept as text for
    parse_params to reject."""
    body = {}
    for name, value in query.items():
        try:
            body[name] = value if name == "prompt" else json.loads(value)
        except ValueError:
            body[name] = value
    return body


def flag(body, name):
    """A boolean option (vLLM's `ignore_eos`: generate exactly max_tokens, for measurements)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"{name} must be true or false", 422, kind="invalid_request")
    return value


def encode_prompt(params):
    """Token ids of the prompt; 422 if prompt and answer cannot fit the model's context."""
    return check_context(lm.tok(params["prompt"]).input_ids, params)


def encode_chat(messages, params):
    """Token ids of a conversation through the model's chat template, ready for the answer."""
    text = lm.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return check_context(lm.tok(text, add_special_tokens=False).input_ids, params)


def check_context(ids, params):
    context = getattr(lm.model().config, "max_position_embeddings", None)
    if context and len(ids) + params["max_tokens"] > context:
        raise ProtocolError(
            f"prompt of {len(ids)} tokens plus max_tokens {params['max_tokens']} exceeds the context of {context}",
            422,
            kind="invalid_request",
        )
    return ids


ACTIVE = set()  # the jobs whose thread is running; read by /metrics and shutdown
STOPS = {"stopped": 0, "tokens_after_stop": 0}  # requests stopped early, and tokens generated after their stop


class StopFlag(threading.Event):
    """A request's stop flag, which remembers how many tokens its job had generated when it was
    set: the tokens after that are the ones generated for nobody (the article's claim is at most
    one, the token being computed when the flag went up)."""

    def __init__(self, job):
        super().__init__()
        self.job, self.at = job, None

    def set(self):
        if self.at is None:
            self.at = self.job.produced
        super().set()


class Job:
    """One request's generation: `stop` (an Event), `get()` for pieces, `done` (tokens produced)."""

    def __init__(self, ids, params, queue_size=0, token_delay=0.0, fail_after=None, first_delay=0.0):
        self.loop = asyncio.get_running_loop()
        self.ids, self.params = ids, params
        self.stop = StopFlag(self)
        self.produced = 0  # tokens so far, written by the thread
        self.out = asyncio.Queue()
        self.slots = threading.Semaphore(queue_size) if queue_size else None
        self.done = self.loop.create_future()  # the number of tokens generated, EOS included
        self.reason = None  # why it ended: "eos", "length" (max_tokens) or "stopped" (the flag)
        self.token_delay, self.fail_after = token_delay, fail_after  # for tests and experiments
        self.first_delay = first_delay  # testing: a silence before the first token, as a long prefill
        self.thread = threading.Thread(target=self.run, name="generate", daemon=True)

    def start(self):
        ACTIVE.add(self)
        self.thread.start()
        return self

    async def get(self):
        """The next piece of text (str), None at the end, or the exception that ended it."""
        item = await self.out.get()
        if self.slots is not None and isinstance(item, str):
            self.slots.release()
        return item

    def put(self, item):
        """From the thread: hand an item to the loop. With a bounded queue, wait for room."""
        if self.slots is not None and isinstance(item, str):
            while not self.slots.acquire(timeout=0.05):
                if self.stop.is_set():
                    return
        self.call(self.out.put_nowait, item)

    def call(self, fn, *args):
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed (shutdown): nobody is waiting any more
            pass

    def run(self):
        produced, ends = 0, lm.stop_ids()
        try:
            d = StreamDetokenizer()
            p = self.params
            if self.first_delay:
                self.stop.wait(self.first_delay)
            for token in lm.tokens(
                self.ids,
                p["max_tokens"],
                seed=p["seed"],
                temperature=p["temperature"],
                top_p=p["top_p"],
                stop=self.stop,
                ignore_eos=p.get("ignore_eos", False),
            ):
                produced = self.produced = produced + 1
                if token in ends and not p.get("ignore_eos", False):
                    self.reason = "eos"
                    break
                if piece := d.push(token):
                    self.put(piece)
                if self.fail_after is not None and produced >= self.fail_after:
                    raise RuntimeError(f"injected failure after {produced} tokens (--fail-after)")
                if self.token_delay:
                    time.sleep(self.token_delay)
            if rest := d.flush():
                self.put(rest)
            if self.reason is None:
                self.reason = "stopped" if self.stop.is_set() else "length"
            self.put(None)
        except Exception as e:  # noqa: BLE001 - any failure must reach the handler as an error
            self.put(e)
        finally:
            self.call(self.finish, produced)

    def finish(self, produced):
        ACTIVE.discard(self)
        if self.reason == "stopped" and self.stop.at is not None:
            STOPS["stopped"] += 1
            STOPS["tokens_after_stop"] += produced - self.stop.at
        if not self.done.done():
            self.done.set_result(produced)
