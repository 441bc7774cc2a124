"""What crosses the wire, and exact byte accounting.

Byte counts are of the payload as encoded for transport: a dense float32 vector costs 4 bytes
per entry; nested containers cost the sum of their arrays (container overhead is not counted,
since a real deployment would frame it differently).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def encoded_nbytes(payload: Any) -> int:
    """Bytes of the arrays in `payload` (ndarray, or dict/list/tuple of them; scalars: 8)."""
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    if isinstance(payload, Mapping):
        return sum(encoded_nbytes(v) for v in payload.values())
    if isinstance(payload, list | tuple):
        return sum(encoded_nbytes(v) for v in payload)
    if isinstance(payload, bytes | bytearray | memoryview):
        return len(payload)
    if isinstance(payload, int | float | np.number):
        return 8
    if payload is None:
        return 0
    if hasattr(payload, "__wire_nbytes__"):  # a payload object that knows what it sends
        return int(payload.__wire_nbytes__())
    raise TypeError(f"cannot count the bytes of a {type(payload).__name__} payload")
