"""Checks of the `data:` options a loader takes: one line naming the option for a bad value.

Shared by every loader (and the synthetic generators' size bound), so that `data.num_test: -1`
reads the same whichever dataset it was given to.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from raysim.errors import ConfigError


def _int_option(key: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"'data.{key}' must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"'data.{key}' must be >= {minimum}, got {number}")
    return number


# The most feature values a synthetic generator makes: 2^30 float32 values are 4 GiB (the
# largest built-in setting, 4,000,000 x 16 samples, is 2^26). A config asking for more is a
# typo that would otherwise end in a MemoryError after minutes of drawing.
GENERATED_VALUES_LIMIT = 2**30


def _generated_size(what: str, values: int, lower: str = "data.num_samples") -> None:
    """Refuse a synthetic dataset of more than GENERATED_VALUES_LIMIT values (one line)."""
    if values > GENERATED_VALUES_LIMIT:
        raise ConfigError(
            f"{what} asks for {values:,} feature values, more than {GENERATED_VALUES_LIMIT:,} "
            f"(4 GiB of float32); lower {lower}"
        )


def _float_option(key: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ConfigError(f"'data.{key}' must be a number, got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number < minimum or (strict and number == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ConfigError(f"'data.{key}' must be a finite number {bound}, got {value!r}")
    return number


def _shape_option(key: str, value: Any) -> tuple[int, ...]:
    values = (
        [value] if isinstance(value, int | np.integer) and not isinstance(value, bool) else value
    )
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) == 0:
        raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
    shape = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int | np.integer) or item < 1:
            raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
        shape.append(int(item))
    return tuple(shape)
