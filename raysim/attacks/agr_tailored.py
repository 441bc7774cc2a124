"""AGR-tailored model poisoning (Shejwalkar & Houmansadr, "Manipulating the Byzantine:
Optimizing Model Poisoning Attacks and Defenses for Federated Learning", NDSS 2021), the attack
the FRL paper runs against its Trimmed-mean and Multi-Krum baselines.

The colluding malicious clients take their own benign updates, their mean mu and the
perturbation direction p = coordinate-wise standard deviation (ddof 1, torch.std as in the
authors' code), and all send the same update mu - gamma * p, with gamma found by the paper's
halving search:

    gamma = gamma_init; step = gamma_init; gamma_ok = 0
    while |gamma_ok - gamma| > tolerance:
        if success(gamma): gamma_ok = gamma; gamma += step / 2
        else:              gamma -= step / 2
        step /= 2
    send mu - gamma_ok * p                       (gamma_ok in [0, 2 * gamma_init))

success(gamma) simulates the server's aggregation rule (AGR) on the attacker's benign updates
plus one copy of the malicious update per malicious client of the round (copies first, as the
malicious clients have the lowest ids):
- Trimmed-mean: the deviation ||TrMean(copies + benign) - mu|| grew compared with the previous
  gamma tried (the first try succeeds), as in the authors' code; the search climbs towards a
  gamma of maximal deviation.
- Multi-Krum: every copy is among the updates Multi-Krum selects.
The simulated AGR uses the server's parameters (beta, or f and m; beta and f default to the
number of malicious clients, as the server's do). The attacker's benign set is, by
`attack.benign_set`, its sampled clients' honest updates plus those of `attack.pool_size` more
malicious clients it trains each round (`sampled_and_pool`, the default), or the honest updates
of a pool of `attack.pool_size` malicious clients drawn each round alone (`pool`: the FRL
reference code, `FL_train.py`, with 25); where the set is still too small for a
parameter, it takes the largest the set admits (2 * beta < n; f <= n - 3). With a single
benign update the direction is 0 and the attacker sends that update unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from raysim.core.robust import (
    MultiKrum,
    TrimmedMean,
    krum_select,
    krum_select_iterative,
    pairwise_squared_distances,
    trimmed_mean,
)
from raysim.errors import ConfigError


def halving_search(
    success: Callable[[float], bool], gamma_init: float = 5.0, tolerance: float = 1e-5
) -> float:
    """The last successful gamma of the paper's halving search (0.0 if none succeeded)."""
    gamma, step, gamma_ok = gamma_init, gamma_init, 0.0
    while abs(gamma_ok - gamma) > tolerance:
        if success(gamma):
            gamma_ok = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return gamma_ok


def mean_and_direction(benign: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(mu, p): mean and coordinate-wise std (ddof 1; zeros for a single update), float64."""
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in benign])
    if len(stacked) < 2:
        return stacked[0], np.zeros_like(stacked[0])
    return stacked.mean(axis=0), stacked.std(axis=0, ddof=1)


def attack_trimmed_mean(
    benign: Sequence[np.ndarray],
    num_copies: int,
    beta: int,
    gamma_init: float = 5.0,
    tolerance: float = 1e-5,
) -> tuple[np.ndarray, float]:
    """(malicious update, gamma) against a trimmed mean of `beta` per side."""
    mu, direction = mean_and_direction(benign)
    beta = min(beta, (num_copies + len(benign) - 1) // 2)
    previous = -1.0

    def deviation_grows(gamma: float) -> bool:
        nonlocal previous
        malicious = mu - gamma * direction
        aggregate = trimmed_mean([malicious] * num_copies + list(benign), beta)
        deviation = float(np.linalg.norm(aggregate.astype(np.float64) - mu))
        grew = deviation > previous
        previous = deviation
        return grew

    gamma = halving_search(deviation_grows, gamma_init, tolerance)
    return (mu - gamma * direction).astype(np.float32), gamma


def attack_multi_krum(
    benign: Sequence[np.ndarray],
    num_copies: int,
    f: int,
    num_selected: int | None = None,
    gamma_init: float = 5.0,
    tolerance: float = 1e-5,
    variant: str = "reference",
) -> tuple[np.ndarray, float]:
    """(malicious update, gamma) against Multi-Krum with f Byzantine: the largest gamma at
    which the server's selection (`variant`, as raysim.core.robust.MultiKrum; "scores_once"
    selects m = num_selected or n - f) still takes every copy."""
    mu, direction = mean_and_direction(benign)
    stacked = np.stack([np.asarray(v, dtype=np.float64) for v in benign])
    n = num_copies + len(stacked)
    if n < 3:  # Krum needs n >= f + 3: nothing to simulate
        return mu.astype(np.float32), 0.0
    if variant == "reference":
        f = min(f, (n - 3) // 2)  # the reference selection needs n >= 2f + 3

        def select(distances: np.ndarray) -> np.ndarray:
            return krum_select_iterative(distances, f)
    else:
        f = min(f, n - 3)
        m = n - f if num_selected is None else min(num_selected, n)

        def select(distances: np.ndarray) -> np.ndarray:
            return krum_select(distances, f, m)

    # Distances among the benign updates do not depend on gamma: compute them once.
    distances = np.zeros((n, n), dtype=np.float64)
    distances[num_copies:, num_copies:] = pairwise_squared_distances(stacked)

    def all_copies_selected(gamma: float) -> bool:
        difference = stacked - (mu - gamma * direction)
        to_benign = np.einsum("ij,ij->i", difference, difference)
        distances[:num_copies, num_copies:] = to_benign
        distances[num_copies:, :num_copies] = to_benign[:, None]
        selected = select(distances)
        return int(np.count_nonzero(selected < num_copies)) == num_copies

    gamma = halving_search(all_copies_selected, gamma_init, tolerance)
    return (mu - gamma * direction).astype(np.float32), gamma


class AGRTailored:
    def __init__(self, *, gamma_init: float = 5.0, tolerance: float = 1e-5) -> None:
        if not gamma_init > 0:
            raise ConfigError(f"'attack.gamma_init' must be > 0, got {gamma_init}")
        if not tolerance > 0:
            raise ConfigError(f"'attack.tolerance' must be > 0, got {tolerance}")
        self.gamma_init = float(gamma_init)
        self.tolerance = float(tolerance)

    def craft(self, honest, info, aggregator, algorithm, ctx) -> list[np.ndarray]:
        copies = info.num_malicious  # one per malicious client of the round
        honest = honest[info.benign_start :]  # attack.benign_set (raysim.core.state.RoundInfo)
        if isinstance(aggregator, TrimmedMean):
            malicious, _ = attack_trimmed_mean(
                honest, copies, aggregator.resolve_beta(info), self.gamma_init, self.tolerance
            )
        elif isinstance(aggregator, MultiKrum):
            f = aggregator.num_byzantine
            malicious, _ = attack_multi_krum(
                honest,
                copies,
                info.num_malicious if f is None else f,
                aggregator.num_selected,
                self.gamma_init,
                self.tolerance,
                variant=aggregator.variant,
            )
        else:
            raise ConfigError(
                f"attack 'agr_tailored' is tailored to aggregator 'trimmed_mean' or "
                f"'multi_krum', not {type(aggregator).__name__} "
                f"(aggregator: {ctx.config.aggregator.name})"
            )
        return [malicious.copy() for _ in range(copies)]
