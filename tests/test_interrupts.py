"""Ctrl-C during a run: never inside the outputs' bookkeeping, at once everywhere else."""

from __future__ import annotations

import signal
import threading

import pytest

from raysim import interrupts


def _ctrl_c() -> None:
    """SIGINT to this thread (the main one), where Python runs its handlers. A process-wide
    os.kill may land on another thread (Ray's, the outputs writer's), which only flags it for
    the main thread: on a loaded machine that can come after the lines a test checks."""
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)


def test_a_ctrl_c_inside_a_deferred_block_is_raised_when_the_block_ends():
    finished = []
    with pytest.raises(KeyboardInterrupt), interrupts.handled():
        with interrupts.deferred():
            _ctrl_c()
            finished.append("the block ran to its end")
        finished.append("not reached")
    assert finished == ["the block ran to its end"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_ctrl_c_outside_deferred_blocks_is_raised_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts.handled():
        _ctrl_c()
        for _ in range(1000):  # the handler runs between bytecodes: well before this ends
            pass
        reached.append("after")
    assert reached == []


def test_a_handler_someone_else_installed_is_left_alone():
    def mine(signum, frame):
        mine.calls += 1

    mine.calls = 0
    previous = signal.signal(signal.SIGINT, mine)
    try:
        with interrupts.handled():
            assert signal.getsignal(signal.SIGINT) is mine
            _ctrl_c()
        assert mine.calls == 1
    finally:
        signal.signal(signal.SIGINT, previous)
