"""The C library's allocator in processes that train clients (the one adapter to glibc's malloc).

Why: a batched round allocates and frees tensors of megabytes every step (the chunk's stacked
parameters, their gradients, the SGD step's results: 100 digits-MLP clients are 3.8 MB a
tensor). glibc serves such a block from fresh pages of its own mmap, or from the top of its
heap, which it hands back to the kernel once more than a few megabytes lie free there; either
way the next step writes to pages the kernel must fault in again, one 4 KiB page at a time.
On a virtual machine a page fault costs microseconds: the peers' "many" workload (100 clients
of 1-2 samples a round, batched, local backend) spent 4.4 ms a round in the SGD step's four
tensor operations, which take 0.4 ms on warm memory.

`runtime.tune_malloc` (on by default) therefore sets two glibc options, once per process that
trains clients or folds their updates (the driver on the local backend, Ray's client workers
and the server actor): allocations up to 32 MiB (glibc's largest heap threshold) come from the
heap, and up to 256 MiB of freed heap top is kept for reuse instead of being returned. Larger
blocks (FedAwS's class table) are still mapped and unmapped on their own. The price: a process
keeps up to 256 MiB of freed memory it may reuse, beside what it holds. Measured on the
"many" workload, local backend, 300 rounds: 17.0 ms a round with glibc's defaults, 11.5 ms
with these (docs/BATCHED.md). Nothing computed changes: the options decide where blocks come
from, not their alignment, which torch fixes at 64 bytes.

Elsewhere (macOS, musl) there is no such option to set, and nothing is done.
"""

from __future__ import annotations

import ctypes
import os
import platform

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
HEAP_UP_TO_BYTES = 32 * 1024 * 1024  # glibc's largest mmap threshold on 64-bit
KEEP_FREED_BYTES = 256 * 1024 * 1024

# (the process id that tried, whether the options are set): tried once per process, since
# a Ray worker calls this for every task and platform.libc_ver() reads the Python executable
# (a fork inherits the options, not the need to try)
_TRIED: tuple[int, bool] | None = None


def tune_malloc(enabled: bool) -> bool:
    """Set glibc's options in this process (once; `enabled`: `runtime.tune_malloc`). True if
    they are set, now or before; False where disabled or not glibc."""
    global _TRIED
    if not enabled:
        return False
    if _TRIED is not None and _TRIED[0] == os.getpid():
        return _TRIED[1]
    done = _set_options()
    _TRIED = (os.getpid(), done)
    return done


def _set_options() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        done = libc.mallopt(_M_MMAP_THRESHOLD, HEAP_UP_TO_BYTES) == 1
        return libc.mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BYTES) == 1 and done
    except (OSError, AttributeError):  # a glibc without mallopt: nothing to tune
        return False


__all__ = ["HEAP_UP_TO_BYTES", "KEEP_FREED_BYTES", "tune_malloc"]
