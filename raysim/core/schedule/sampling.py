"""Which clients a round trains without simulated time: the seed's sample of K clients (and
the attacker's pool)."""

from __future__ import annotations

from typing import Any

import numpy as np

from raysim.core.state import RoundInfo
from raysim.seeds import attacker_pool_draw, sample_clients


def malicious_below(config: Any, num_clients: int) -> int:
    """Malicious clients are the lowest ids: this many (none unless an attack is configured)."""
    if config.attack.name == "none":
        return 0
    return int(config.attack.fraction * num_clients)


def round_info(config: Any, num_clients: int, per_round: int, round_index: int) -> RoundInfo:
    """Round `round_index`'s `per_round` clients (a function of the seed and the round alone)
    and, when a round holds malicious clients, the colluding attacker's pool."""
    below = malicious_below(config, num_clients)
    client_ids = sample_clients(
        config.run.seed,
        round_index,
        num_clients,
        per_round,
        below,
        config.attack.redraw_majority,
    )
    return info_of(config, num_clients, round_index, client_ids)


def info_of(config: Any, num_clients: int, round_index: int, client_ids: np.ndarray) -> RoundInfo:
    """The RoundInfo of a round training `client_ids` (every schedule's): the malicious ids
    below `malicious_below` and, when the round holds one, the colluding attacker's pool."""
    below = malicious_below(config, num_clients)
    pool, benign = np.zeros(0, dtype=np.int64), None
    if below and np.searchsorted(client_ids, below):
        draw = attacker_pool_draw(config.run.seed, round_index, below, config.attack.pool_size)
        pool = np.setdiff1d(draw, client_ids)  # the sampled members train anyway
        if config.attack.benign_set == "pool":
            benign = draw
    return RoundInfo(round_index, client_ids, below, pool, benign)
