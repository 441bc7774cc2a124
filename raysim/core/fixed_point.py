"""Exact sums of float updates in integer fixed point, for any linear aggregation.

A value v sent with weight w is added as round(v * w * 2^32) in int64. Integer addition is
exact and associative, so the sum does not depend on the order in which updates arrive or on
how clients are packed into tasks and tasks into workers: any packing, any number of workers
and either backend give the same total bit for bit. The resolution 2^-32 is far below
float32's resolution of the weights being updated; |v * w| must stay below 2^20 (2^52 / 2^32:
exact in float64), and up to 2^11 such terms fit int64.

Beyond 2^11 terms near that limit an int64 sum would wrap around silently (a huge positive
total read as a negative one). Every sum here therefore carries an upper bound of its largest
magnitude (a Python int: the sum of its terms' bounds). While the bounds say the result fits,
the sum is plain numpy addition (no extra pass over the data); only when they say it might not
is it checked exactly, and a sum that leaves int64 raises SumOverflowError instead of wrapping.

This module imports nothing from raysim.algorithms.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import numpy as np

from raysim.errors import RaysimError

FIXED_POINT_BITS = 32
FIXED_SCALE = float(2**FIXED_POINT_BITS)
# |value * weight| * 2^32 must stay below 2^52 (exact in float64; 2^11 such terms fit int64).
FIXED_LIMIT = float(2**52)
# A float32 value (24-bit significand) times an integer weight below 2^29 is exact in float64.
MAX_FIXED_WEIGHT = 2**29
INT64_MAX = 2**63 - 1
_LOW_BITS = 32
_LOW_MASK = np.int64(2**_LOW_BITS - 1)


class SumOverflowError(RaysimError):
    """An exact integer sum (fixed-point updates, integer votes) would leave int64's range."""


def to_fixed(values: np.ndarray, weight: int, client_id: int) -> np.ndarray:
    """round(values * weight * 2^32) as int64, exactly (float32 x integer fits float64)."""
    return to_fixed_bounded(values, weight, client_id)[0]


def to_fixed_bounded(values: np.ndarray, weight: int, client_id: int) -> tuple[np.ndarray, int]:
    """`to_fixed` and an upper bound of the result's largest magnitude (at most 2^52), from
    the maximum the range check computes anyway: the bound costs nothing."""
    scaled = values.astype(np.float64) * (float(weight) * FIXED_SCALE)
    peak = 0.0
    if scaled.size:
        peak = float(np.max(np.abs(scaled)))
        if not math.isfinite(peak) or peak >= FIXED_LIMIT:
            raise ValueError(
                f"client {client_id}: update too large or not finite for exact aggregation "
                f"(max |value x samples| = {peak / FIXED_SCALE:.3g}; limit 2^20): did local "
                f"training diverge? lower clients.lr"
            )
    # rint(x) is at most ceil(|x|) in magnitude
    return np.rint(scaled).astype(np.int64), math.ceil(peak)


# Integers up to 2^53 in magnitude are exact in float64, and so is a sum of them that stays there.
EXACT_FLOAT64 = 2**53


def fixed_bound(peak: float, weight: int) -> int:
    """An upper bound of |round(v x weight x 2^32)| for |v| <= peak (the bound
    `to_fixed_bounded` returns): peak x weight x 2^32 is exact (24-bit x 29-bit significands)."""
    return math.ceil(float(peak) * (float(weight) * FIXED_SCALE))


def to_fixed_known_peak(values: np.ndarray, weight: int, peak: float) -> tuple[np.ndarray, int]:
    """`to_fixed_bounded` for `values` whose largest magnitude `peak` has been checked already
    (finite, peak x weight x 2^32 below FIXED_LIMIT): the same numbers without another pass
    for the peak or the range check."""
    return _scaled(values, float(weight) * FIXED_SCALE).astype(np.int64), fixed_bound(peak, weight)


FOLD_SCRATCH = 1 << 15  # elements scaled and rounded at a time: the scratch stays in cache


class ChunkedValues(ABC):
    """1-D float32 values computed a range at a time, for `add_fixed_in_place` to fold without
    materialising them (FedAwS's DenseDelta: a client's parameters minus theta, read where
    they lie)."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def read_chunk(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """The float32 values [start, stop): written into `out` (float32, at least
        stop - start long) and returned, or a view of values already held."""


def add_fixed_in_place(total: np.ndarray, values, weight: int, scratch=None) -> float:
    """total += round(values * weight * 2^32) for a float64 `total` of integers, when every
    acceptable term keeps the sum within EXACT_FLOAT64 (the caller's bound plus FIXED_LIMIT
    is at most EXACT_FLOAT64): each step is then exact, so this is the int64 sum bit for bit.

    `values`: a 1-D float32 array, or a ChunkedValues that computes its float32 values a range
    at a time (e.g. a client's parameters minus theta, read where they lie). Returns max
    |values|. The values are checked as they are folded in, a cache-sized chunk at a time
    (each chunk is read once for the check and the conversion; `scratch`, reused across
    calls, from `fold_scratch()`): at the first chunk holding a NaN or Inf, or a value too
    large for exact aggregation, the chunks already added are subtracted again (exact too),
    `total` is left as it was, and that chunk's peak is returned (NaN, inf or
    >= FIXED_LIMIT / (weight x 2^32)) for the caller to refuse them."""
    scale = float(weight) * FIXED_SCALE
    scratch = scratch if scratch is not None else fold_scratch()
    flat_total = total.reshape(-1)
    peak = 0.0
    for start, chunk in _chunks(values, scratch):
        high, low = float(chunk.max()), float(chunk.min())
        chunk_peak = math.nan if math.isnan(high) or math.isnan(low) else max(high, -low)
        if not chunk_peak * scale < FIXED_LIMIT:  # (False for NaN too)
            for undo_start, undo in _chunks(values, scratch, stop=start):
                part = _scaled(undo, scale, scratch)
                flat_total[undo_start : undo_start + len(part)] -= part
            return chunk_peak
        peak = max(peak, chunk_peak)
        part = _scaled(chunk, scale, scratch)
        flat_total[start : start + len(part)] += part
    return peak


def add_fixed_where_they_lie(total, trained, base, weight: int) -> float:
    """`add_fixed_in_place` for values that are torch tensors, `trained - base` (float32, 1-D),
    into a float64 tensor `total` on their device: a GPU client's trained row is folded
    there, and only the sum ever crosses to the host (a full-scale FedAwS client's dense
    delta is 2.1M values; 4,000 of them a round converted on the host cost more than the
    clients' training).

    The same result bit for bit: the difference is one float32 subtraction as numpy's; its
    peak is taken per FOLD_SCRATCH block as `add_fixed_in_place` takes it per chunk, and the
    first block that fails (NaN, Inf, too large) gives the returned peak, with `total` left as
    it was; otherwise round(value x weight x 2^32) (exact in float64: float32 x an integer
    below 2^29 x a power of two; torch.round rounds half to even, as np.rint) is added to
    integers below 2^53, which is exact in any order."""
    import torch

    values = torch.sub(trained, base)  # float32, as np.subtract gives it
    count = values.numel()
    if not count:
        return 0.0
    scale = float(weight) * FIXED_SCALE
    whole = count // FOLD_SCRATCH * FOLD_SCRATCH
    # Each block's max |value| from its min and max (aminmax and maximum propagate NaN), a few
    # kernels a client: on a GPU a client's fold is launch-bound, not arithmetic-bound.
    peaks = []
    if whole:
        low, high = torch.aminmax(values[:whole].view(-1, FOLD_SCRATCH), dim=1)
        peaks.append(torch.maximum(high, low.neg_()))
    if whole < count:
        low, high = torch.aminmax(values[whole:].view(1, -1), dim=1)
        peaks.append(torch.maximum(high, low.neg_()))
    peaks = peaks[0] if len(peaks) == 1 else torch.cat(peaks)
    block_peaks = peaks.cpu().numpy().astype(np.float64)  # (one small copy to the host)
    failing = np.flatnonzero(~(block_peaks * scale < FIXED_LIMIT))  # (NaN fails too)
    if len(failing):
        return float(block_peaks[failing[0]])
    part = values.to(torch.float64)
    part.mul_(scale)
    part.round_()
    total.add_(part)
    return float(block_peaks.max())


def fold_scratch() -> tuple[np.ndarray, np.ndarray]:
    """Scratch arrays for `add_fixed_in_place` (float32 and float64, FOLD_SCRATCH each)."""
    return np.empty(FOLD_SCRATCH, dtype=np.float32), np.empty(FOLD_SCRATCH, dtype=np.float64)


def _chunks(values, scratch, stop: int | None = None):
    """(start, float32 chunk) over values[:stop], FOLD_SCRATCH at a time."""
    stop = len(values) if stop is None else stop
    read = values.read_chunk if isinstance(values, ChunkedValues) else None
    flat = values.reshape(-1) if read is None else None
    for start in range(0, stop, FOLD_SCRATCH):
        end = min(stop, start + FOLD_SCRATCH)
        yield start, (flat[start:end] if read is None else read(start, end, scratch[0]))


def _scaled(values: np.ndarray, scale: float, scratch=None) -> np.ndarray:
    """round(values x scale) in float64 (exact: float32 x integer fits float64), in
    scratch[1] when given, else in a new array."""
    if scratch is None:
        part = np.empty(values.shape, dtype=np.float64)
    else:
        part = scratch[1][: len(values)]
    part[...] = values  # (a plain conversion, then a float64 multiply: both vectorised,
    part *= scale  # faster than one multiply that converts on the fly)
    np.rint(part, out=part)
    return part


def peak_of(values: np.ndarray) -> int:
    """The largest magnitude of an integer array, exactly (a Python int; 0 when empty)."""
    if not values.size:
        return 0
    return max(int(values.max()), -int(values.min()))


# What to do about an overflowing sum of fixed-point updates (FedAwS): each client is already
# held to |value x samples| < 2^20, so only many clients near that limit get here.
FIXED_POINT_HINT = (
    "too many clients with updates near the limit |value x samples| < 2^20: did local "
    "training diverge? lower clients.lr or clients.per_round"
)


def _overflow(what: str, bound: int, hint: str) -> SumOverflowError:
    return SumOverflowError(
        f"the exact int64 sum of {what} overflows (its terms add up to magnitudes near "
        f"{float(bound):.3g}, beyond 2^63): {hint}"
    )


def checked_add(
    a: np.ndarray, a_bound: int, b: np.ndarray, b_bound: int, what: str, hint=FIXED_POINT_HINT
) -> tuple[np.ndarray, int]:
    """(a + b, a bound of its largest magnitude), exact, or SumOverflowError.

    `a_bound`, `b_bound`: upper bounds of max |a|, max |b|. When their sum fits int64 this is
    a plain `a + b`; otherwise the sum is checked for wrap-around (a signed sum overflowed
    exactly where both operands' signs differ from the result's), and its bound recomputed
    exactly so that later sums take the plain path again when they can."""
    if a_bound + b_bound <= INT64_MAX:
        return a + b, a_bound + b_bound
    total = a + b  # may wrap: checked before it is returned
    if (((a ^ total) & (b ^ total)) < 0).any():
        raise _overflow(what, a_bound + b_bound, hint)
    return total, peak_of(total)


def sum_rows_by_id(
    ids: np.ndarray, rows: np.ndarray, bound: int | None, what: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(ids, sums of the int64 rows sharing each id, a bound of the sums' largest magnitude),
    exact, so the order of `ids` does not matter.

    `bound`: an upper bound of the sum of the rows' largest magnitudes (None: computed, one
    pass); while it fits int64 no group's sum can overflow and the sum is a plain `add.at`.
    Otherwise the sum is done exactly on the high and low 32 bits apart (neither can wrap for
    fewer than 2^31 rows) and a group whose total leaves int64 raises SumOverflowError."""
    if not len(ids):
        return ids.astype(np.int64), rows, 0
    if bound is None:
        bound = len(rows) * peak_of(rows)
    unique, inverse = np.unique(ids, return_inverse=True)
    total = np.zeros((len(unique), *rows.shape[1:]), dtype=np.int64)
    if bound <= INT64_MAX:
        np.add.at(total, inverse, rows)
        return unique, total, bound
    # rows = high * 2^32 + low with high in [-2^31, 2^31) and low in [0, 2^32)
    high = np.zeros_like(total)
    np.add.at(high, inverse, rows >> _LOW_BITS)
    np.add.at(total, inverse, rows & _LOW_MASK)  # the low parts' sums, carries included
    high += total >> _LOW_BITS
    if ((high < -(2**31)) | (high >= 2**31)).any():
        raise _overflow(what, bound, FIXED_POINT_HINT)
    total = (high << _LOW_BITS) | (total & _LOW_MASK)
    return unique, total, peak_of(total)


def concat_rows(parts: list[np.ndarray], shape_tail: tuple[int, ...], dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, *shape_tail), dtype=dtype)
