"""Naive scaling against FedAvg: each malicious client sends `scale` times its honest delta.

The default scale -10 reverses the update and amplifies it tenfold, the simplest model
poisoning that plain averaging cannot absorb (Blanchard et al., NeurIPS 2017, show a single
such client can move the mean arbitrarily); robust aggregators (trimmed mean, median,
Multi-Krum) discard such outliers. A positive scale is the "boosting" of Bhagoji et al.
(ICML 2019) without a target.
"""

from __future__ import annotations

import numpy as np


class NaiveScaling:
    def __init__(self, *, scale: float = -10.0) -> None:
        self.scale = float(scale)

    def craft(self, honest, info, aggregator, algorithm, ctx) -> list[np.ndarray]:
        own = honest[: info.num_malicious]  # each client scales its own update (pool unused)
        return [(self.scale * vector.astype(np.float64)).astype(np.float32) for vector in own]
