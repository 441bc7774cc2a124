"""The rank reversal attack on FRL (Mozaffari, Shejwalkar, Houmansadr, USENIX Security 2023,
Algorithm 3, as in the official code SPIN-UMass/FRL).

The malicious clients train honestly on their own data; per layer, they add up their edges'
positions V_u (position of every edge in their ranking), which ranks the edges as their votes
would (the server's R_g = argsort(sum) puts the most important edges last, at the top of the
mask); they reverse it, R_mal = argsort(sum, descending) (stable: ties keep the lower edge id
first), so the edges they found most important get the lowest positions, and ALL of them
submit R_mal, i.e. its positions argsort(R_mal).
The decoded FRL update is the int64 position vector of every layer concatenated in the order
of `algorithm.layer_sizes(ctx)`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raysim.errors import ConfigError


def reversed_positions(positions: Sequence[np.ndarray], layer_sizes: Sequence[int]) -> np.ndarray:
    """Positions of the reversed aggregate ranking of `positions`, layer by layer."""
    total = np.sum(np.stack(positions).astype(np.int64), axis=0)
    if total.shape != (sum(layer_sizes),):
        raise ValueError(
            f"position vectors have {total.size} entries but the layers hold {sum(layer_sizes)}"
        )
    result = np.empty_like(total)
    start = 0
    for size in layer_sizes:
        layer = total[start : start + size]
        ranking = np.argsort(-layer, kind="stable")  # most-voted edge first: the reversal
        result[start + ranking] = np.arange(size)  # positions = argsort(ranking)
        start += size
    return result


class FRLReversal:
    def craft(self, honest, info, aggregator, algorithm, ctx) -> list[np.ndarray]:
        layer_sizes = getattr(algorithm, "layer_sizes", None)
        if layer_sizes is None:
            raise ConfigError(
                f"attack 'frl_reversal' reverses FRL rankings; algorithm "
                f"'{ctx.config.algorithm.name}' has no per-layer rankings (use algorithm: frl)"
            )
        benign = honest[info.benign_start :]  # attack.benign_set (raysim.core.state.RoundInfo)
        crafted = reversed_positions(benign, layer_sizes(ctx)).astype(honest[0].dtype)
        return [crafted.copy() for _ in range(info.num_malicious)]
