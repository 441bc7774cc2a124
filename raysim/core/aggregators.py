"""Aggregators: pure functions from the round's client contributions to one vector.

An aggregator sees each client's `Contribution` (client id, the decoded dense update, its
number of training samples, the statistics it declared) and the round's facts (`RoundInfo`,
e.g. how many sampled clients are malicious, which robust aggregators such as Multi-Krum are
granted, as in the FRL paper). Contributions arrive in client-id order.

The protocol (a plug-in may implement either form):
    linear = True:  weight(contribution) -> float, normalize: bool; the server folds
                    weight * update in as updates arrive (O(model) memory)
    linear = False: aggregate(contributions, info) -> np.ndarray, given the whole round

Linear aggregators (mean, weighted mean, sum) also come as a streaming accumulator so the server
can fold updates in as they arrive and hold O(model) memory instead of O(clients x model). The
pure functions are defined as the fold over that same accumulator, so streaming and batch
aggregation give bit-identical results (client-id order; float64 for floats, exact int64 for
integer updates such as FRL's rank positions or SignSGD's signs).
Non-linear aggregators (trimmed mean, median, Multi-Krum) receive all updates of the round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raysim.core.fixed_point import INT64_MAX, SumOverflowError, checked_add, peak_of
from raysim.core.state import Contribution, RoundInfo


def _dtype_peak(dtype: np.dtype) -> int | None:
    """The largest magnitude any value of a small integer dtype can have (int8: 128); None for
    64-bit integers, whose values must be looked at."""
    if dtype.itemsize >= 8:
        return None
    info = np.iinfo(dtype)
    return max(int(info.max), -int(info.min))


# add_rows: float64 rows weighted at a time; small enough to stay in the caches and under
# glibc's mmap threshold (a block of 32 MiB was mapped and faulted in anew: 2x slower)
ROWS_BLOCK_BYTES = 1024 * 1024


class LinearAccumulator:
    """Running sum of weight * vector, folded in the order updates are added.

    Float vectors accumulate in float64; integer vectors (with integer weights) in int64, which
    is exact, so any grouping of the sum gives the same result. An integer sum never wraps
    around: `add` keeps an upper bound of the total's largest magnitude (the sum of the terms'
    |weight| x max |value|, from the dtype when it is narrower than 64 bits, so FRL's int64
    positions cost one max/min pass and SignSGD's int8 signs none) and checks the sum exactly
    only when that bound passes 2^63 - 1; a weighted term or a total outside int64 raises
    SumOverflowError and leaves the accumulator as it was.
    """

    def __init__(self, normalize: bool = True) -> None:
        self.normalize = normalize
        self.total: np.ndarray | None = None
        self.weight_sum = 0.0
        self.count = 0
        self._bound = 0  # >= max |self.total| while the total is an int64 sum

    def add(self, vector: np.ndarray, weight: float) -> None:
        integer = np.issubdtype(vector.dtype, np.integer) and float(weight).is_integer()
        if self.total is None:
            self.total = np.zeros(vector.shape, dtype=np.int64 if integer else np.float64)
        if self.total.dtype == np.int64 and integer:
            self._add_integer(vector, int(weight))
        else:
            if self.total.dtype == np.int64:
                self.total = self.total.astype(np.float64)
            self.total += float(weight) * vector.astype(np.float64, copy=False)
        self.weight_sum += float(weight)
        self.count += 1

    def add_rows(self, rows: np.ndarray, weights: Sequence[float]) -> None:
        """`add` of each row of a 2-D array with its weight, in order: for float rows the same
        float64 sum bit for bit (each row's weighted values are the same products, added one
        row after another), with numpy's work done a block of rows at a time; integer rows
        (FRL's positions) in one exact int64 sum when it fits (`_add_integer_rows`)."""
        if len(rows) != len(weights):
            raise ValueError(f"{len(rows)} rows but {len(weights)} weights")
        if self._add_integer_rows(rows, weights):
            return
        if rows.dtype.kind != "f" or (self.total is not None and self.total.dtype != np.float64):
            for row, weight in zip(rows, weights, strict=True):
                self.add(row, weight)
            return
        if self.total is None and len(rows):
            self.total = np.zeros(rows.shape[1:], dtype=np.float64)
        per_block = max(1, ROWS_BLOCK_BYTES // max(1, 8 * rows[0].size)) if len(rows) else 1
        for first in range(0, len(rows), per_block):
            block = rows[first : first + per_block].astype(np.float64)
            factors = np.array([float(w) for w in weights[first : first + per_block]])
            block *= factors.reshape(-1, *([1] * (block.ndim - 1)))
            for weighted in block:
                self.total += weighted
        for weight in weights:
            self.weight_sum += float(weight)
        self.count += len(rows)

    def _add_integer_rows(self, rows: np.ndarray, weights: Sequence[float]) -> bool:
        """`add` of integer rows with integer weights in one int64 sum when their terms'
        bounds keep the total inside int64 (integer sums are exact in any grouping: the same
        total, bound, weight sum and count as row by row); False, changing nothing, otherwise
        (float rows or weights, a total that is not int64, or a sum near the limit)."""
        if rows.ndim != 2 or rows.dtype.kind not in "iu" or not len(rows):
            return False
        if self.total is not None and self.total.dtype != np.int64:
            return False
        if not all(float(w).is_integer() for w in weights):
            return False
        factors = [int(w) for w in weights]
        high, low = rows.max(axis=1).tolist(), rows.min(axis=1).tolist()
        bound = sum(
            abs(f) * max(abs(h), abs(lo)) for f, h, lo in zip(factors, high, low, strict=True)
        )
        if self._bound + bound > INT64_MAX:
            return False  # row by row: the exact checks name the term or sum that fails
        if self.total is None:
            self.total = np.zeros(rows.shape[1:], dtype=np.int64)
        values = rows.astype(np.int64, copy=False)
        if all(f == 1 for f in factors):
            self.total += values.sum(axis=0)
        else:
            self.total += (np.array(factors, dtype=np.int64)[:, None] * values).sum(axis=0)
        self._bound += bound
        for weight in weights:
            self.weight_sum += float(weight)
        self.count += len(rows)
        return True

    def _add_integer(self, vector: np.ndarray, weight: int) -> None:
        """total += weight * vector in int64, exactly (see the class docstring)."""
        peak = _dtype_peak(vector.dtype)
        if peak is None or self._bound + abs(weight) * peak > INT64_MAX:
            peak = peak_of(vector)  # exact: decides whether the term and the sum fit
        if peak == 0:  # a zero vector adds nothing, whatever its weight
            return
        term_bound = abs(weight) * peak
        if term_bound > INT64_MAX:
            raise SumOverflowError(
                f"an integer update times its weight leaves int64 (weight {weight} x max "
                f"|value| {peak} = {float(term_bound):.3g}, beyond 2^63 - 1)"
            )
        values = vector.astype(np.int64, copy=False)
        term = values if weight == 1 else weight * values  # x 1 is exact: skip the copy
        if self._bound + term_bound <= INT64_MAX:
            self.total += term
            self._bound += term_bound
            return
        self.total, self._bound = checked_add(
            self.total,
            self._bound,
            term,
            term_bound,
            "the round's integer updates",
            f"integer updates too large to add up over {self.count + 1} clients",
        )

    def result(self) -> np.ndarray:
        if self.total is None or (self.normalize and self.weight_sum <= 0):
            raise ValueError("no client update with positive weight was aggregated this round")
        if not self.normalize:
            return self.total.copy()
        return (self.total / self.weight_sum).astype(np.float32)


def _fold(vectors: Sequence[np.ndarray], weights: Sequence[float], normalize: bool) -> np.ndarray:
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    accumulator = LinearAccumulator(normalize)
    for vector, weight in zip(vectors, weights, strict=True):
        accumulator.add(vector, weight)
    return accumulator.result()


def weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """sum_i w_i v_i / sum_i w_i, accumulated in the given order."""
    return _fold(vectors, weights, normalize=True)


def mean(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Uniform average: every client counts the same whatever its data size."""
    return weighted_mean(vectors, [1.0] * len(vectors))


def total(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Plain sum (int64 for integer vectors): FRL's vote, SignSGD's majority count."""
    return _fold(vectors, [1] * len(vectors), normalize=False)


def contributions_of(
    vectors: Sequence[np.ndarray], num_samples: Sequence[int] | None = None
) -> list[Contribution]:
    """Contributions of clients 0..n-1 (tests, attacks simulating the server's rule)."""
    counts = [1] * len(vectors) if num_samples is None else list(num_samples)
    if len(counts) != len(vectors):
        raise ValueError(f"{len(vectors)} vectors but {len(counts)} sample counts")
    return [
        Contribution(i, vector, int(n))
        for i, (vector, n) in enumerate(zip(vectors, counts, strict=True))
    ]


class LinearAggregator:
    """Base of the streaming aggregators: weight per contribution, optional normalisation."""

    linear = True
    normalize = True

    def weight(self, contribution: Contribution) -> float:
        return 1.0

    def aggregate(
        self, contributions: Sequence[Contribution], info: RoundInfo | None = None
    ) -> np.ndarray:
        return _fold(
            [c.update for c in contributions],
            [self.weight(c) for c in contributions],
            self.normalize,
        )


class Mean(LinearAggregator):
    """Uniform averaging of client updates."""


class WeightedMean(LinearAggregator):
    """FedAvg's average, each client weighted by its number of training samples."""

    def weight(self, contribution: Contribution) -> float:
        return float(contribution.num_samples)


class Sum(LinearAggregator):
    """Sum of the updates, unweighted and not normalised (exact for integer updates)."""

    normalize = False

    def weight(self, contribution: Contribution) -> int:  # type: ignore[override]
        return 1
