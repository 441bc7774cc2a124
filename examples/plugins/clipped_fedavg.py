"""An algorithm plug-in: FedAvg with client-side update clipping.

Each client scales its delta down to an L2 norm of at most `max_norm` before sending it: the
clipping step of DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018), without the noise. Everything else is FedAvg: the subclass only changes
the messages of FedAvg's client description (`client_messages`, raysim.core.client_step),
which both drivers run, so its clients train one at a time or batched (`clients.batched`,
docs/BATCHED.md) and clip alike. Named in a config as `clipped_fedavg:ClippedFedAvg`.
"""

from __future__ import annotations

import numpy as np

import raysim
from raysim import ConfigError
from raysim.algorithms.fedavg import FedAvg


@raysim.plugin("algorithm")
class ClippedFedAvg(FedAvg):
    def __init__(self, *, max_norm: float = 1.0) -> None:
        super().__init__()
        if not max_norm > 0:
            raise ConfigError(f"'algorithm.max_norm' must be > 0, got {max_norm}")
        self.max_norm = float(max_norm)

    def client_messages(self, payload, trained, ctx):
        return [self._clipped(u) for u in super().client_messages(payload, trained, ctx)]

    def _clipped(self, update):
        delta = update.vector  # the float32 delta; the run's codec encodes it after this
        norm = float(np.linalg.norm(delta.astype(np.float64)))
        if norm > self.max_norm:
            update.vector = (delta * np.float32(self.max_norm / norm)).astype(np.float32)
        update.metrics["clipped"] = float(norm > self.max_norm)
        return update
