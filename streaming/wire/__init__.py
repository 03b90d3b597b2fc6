"""The wire layer: bytes in, values out, and back. Nothing here imports asyncio or torch, and
nothing does I/O; the server and the clients feed bytes in and write bytes out. A new wire
format is a module here. Every module is listed in the README's Layout section."""
