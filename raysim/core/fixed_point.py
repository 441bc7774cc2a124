"""Exact sums of float updates in integer fixed point, for any linear aggregation.

A value v sent with weight w is added as round(v * w * 2^32) in int64. Integer addition is
exact and associative, so the sum does not depend on the order in which updates arrive or on
how clients are packed into tasks and tasks into workers: any packing, any number of workers
and either backend give the same total bit for bit. The resolution 2^-32 is far below
float32's resolution of the weights being updated; |v * w| must stay below 2^20 (2^52 / 2^32:
exact in float64), and up to 2^11 such terms fit int64.

This module imports nothing from raysim.algorithms.
"""

from __future__ import annotations

import math

import numpy as np

FIXED_POINT_BITS = 32
FIXED_SCALE = float(2**FIXED_POINT_BITS)
# |value * weight| * 2^32 must stay below 2^52 (exact in float64; 2^11 such terms fit int64).
FIXED_LIMIT = float(2**52)


def to_fixed(values: np.ndarray, weight: int, client_id: int) -> np.ndarray:
    """round(values * weight * 2^32) as int64, exactly (float32 x integer fits float64)."""
    scaled = values.astype(np.float64) * (float(weight) * FIXED_SCALE)
    if scaled.size:
        peak = float(np.max(np.abs(scaled)))
        if not math.isfinite(peak) or peak >= FIXED_LIMIT:
            raise ValueError(
                f"client {client_id}: update too large or not finite for exact aggregation "
                f"(max |value x samples| = {peak / FIXED_SCALE:.3g}; limit 2^20): did local "
                f"training diverge? lower clients.lr"
            )
    return np.rint(scaled).astype(np.int64)


def exceeds_fixed_range(values: np.ndarray, weight: int) -> bool:
    """Whether max |values| x weight is too large for an exact fixed-point sum."""
    return float(np.max(np.abs(values))) * weight * FIXED_SCALE >= FIXED_LIMIT


def sum_rows_by_id(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum int64 rows that share an id (exact, so the order of `ids` does not matter)."""
    if not len(ids):
        return ids.astype(np.int64), rows
    unique, inverse = np.unique(ids, return_inverse=True)
    total = np.zeros((len(unique), *rows.shape[1:]), dtype=np.int64)
    np.add.at(total, inverse, rows)
    return unique, total


def concat_rows(parts: list[np.ndarray], shape_tail: tuple[int, ...], dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, *shape_tail), dtype=dtype)
