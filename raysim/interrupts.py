"""Ctrl-C that never lands inside the run's output bookkeeping.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside the outputs'
queue hand-offs (a lock held by `queue.Queue`, a `Condition.wait`) or half-way through a
checkpoint write, that can leave a lock held, so that the run's clean-up waits forever instead
of printing where to resume. While a run is in progress, raysim's SIGINT handler therefore
holds a Ctrl-C that arrives inside a `deferred()` block until the block ends (blocks are short:
queueing a record, writing a checkpoint) and raises it everywhere else at once, as Python would.
Only Python's default handler in the main thread is replaced; anything else stays as it is.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Iterator

_STATE = {"depth": 0, "pending": False}


def _on_sigint(signum, frame) -> None:
    if _STATE["depth"]:
        _STATE["pending"] = True  # raised when the deferred block ends
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block until the block has ended."""
    _STATE["depth"] += 1
    try:
        yield
    finally:
        _STATE["depth"] -= 1
        if not _STATE["depth"] and _STATE["pending"]:
            _STATE["pending"] = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Run the block with raysim's SIGINT handler (when Python's default one is installed and
    this is the main thread; otherwise unchanged)."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _STATE["pending"] = False


def with_handler(function):
    """Decorate `function` to run inside `handled()`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with handled():
            return function(*args, **kwargs)

    return wrapper
