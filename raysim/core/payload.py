"""What crosses the wire, and exact byte accounting.

Byte counts are of the payload as encoded for transport: a dense float32 vector costs 4 bytes
per entry; nested containers cost the sum of their arrays (container overhead is not counted,
since a real deployment would frame it differently).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np


class WireSized(ABC):
    """A payload object that knows how many bytes it sends (FedAwS's Broadcast, a client's
    ClassRow, a DenseDelta read where it lies): counted as `wire_nbytes()`, not from its
    fields, which may hold bookkeeping that is not sent."""

    @abstractmethod
    def wire_nbytes(self) -> int:
        """The bytes this object puts on the wire."""


def encoded_nbytes(payload: Any) -> int:
    """Bytes of the arrays in `payload` (ndarray, or dict/list/tuple of them; scalars: 8; a
    WireSized object: its own count)."""
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
    if isinstance(payload, WireSized):
        return int(payload.wire_nbytes())
    raise TypeError(f"cannot count the bytes of a {type(payload).__name__} payload")
