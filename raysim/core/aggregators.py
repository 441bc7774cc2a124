"""Aggregators: pure functions from the round's client updates to one update.

Linear aggregators (mean, weighted mean) also come as a streaming accumulator so the server can
fold updates in as they arrive and hold O(model) memory instead of O(clients x model). The pure
function is defined as the fold over that same accumulator, so streaming and batch aggregation
give bit-identical results (summation in client-id order, float64 accumulator).
Non-linear aggregators (trimmed mean, median, Multi-Krum) receive all updates of the round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raysim.core.state import ClientUpdate


class LinearAccumulator:
    """Running sum of weight * vector in float64, folded in the order updates are added."""

    def __init__(self) -> None:
        self.total: np.ndarray | None = None
        self.weight_sum = 0.0
        self.count = 0

    def add(self, vector: np.ndarray, weight: float) -> None:
        if self.total is None:
            self.total = np.zeros(vector.shape, dtype=np.float64)
        self.total += float(weight) * vector.astype(np.float64, copy=False)
        self.weight_sum += float(weight)
        self.count += 1

    def result(self) -> np.ndarray:
        if self.total is None or self.weight_sum <= 0:
            raise ValueError("no client update with positive weight was aggregated this round")
        return (self.total / self.weight_sum).astype(np.float32)


def weighted_mean(vectors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """sum_i w_i v_i / sum_i w_i, accumulated in the given order."""
    if len(vectors) != len(weights):
        raise ValueError(f"{len(vectors)} vectors but {len(weights)} weights")
    accumulator = LinearAccumulator()
    for vector, weight in zip(vectors, weights, strict=True):
        accumulator.add(vector, weight)
    return accumulator.result()


def mean(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Uniform average: every client counts the same whatever its data size."""
    return weighted_mean(vectors, [1.0] * len(vectors))


class Mean:
    """Uniform averaging of client updates."""

    linear = True

    def weight(self, update: ClientUpdate) -> float:
        return 1.0

    def aggregate(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        return mean([u.vector for u in updates])


class WeightedMean:
    """FedAvg's average, each client weighted by its number of training samples."""

    linear = True

    def weight(self, update: ClientUpdate) -> float:
        return float(update.num_samples)

    def aggregate(self, updates: Sequence[ClientUpdate]) -> np.ndarray:
        return weighted_mean([u.vector for u in updates], [self.weight(u) for u in updates])
