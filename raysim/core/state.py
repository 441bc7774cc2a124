"""Plain data that moves between the round loop, the server and the clients."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ServerState:
    """Everything the server needs to continue a run: named arrays (checkpointed as .npz).

    Algorithms choose the names (FedAvg: 'params' plus server-optimizer slots such as
    'optimizer.momentum'); keeping the state as flat named arrays makes checkpoints safe to load
    (no pickle) and lets tests compare runs exactly.
    """

    round: int
    arrays: dict[str, np.ndarray]

    def copy(self) -> ServerState:
        return ServerState(self.round, {k: v.copy() for k, v in self.arrays.items()})


@dataclass
class ClientUpdate:
    """What one client sends back after local training.

    `vector` is a dense float32 update (FedAvg: new local parameters minus the global ones);
    `weight_basis` the number of samples it was trained on; `bytes_up` its encoded size.
    """

    client_id: int
    num_samples: int
    vector: np.ndarray
    bytes_up: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundStats:
    """Server-side summary of one round, merged into the round's metrics.jsonl record."""

    clients_done: int = 0
    clients_failed: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    train_loss: float = float("nan")
    update_norm_mean: float = float("nan")
    clients_s: float = 0.0  # wall time from dispatch until the last update was folded in
    client_compute_s: float = 0.0  # sum over tasks of their training time (CPU-side work)
    tasks: int = 0
    aggregate_s: float = 0.0
    evaluate_s: float = 0.0
    eval: dict[str, float] = field(default_factory=dict)
