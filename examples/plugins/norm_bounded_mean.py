"""An aggregator plug-in: the mean of the client updates, each scaled to an L2 norm of at most
`bound` first (norm bounding, Sun et al., "Can You Really Backdoor Federated Learning?", 2019).

An aggregator receives the round's contributions in client-id order: each has `client_id`,
`update` (the decoded vector), `num_samples` and `stats` (what the client declared). This one
needs every update of the round (`linear = False`); a linear aggregator would instead define
`linear = True`, `normalize` and `weight(contribution)`, and be folded in as updates arrive.
Named in a config as `norm_bounded_mean:NormBoundedMean`.
"""

from __future__ import annotations

import numpy as np

import raysim
from raysim import ConfigError


@raysim.plugin("aggregator")
class NormBoundedMean:
    linear = False

    def __init__(self, *, bound: float = 1.0) -> None:
        if not bound > 0:
            raise ConfigError(f"'aggregator.bound' must be > 0, got {bound}")
        self.bound = float(bound)

    def aggregate(self, contributions, info=None) -> np.ndarray:
        total = np.zeros(len(contributions[0].update), dtype=np.float64)
        for contribution in contributions:  # client-id order: the sum is deterministic
            update = contribution.update.astype(np.float64)
            norm = float(np.linalg.norm(update))
            total += update * min(1.0, self.bound / norm) if norm > 0 else update
        return (total / len(contributions)).astype(np.float32)
