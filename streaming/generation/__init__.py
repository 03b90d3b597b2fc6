"""The generation layer: token ids in, text pieces out on an asyncio queue, stoppable per token.
A new engine is a module here with a Job subclass and an entry in backend.ENGINES (and, if
its jobs share state, as the batched thread or the upstream pool, a line in Backend.__init__).
Every module is listed in the README's Layout section."""
