"""Ctrl-C that never lands inside the run's output bookkeeping.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside the outputs'
queue hand-offs (a lock held by `queue.Queue`, a `Condition.wait`) or half-way through a
checkpoint write, that can leave a lock held, so that the run's clean-up waits forever instead
of printing where to resume. While a run is in progress, raysim's SIGINT handler therefore
holds a Ctrl-C that arrives inside a `deferred()` block until the block ends (blocks are short:
queueing a record, writing a checkpoint) and raises it everywhere else at once, as Python would.
Only Python's default handler in the main thread is replaced; anything else stays as it is.

SIGTERM (a scheduler, `kill`, a container stopping; and the only polite stop of a run started
in the background from a non-interactive shell, where SIGINT is ignored) is a clean stop: the
first one asks the round loop to stop after the round in progress, which it checkpoints
(`stop_requested`, then `Terminated`); a second one stops at once, like Ctrl-C. The CLI exits
with 143 (128 + SIGTERM), after one line naming the checkpoint and `raysim run --resume DIR`.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from collections.abc import Iterator

_STATE = {"depth": 0, "pending": False, "stop": False, "pending_stop": False}


class Terminated(KeyboardInterrupt):
    """The run was stopped by SIGTERM (a KeyboardInterrupt, so every clean-up of a Ctrl-C runs)."""


def _on_sigterm(signum, frame) -> None:
    if not _STATE["stop"]:
        _STATE["stop"] = True  # the round loop stops after the round in progress
        return
    if _STATE["depth"]:  # a second one: at once, as Ctrl-C
        _STATE["pending_stop"] = True
        return
    raise Terminated


def stop_requested() -> bool:
    """Whether a SIGTERM asked the run to stop after the round in progress."""
    return _STATE["stop"]


def reclaim_sigterm() -> None:
    """Install raysim's SIGTERM handler again inside `handled()` (ray.init replaces it with one
    that calls sys.exit anywhere, which ended runs in aborts and tracebacks)."""
    if _STATE.get("sigterm_previous") is not None and (
        threading.current_thread() is threading.main_thread()
    ):
        signal.signal(signal.SIGTERM, _on_sigterm)


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
        if not _STATE["depth"] and _STATE["pending_stop"]:
            _STATE["pending_stop"] = False
            raise Terminated
        if not _STATE["depth"] and _STATE["pending"]:
            _STATE["pending"] = False
            raise KeyboardInterrupt


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Run the block with raysim's SIGINT and SIGTERM handlers (each where Python's default one
    is installed and this is the main thread; otherwise unchanged)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # Each signal separately: a run started in the background from a non-interactive shell
    # has SIGINT ignored, and SIGTERM is then the only polite stop.
    own_sigint = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    own_sigterm = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    if own_sigint:
        signal.signal(signal.SIGINT, _on_sigint)
    if own_sigterm:
        _STATE["sigterm_previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        if own_sigint:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if own_sigterm:
            signal.signal(signal.SIGTERM, _STATE.pop("sigterm_previous", None) or signal.SIG_DFL)
        _STATE.update(pending=False, stop=False, pending_stop=False)


def with_handler(function):
    """Decorate `function` to run inside `handled()`."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with handled():
            return function(*args, **kwargs)

    return wrapper
