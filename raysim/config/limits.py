"""Bounds of config values that are finite but absurd, and the one-line check that reports them.

Each bound refuses only what no run uses and what would otherwise crash deep inside a library
or silently ruin the run (exit 0 with a NaN model): torch turns a learning rate or weight decay
into a float32 (max 3.4e38: "value cannot be converted to type float without overflow"),
time.sleep(1e300) overflows, a CPU count of 1e300 cannot become a thread count.
"""

from __future__ import annotations

import math
from typing import Any

from raysim.errors import ConfigError

# A billion rounds (or clients) is beyond any simulation raysim can finish; more is a typo that
# would otherwise surface as an allocation traceback (the client offsets, the progress bar's
# arithmetic) or a run that never ends.
MAX_COUNT = 10**9  # the most rounds, and clients, a config may ask for
MAX_LEARNING_RATE = 1e4  # a step of 1e4 x the gradient already diverges every model we train
MAX_WEIGHT_DECAY = 1e4  # idem: lr x weight_decay > 2 makes SGD diverge
# Adaptive server optimizers step by m / (sqrt(v) + eps). A tiny delta (|d| < 1e-162) has
# d^2 = 0: with a subnormal eps such as 1e-320 its step is m / eps, 1e150 and more. Useful eps
# values are 1e-8 .. 1e-1.
MIN_EPS = 1e-30
MAX_WAIT_S = 86_400.0  # one day: a longer straggler delay or round deadline is a typo
MAX_TASK_RESOURCES = 1024.0  # CPUs or GPUs of one task or actor: it runs on one machine
# Local epochs of one client in one round: the papers raysim reproduces use 1-20; 1e12 would
# make round 1 never end (the step count, epochs x batches, is bounded in raysim.core.loop).
MAX_LOCAL_EPOCHS = 10_000
# Clients of one vmapped call (clients.batch_chunk): each holds 22-40 bytes per model parameter
# there (docs/BATCHED.md), so 100,000 clients of a 10k-parameter MLP are already 22-40 GB.
MAX_BATCH_CHUNK = 100_000


def require(source: str, condition: bool, key: str, expected: str, value: Any) -> None:
    """Raise "SOURCE: 'KEY' must be EXPECTED, got VALUE" unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{source}: '{key}' must be {expected}, got {value!r}")


def finite(value: float) -> bool:
    return math.isfinite(value)


def is_path(value: str | None) -> bool:
    """A path option: unset, or a non-empty string without NUL (which no file system takes)."""
    return value is None or (value != "" and "\0" not in value)
