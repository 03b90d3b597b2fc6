"""The generation layer: token ids in, text pieces out on an asyncio queue, stoppable per token.

- job.py: `Job`, what every engine runs for a request: its stop flag, its queue of pieces, the
  one per-token routine (end of sequence, detokenizer, injected failure, length), and `wait()`.
- thread.py: the article's engine, a thread per request over `lm.tokens`.
- engine.py: the step-batched engine, one thread stepping every request at once (the default),
  with kv.py (its batch's KV cache) and policy.py (which rows run each step: fifo or qoe).
- quant.py: weight-only int8/int4 Linear layers on torch's CPU kernels (--quantize).
- free.py: no model at all, for measuring the server's own cost per event.
- prompts.py: a prompt or a conversation into token ids, checked against the context.
- runner.py: `Runner`, which the server owns: it starts jobs on the chosen engine and counts them.

A new engine is a module here with a Job subclass, and one line in runner.ENGINES.
"""
