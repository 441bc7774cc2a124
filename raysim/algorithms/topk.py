"""TopK sparsification of FedAvg's client deltas (Aji & Heafield, "Sparse Communication for
Distributed Gradient Descent", EMNLP 2017; Stich, Cordonnier, Jaggi, "Sparsified SGD with
Memory", NeurIPS 2018), as the FRL paper's sparse-communication baseline.

Round t: every sampled client trains locally exactly like FedAvg and keeps only the k =
round(fraction * d) entries of its delta x_i - x_t with the largest magnitude (at least one),
sent as float32 values plus int32 indices: exactly 8k bytes. The server scatters each message
into a dense delta (zeros elsewhere), averages them (`aggregator: weighted_mean` by default)
and applies FedAvg's server optimizer. No error feedback (Stich et al.'s memory would need
per-client state); the broadcast stays dense float32 weights.
"""

from __future__ import annotations

import numpy as np

from raysim.algorithms.fedavg import _DeltaAveraging
from raysim.core.algorithm import RunContext
from raysim.errors import ConfigError
from raysim.models.vector import cached_model, vector_size


def num_kept(size: int, fraction: float) -> int:
    """k = round(fraction * size), at least 1."""
    return max(1, min(size, round(fraction * size)))


def top_k(vector: np.ndarray, k: int) -> dict[str, np.ndarray]:
    """The k largest-magnitude entries: float32 values at int32 indices (ascending indices).

    Ties in magnitude go to the lower index (a stable sort), so the message is deterministic.
    """
    order = np.argsort(-np.abs(vector), kind="stable")[:k]
    indices = np.sort(order).astype(np.int32)
    return {"values": vector[indices].astype(np.float32), "indices": indices}


def densify(message: dict[str, np.ndarray], size: int) -> np.ndarray:
    """The dense float32 delta a top-k message stands for (zeros where nothing was sent)."""
    dense = np.zeros(size, dtype=np.float32)
    dense[message["indices"]] = message["values"]
    return dense


class TopK(_DeltaAveraging):
    default_aggregator = "weighted_mean"

    def __init__(self, *, fraction: float = 0.1) -> None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"'algorithm.fraction' must be in (0, 1], got {fraction}")
        super().__init__(proximal_mu=0.0)
        self.fraction = float(fraction)

    def encode_delta(self, delta: np.ndarray) -> dict[str, np.ndarray]:
        return top_k(delta, num_kept(len(delta), self.fraction))

    def decode_update(self, message: dict[str, np.ndarray], ctx: RunContext) -> np.ndarray:
        return densify(message, vector_size(cached_model(ctx)))
