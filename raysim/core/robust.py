"""Byzantine-robust aggregators: non-linear rules that need every update of the round.

- Trimmed mean, coordinate-wise (Yin, Chen, Ramchandran, Bartlett, "Byzantine-Robust Distributed
  Learning: Towards Optimal Statistical Rates", ICML 2018): per coordinate, drop the `beta`
  largest and `beta` smallest values and average the rest.
- Median, coordinate-wise (same paper).
- Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries:
  Byzantine Tolerant Gradient Descent", NeurIPS 2017; El Mhamdi, Guerraoui, Rouault, "The Hidden
  Vulnerability of Distributed Learning in Byzantium", ICML 2018): score each update by the sum
  of its squared distances to its n - f - 2 nearest other updates, select the m best-scored
  updates (lowest score first, ties to the lower index) and average them.

As in the FRL paper's evaluation, the server is granted the round's number of malicious
clients: `beta` and `f` default to `RoundInfo.num_malicious`. These rules are unweighted: a
client's sample count would be the attacker's to claim, so it does not buy influence.
The pure functions (`trimmed_mean`, `coordinate_median`, `multi_krum`) are what attacks simulate
(raysim.attacks.agr_tailored) and what the tests check by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raysim.core.state import Contribution, RoundInfo
from raysim.errors import ConfigError


def _stack(vectors: Sequence[np.ndarray]) -> np.ndarray:
    if len(vectors) == 0:
        raise ValueError("no client update to aggregate this round")
    return np.stack([np.asarray(v, dtype=np.float64) for v in vectors])


def trimmed_mean(vectors: Sequence[np.ndarray], beta: int) -> np.ndarray:
    """Per coordinate: sort the n values, drop `beta` from each end, average the n - 2*beta left."""
    stacked = _stack(vectors)
    n = len(stacked)
    if beta < 0 or 2 * beta >= n:
        raise ValueError(f"trimmed mean needs 0 <= 2*beta < n updates; got beta={beta}, n={n}")
    ordered = np.sort(stacked, axis=0)
    return ordered[beta : n - beta].mean(axis=0).astype(np.float32)


def coordinate_median(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """Per coordinate median (the mean of the two middle values when n is even)."""
    return np.median(_stack(vectors), axis=0).astype(np.float32)


def pairwise_squared_distances(stacked: np.ndarray) -> np.ndarray:
    """||v_i - v_j||^2 for all pairs, in float64 (computed from differences: no cancellation)."""
    n = len(stacked)
    distances = np.zeros((n, n), dtype=np.float64)
    for i in range(n):
        difference = stacked[i + 1 :] - stacked[i]
        distances[i, i + 1 :] = np.einsum("ij,ij->i", difference, difference)
    return distances + distances.T


def krum_select(distances: np.ndarray, f: int, m: int) -> np.ndarray:
    """Multi-Krum's selection from the n x n squared distances: indices in selection order.

    score_i = sum of the squared distances from update i to its n - f - 2 nearest others; take
    the best score, remove that update, repeat m times (the scores are those of the whole
    round, as in Blanchard et al.'s Multi-Krum); ties go to the lower index.
    """
    n = len(distances)
    neighbours = n - f - 2
    if f < 0 or neighbours < 1:
        raise ValueError(
            f"Krum needs n - f - 2 >= 1 neighbours (n >= f + 3); got f={f}, n={n} updates"
        )
    if not 1 <= m <= n:
        raise ValueError(f"Multi-Krum selects 1 <= m <= n updates; got m={m}, n={n}")
    others = distances + np.diag(np.full(n, np.inf))  # an update is not its own neighbour
    scores = np.sort(others, axis=1)[:, :neighbours].sum(axis=1)
    return np.argsort(scores, kind="stable")[:m]


def krum_select_iterative(distances: np.ndarray, f: int) -> np.ndarray:
    """Multi-Krum's selection as the FRL paper's reference code (after Shejwalkar & Houmansadr,
    NDSS 2021) computes it: indices in selection order.

    While more than 2f + 2 updates remain: score each remaining update by the sum of the
    r - 2 - f smallest entries of its row of squared distances among the r remaining ones
    (its own zero distance included, as there), select the best (ties: the lower index) and
    remove it. So n - 2f - 2 updates are selected (n = 10, f = 2: 4), with scores recomputed
    among the remaining updates after every pick.
    """
    n = len(distances)
    if f < 0 or n <= 2 * f + 2:
        raise ValueError(
            f"the reference Multi-Krum selects while more than 2f + 2 updates remain; got "
            f"f={f}, n={n} updates (n >= 2f + 3 needed)"
        )
    remaining = list(range(n))
    selected = []
    while len(remaining) > 2 * f + 2:
        among = distances[np.ix_(remaining, remaining)]
        scores = np.sort(among, axis=1)[:, : len(remaining) - 2 - f].sum(axis=1)
        best = int(np.argsort(scores, kind="stable")[0])
        selected.append(remaining.pop(best))
    return np.asarray(selected, dtype=np.int64)


# Multi-Krum variants: "reference" as the FRL reference code (krum_select_iterative), the
# default; "scores_once" as Blanchard et al.'s description (krum_select: the m best scores of
# the whole round, m = n - f by default), raysim's behaviour before the reference became the
# default.
KRUM_VARIANTS = ("reference", "scores_once")


def multi_krum(
    vectors: Sequence[np.ndarray], f: int, m: int | None = None, *, variant: str = "reference"
) -> tuple[np.ndarray, np.ndarray]:
    """Multi-Krum: (mean of the selected updates, their indices in selection order).

    `variant` "reference" (see krum_select_iterative) selects n - 2f - 2 updates and takes no m;
    "scores_once" selects m (default n - f). Blanchard et al.'s guarantee needs n > 2f + 2.
    """
    stacked = _stack(vectors)
    distances = pairwise_squared_distances(stacked)
    if variant == "reference":
        if m is not None:
            raise ValueError("the reference Multi-Krum selects n - 2f - 2 updates; it takes no m")
        selected = krum_select_iterative(distances, f)
    elif variant == "scores_once":
        selected = krum_select(distances, f, len(stacked) - f if m is None else m)
    else:
        raise ValueError(f"unknown Multi-Krum variant {variant!r}; choices: {KRUM_VARIANTS}")
    return stacked[selected].mean(axis=0).astype(np.float32), selected


def _granted_malicious(info: RoundInfo | None, name: str, key: str) -> int:
    if info is None:
        raise ValueError(f"{name}: '{key}' is not set and no RoundInfo was given to default it")
    return info.num_malicious


class TrimmedMean:
    """Coordinate-wise trimmed mean; `beta` None = the round's number of malicious clients."""

    linear = False

    def __init__(self, *, beta: int | None = None) -> None:
        if beta is not None and beta < 0:
            raise ConfigError(f"'aggregator.beta' must be >= 0 (or null), got {beta}")
        self.beta = beta

    def resolve_beta(self, info: RoundInfo | None) -> int:
        if self.beta is not None:
            return self.beta
        return _granted_malicious(info, "trimmed_mean", "aggregator.beta")

    def aggregate(
        self, contributions: Sequence[Contribution], info: RoundInfo | None = None
    ) -> np.ndarray:
        vectors = [c.update for c in contributions]
        beta = self.resolve_beta(info)
        if 2 * beta >= len(vectors):
            raise ConfigError(
                f"aggregator 'trimmed_mean' trims beta={beta} updates from each end but the round "
                f"has {len(vectors)}; need 2*beta < clients per round (lower 'aggregator.beta', "
                f"or keep attack.redraw_majority on when beta defaults to the malicious count)"
            )
        return trimmed_mean(vectors, beta)


class Median:
    """Coordinate-wise median."""

    linear = False

    def aggregate(
        self, contributions: Sequence[Contribution], info: RoundInfo | None = None
    ) -> np.ndarray:
        vectors = [c.update for c in contributions]
        return coordinate_median(vectors)


class MultiKrum:
    """Multi-Krum; `num_byzantine` (f) None = the round's malicious count. `variant`:
    "reference" (the FRL reference code's iterative selection of n - 2f - 2 updates) or
    "scores_once" (the m = `num_selected` best scores of the round, None = n - f)."""

    linear = False

    def __init__(
        self,
        *,
        num_byzantine: int | None = None,
        num_selected: int | None = None,
        variant: str = "reference",
    ) -> None:
        if num_byzantine is not None and num_byzantine < 0:
            raise ConfigError(
                f"'aggregator.num_byzantine' must be >= 0 (or null), got {num_byzantine}"
            )
        if num_selected is not None and num_selected < 1:
            raise ConfigError(
                f"'aggregator.num_selected' must be >= 1 (or null), got {num_selected}"
            )
        if variant not in KRUM_VARIANTS:
            raise ConfigError(
                f"'aggregator.variant' must be one of {', '.join(KRUM_VARIANTS)}, got {variant!r}"
            )
        if variant == "reference" and num_selected is not None:
            raise ConfigError(
                "'aggregator.num_selected' applies to variant 'scores_once'; the reference "
                "Multi-Krum selects n - 2f - 2 updates"
            )
        self.num_byzantine = num_byzantine
        self.num_selected = num_selected
        self.variant = variant

    def resolve(self, info: RoundInfo | None, n: int) -> tuple[int, int]:
        """(f, m) for a round of n updates."""
        f = self.num_byzantine
        if f is None:
            f = _granted_malicious(info, "multi_krum", "aggregator.num_byzantine")
        m = n - f if self.num_selected is None else self.num_selected
        return f, m

    def aggregate(
        self, contributions: Sequence[Contribution], info: RoundInfo | None = None
    ) -> np.ndarray:
        vectors = [c.update for c in contributions]
        n = len(vectors)
        f, m = self.resolve(info, n)
        if self.variant == "reference":
            if n <= 2 * f + 2:
                raise ConfigError(
                    f"aggregator 'multi_krum' (reference variant) with f={f} needs at least "
                    f"2f + 3 = {2 * f + 3} updates a round, got {n} (raise clients.per_round, "
                    "lower 'aggregator.num_byzantine', or use variant: scores_once)"
                )
            return multi_krum(vectors, f)[0]
        if n - f - 2 < 1:
            raise ConfigError(
                f"aggregator 'multi_krum' with f={f} needs at least f + 3 = {f + 3} updates a "
                f"round, got {n} (raise clients.per_round or lower 'aggregator.num_byzantine')"
            )
        if m > n:
            raise ConfigError(f"'aggregator.num_selected'={m} exceeds the {n} updates of the round")
        return multi_krum(vectors, f, m, variant="scores_once")[0]
