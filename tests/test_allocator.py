"""`runtime.tune_malloc` (raysim/runtime/allocator.py): in a process that trains clients, a
freed block of megabytes stays with the process for the next step instead of going back to
the kernel (whose pages the next step would fault in again); off, glibc's defaults hold."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from raysim.config.build import from_dict

# A fresh process (this one may be tuned already by a local run): tune or not, then allocate,
# touch and free 16 MiB with the C library's own malloc, and print how much of it the
# process still holds (resident KiB) after the free.
PROBE = """
import ctypes, sys
from raysim.runtime.allocator import tune_malloc

def resident_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

tuned = tune_malloc(sys.argv[1] == "on")
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
size = 16 * 1024 * 1024
before = resident_kib()
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print(tuned, resident_kib() - before)
"""


def _kept_after_free(setting: str) -> tuple[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, setting], capture_output=True, text=True, check=True
    )
    tuned, kept_kib = result.stdout.split()
    return tuned, int(kept_kib)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc options")
def test_a_tuned_process_keeps_a_freed_block_for_reuse_and_an_untuned_one_returns_it():
    tuned, kept = _kept_after_free("on")
    assert tuned == "True" and kept >= 15 * 1024  # the 16 MiB stay resident, ready for reuse
    tuned, kept = _kept_after_free("off")
    assert tuned == "False" and kept < 1024  # glibc's default: a block this large is unmapped


def test_tune_malloc_is_on_by_default_and_a_config_can_turn_it_off():
    assert from_dict({}).runtime.tune_malloc is True
    assert from_dict({}, ["runtime.tune_malloc=false"]).runtime.tune_malloc is False
