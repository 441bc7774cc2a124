"""Naive scaling against FedAvg: each malicious client sends `scale` times its honest delta, or
`scale` times the global model it received.

The default (`of: delta`, scale -10) reverses the update and amplifies it tenfold, the simplest
model poisoning that plain averaging cannot absorb (Blanchard et al., NeurIPS 2017, show a single
such client can move the mean arbitrarily); robust aggregators (trimmed mean, median,
Multi-Krum) discard such outliers. A positive scale is the "boosting" of Bhagoji et al.
(ICML 2019) without a target.

`of: model` is the FRL reference code's naive attack on its FedAvg baseline: every malicious
update is `scale` (there 1e5) times the received global model. Such an update is ~1e5 times
the model's norm, so the server's update-size guard (`server.max_update_ratio`, 1000 by
default) refuses it; the reference has no such guard: set `server.max_update_ratio: 0` to
measure what it measures.
"""

from __future__ import annotations

import numpy as np

from raysim.errors import ConfigError

SCALED = ("delta", "model")


class NaiveScaling:
    def __init__(self, *, scale: float = -10.0, of: str = "delta") -> None:
        if of not in SCALED:
            raise ConfigError(f"'attack.of' must be one of {', '.join(SCALED)}, got {of!r}")
        self.scale = float(scale)
        self.of = of

    def craft(self, honest, info, aggregator, algorithm, ctx) -> list[np.ndarray]:
        if self.of == "model":
            if info.delta_base is None:
                raise ConfigError(
                    f"attack 'naive_scaling' with of: model needs updates that are model deltas; "
                    f"algorithm '{ctx.config.algorithm.name}' sends another kind"
                )
            crafted = (self.scale * info.delta_base.astype(np.float64)).astype(np.float32)
            return [crafted.copy() for _ in range(info.num_malicious)]
        own = honest[: info.num_malicious]  # each client scales its own update (pool unused)
        return [(self.scale * vector.astype(np.float64)).astype(np.float32) for vector in own]
