"""Resumable streams: GET /stream, Last-Event-ID, POST /stop, and with --store redis:// streams
any replica can resume and take over. endpoints.py speaks HTTP; streams.py is what the server
holds (`Streams`); the rest are its parts. Every module is listed in the README's Layout."""
