"""Engine processes that break the pipe's protocol, for tests/test_process.py: each stands in for
process_child.main (spawned, so it lives in a module of its own that the child can import)."""


def serve_then(conn, garble):
    """Say ready; at the first request, send `garble(conn)`'s nonsense and stay up until told to
    exit (a process that garbles is alive: only the server can end it)."""
    conn.send(("ready", "a fake engine", 2048, {}))
    garbled = False
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "exit":
            return
        if msg[0] == "submit" and not garbled:
            garble(conn, msg[1])
            garbled = True


def unpicklable(conn, _jid):
    conn.send_bytes(b"this is no pickle")


def out_of_protocol(conn, jid):
    conn.send(("batch", [("piece", jid, "fine", (1,), 1), ("piece", jid)]))  # the second is cut short


def sends_bytes_that_are_no_message(conn, _settings):
    serve_then(conn, unpicklable)


def sends_a_message_out_of_the_protocol(conn, _settings):
    serve_then(conn, out_of_protocol)
