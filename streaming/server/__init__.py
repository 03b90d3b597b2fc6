"""The asyncio server: each connection's requests (protocol.py), one exchange per request (its
head and its errors), handlers given a Context and an Exchange (never the server), and one answer
lifecycle for every endpoint that generates (answer.py). A new endpoint is a handler in its
family's module and a line in routes.ROUTES. Every module is listed in the README's Layout."""
