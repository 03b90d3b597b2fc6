"""One process at a time: an exclusive lock (flock) on a file in a cache folder.

The lock goes with the file's close, so a process that dies, however it dies, frees it. Used where
processes started together on one machine (replicas, a benchmark's servers, the tests' fixtures)
would otherwise fill one cache entry at once, or time their kernels beside each other's timings.

Leaves out: locking where flock is not (Windows, some network file systems): there it does not
lock, and the callers' writes are whole files renamed into place anyway.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def alone(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold `path`'s lock for the block; `waiting()` is called first if another process holds it.
    A file that cannot be made (read-only folder): no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a+b")  # noqa: SIM115 - held across the yield
    except OSError:
        yield
        return
    with lock:
        try:
            import fcntl

            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                fcntl.flock(lock, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        yield
