"""Python's cyclic garbage collector in processes that run rounds (the one adapter to `gc`).

Why: a full collection walks every container object the process tracks, and a process that
runs rounds tracks ~350,000 (torch, torch.func, numpy and the run's own: measured in a
10,000-client FedAvg run on the local backend); one walk took 0.15 s on the 2-core machine.
Python starts one whenever the objects that outlived two younger collections pass a quarter of
the old ones, and a round of thousands of clients leaves that many (each client's update,
metrics and data views live until the server has folded them): the 10,000-client round paid
0.15 s every other round, 0.62 s against 0.78 s (docs/BATCHED.md, "Speed").

What: once a full collection has happened during a run's rounds in this process, what the
process holds then is frozen (`gc.freeze`): left out of later collections (reference counting
still frees it as ever), so a full collection walks only what the rounds made since. Small
runs never freeze. When the next run starts in the process (a reused Ray worker, a test
process), or the run ends (`release`), everything is unfrozen, and the next full collection
frees any cycle among the frozen objects; a new run freezes only after that collection has
happened. The price: a reference cycle made before the freeze and dropped after it waits for
the run's end. Nothing computed changes.
"""

from __future__ import annotations

import gc

# This process's run (a key per run: the Ray bundle's id, the local backend), the count of
# full collections when its first round ended, and whether this module froze the objects.
_run: object = None
_full_collections = 0
_frozen = False


def after_round(run_key: object) -> None:
    """Called by a process after each round (or client task) it ran for the run `run_key`:
    unfreezes a previous run's objects, and freezes once full collections happen (see the
    module's docstring). Leaves alone a process where something else froze objects."""
    global _run, _full_collections, _frozen
    full = gc.get_stats()[2]["collections"]
    if _run is None or _run != run_key:  # this run's first round in this process
        release()
        _run, _full_collections = run_key, full
        return
    if not _frozen and full > _full_collections and gc.get_freeze_count() == 0:
        gc.freeze()
        _frozen = True


def release() -> None:
    """Unfreeze what `after_round` froze (a run ends in this process)."""
    global _run, _frozen
    if _frozen:
        gc.unfreeze()
        _frozen = False
    _run = None


def frozen() -> bool:
    """Whether this module holds the process's objects frozen now."""
    return _frozen


__all__ = ["after_round", "frozen", "release"]
