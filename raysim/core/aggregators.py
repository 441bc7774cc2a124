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

from raysim.core.state import Contribution, RoundInfo


class LinearAccumulator:
    """Running sum of weight * vector, folded in the order updates are added.

    Float vectors accumulate in float64; integer vectors (with integer weights) in int64, which
    is exact, so any grouping of the sum gives the same result.
    """

    def __init__(self, normalize: bool = True) -> None:
        self.normalize = normalize
        self.total: np.ndarray | None = None
        self.weight_sum = 0.0
        self.count = 0

    def add(self, vector: np.ndarray, weight: float) -> None:
        integer = np.issubdtype(vector.dtype, np.integer) and float(weight).is_integer()
        if self.total is None:
            self.total = np.zeros(vector.shape, dtype=np.int64 if integer else np.float64)
        if self.total.dtype == np.int64 and integer:
            self.total += int(weight) * vector.astype(np.int64, copy=False)
        else:
            if self.total.dtype == np.int64:
                self.total = self.total.astype(np.float64)
            self.total += float(weight) * vector.astype(np.float64, copy=False)
        self.weight_sum += float(weight)
        self.count += 1

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
