"""Poisoning attacks: exact crafted updates on hand examples, the AGR-tailored search against a
known boundary, and end-to-end runs on digits where robust aggregation resists naive scaling that
breaks FedAvg. No Ray."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from raysim import config, registry
from raysim.attacks.agr_tailored import (
    AGRTailored,
    attack_multi_krum,
    attack_trimmed_mean,
    halving_search,
    mean_and_direction,
)
from raysim.attacks.frl_reversal import FRLReversal, reversed_positions
from raysim.attacks.naive_scaling import NaiveScaling
from raysim.attacks.sign_flip import SignFlip
from raysim.core.algorithm import RunContext
from raysim.core.robust import Median, MultiKrum, TrimmedMean, multi_krum, trimmed_mean
from raysim.core.state import RoundInfo
from raysim.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIGS = REPO_ROOT / "configs"


def _info(num_clients: int, num_malicious: int) -> RoundInfo:
    """A round whose first `num_malicious` clients are malicious (ids below 100)."""
    ids = np.concatenate([np.arange(num_malicious), 100 + np.arange(num_clients - num_malicious)])
    return RoundInfo(round_index=0, client_ids=ids, malicious_below=100)


# Measured on MLP 64-128-10 (the configs now use 64-512-512-10 for the FRL study): pin it.
SMALL_MODEL = ["model.hidden=[128]", "clients.lr=0.05"]


@pytest.fixture(scope="module")
def ctx() -> RunContext:
    cfg = config.load(
        CONFIGS / "fedavg_trimmed_mean_digits.yaml", ["runtime.backend=local", *SMALL_MODEL]
    )
    return RunContext(config=cfg, input_shape=(64,), num_classes=10)


def test_attacks_are_registered():
    assert {"frl_reversal", "agr_tailored", "sign_flip", "naive_scaling"} <= set(
        registry.attacks.names()
    )
    assert registry.attacks.option_names("agr_tailored") == ["gamma_init", "tolerance"]
    assert registry.attacks.option_names("naive_scaling") == ["scale", "of"]
    assert registry.attacks.option_names("sign_flip") == []
    cfg = config.load(
        CONFIGS / "fedavg_trimmed_mean_digits.yaml",
        ["attack.name=agr_tailored", "attack.fraction=0.2", "attack.tolerance=1e-4"],
    )
    assert cfg.attack.options == {"tolerance": 1e-4}


# --- sign flip and naive scaling -----------------------------------------------------------------


def test_sign_flip_negates_the_signs_exactly(ctx):
    honest = [np.array([1, -1, 1, 1], np.int8), np.array([-1, -1, 1, -1], np.int8)]
    crafted = SignFlip().craft(honest, _info(5, 2), None, None, ctx)
    assert [c.dtype for c in crafted] == [np.int8, np.int8]
    np.testing.assert_array_equal(crafted[0], [-1, 1, -1, -1])
    np.testing.assert_array_equal(crafted[1], [1, 1, -1, 1])


def test_naive_scaling_multiplies_the_delta(ctx):
    honest = [np.array([0.5, -2.0, 0.0], np.float32)]
    np.testing.assert_array_equal(
        NaiveScaling().craft(honest, _info(5, 1), None, None, ctx)[0], [-5.0, 20.0, 0.0]
    )
    np.testing.assert_array_equal(
        NaiveScaling(scale=3.0).craft(honest, _info(5, 1), None, None, ctx)[0], [1.5, -6.0, 0.0]
    )


# --- FRL rank reversal ---------------------------------------------------------------------------

# Three malicious clients, two layers of three edges each (6 edges). Each client's decoded
# update is the position of every edge in its ranking, layer by layer.
FRL_HONEST = [
    np.array([0, 1, 2, 0, 2, 1], np.int64),
    np.array([1, 2, 0, 1, 2, 0], np.int64),
    np.array([2, 0, 1, 0, 1, 2], np.int64),
]


class _FakeFRL:
    def layer_sizes(self, ctx) -> list[int]:
        return [3, 3]


def test_frl_reversal_hand_computed(ctx):
    # layer 1: position sums [3, 3, 3], all tied. Stable descending argsort keeps the id order,
    #   R_mal = [0, 1, 2], positions [0, 1, 2] (a naive argsort(sum)[::-1] would give [2, 1, 0]).
    # layer 2: sums [1, 5, 3] -> R_mal = argsort(sum, descending) = [1, 2, 0]: edge 1 (the
    #   malicious clients' most important) moves to position 0, edge 2 to 1, edge 0 to 2.
    expected = [0, 1, 2, 2, 0, 1]
    np.testing.assert_array_equal(reversed_positions(FRL_HONEST, [3, 3]), expected)
    crafted = FRLReversal().craft(FRL_HONEST, _info(10, 3), None, _FakeFRL(), ctx)
    assert len(crafted) == 3  # ALL malicious clients submit the same reversed ranking
    for vector in crafted:
        assert vector.dtype == np.int64
        np.testing.assert_array_equal(vector, expected)


def test_frl_reversal_reverses_the_aggregate_ranking():
    rng = np.random.default_rng(0)
    sizes = [7, 5]
    honest = [np.concatenate([rng.permutation(n) for n in sizes]) for _ in range(4)]
    crafted = reversed_positions(honest, sizes)
    total = np.sum(honest, axis=0)
    start = 0
    for n in sizes:
        layer_total, layer_crafted = total[start : start + n], crafted[start : start + n]
        assert sorted(layer_crafted) == list(range(n))  # a permutation: a valid ranking
        # every pair of edges the malicious clients order strictly is ordered the other way
        for i in range(n):
            for j in range(n):
                if layer_total[i] > layer_total[j]:
                    assert layer_crafted[i] < layer_crafted[j]
        start += n


def test_frl_reversal_needs_an_frl_algorithm(ctx):
    with pytest.raises(ConfigError, match="frl_reversal"):
        FRLReversal().craft(FRL_HONEST, _info(10, 3), None, object(), ctx)
    with pytest.raises(ValueError, match="6 entries but the layers hold 7"):
        reversed_positions(FRL_HONEST, [3, 4])


# --- AGR-tailored: the halving search ------------------------------------------------------------


@pytest.mark.parametrize("boundary", [0.3, 2.0907702751760273, 4.99, 7.25])
def test_halving_search_finds_a_monotone_boundary(boundary):
    gamma = halving_search(lambda g: g <= boundary, 5.0, 1e-5)
    # the final bracket [last success, nearest failure] is twice the last step
    assert boundary - 2e-5 <= gamma <= boundary


def test_halving_search_limits():
    assert halving_search(lambda g: False) == 0.0  # nothing works: send the mean
    assert 10.0 - 2e-5 <= halving_search(lambda g: True) < 10.0  # capped below 2 * gamma_init


# Four benign 1-D updates: mean 0, std (ddof 1) s = sqrt(4 / 3); the copies sit at x = -gamma*s.
BENIGN_1D = [np.array([v], np.float32) for v in (-1.0, -1.0, 1.0, 1.0)]
STD_1D = math.sqrt(4 / 3)


def test_agr_tailored_multi_krum_gamma_is_at_the_boundary():
    # One copy, n = 5, f = 1: scores sum the 2 nearest others; m = 4 are selected, so the copy is
    # rejected only with the worst score. For x <= -1: copy 2(x + 1)^2, each -1: min((x+1)^2, 4),
    # each +1: 0 + 4 = 4. The copy is selected iff 2(x + 1)^2 <= 4, i.e. x >= -(1 + sqrt 2):
    boundary = (1 + math.sqrt(2)) / STD_1D  # 2.0907...
    malicious, gamma = attack_multi_krum(
        BENIGN_1D, num_copies=1, f=1, tolerance=1e-5, variant="scores_once"
    )
    assert boundary - 2e-5 <= gamma <= boundary
    np.testing.assert_allclose(malicious, [-gamma * STD_1D], rtol=1e-6)
    # selected, and it pulls Multi-Krum's output to (x - 1 - 1 + 1) / 4 ~ -0.854; sending the
    # mean (x = 0) instead gets the copy rejected and changes nothing
    aggregate, selected = multi_krum([malicious, *BENIGN_1D], f=1, variant="scores_once")
    assert 0 in selected
    np.testing.assert_allclose(aggregate, [(-(1 + math.sqrt(2)) - 1) / 4], atol=1e-4)
    naive, selected = multi_krum([np.zeros(1, np.float32), *BENIGN_1D], f=1, variant="scores_once")
    assert 0 not in selected and naive[0] == 0.0


def test_agr_tailored_trimmed_mean_reaches_the_maximal_deviation():
    # One copy, beta = 1. For x >= -1 the trimmed mean is x / 3; below -1 the copy is trimmed and
    # it stays at -1/3 (maximal deviation 1/3, reached from gamma = 1 / s = 0.866 on).
    # The first try (gamma = 5) succeeds; larger gammas do not grow the deviation: gamma = 5.
    malicious, gamma = attack_trimmed_mean(BENIGN_1D, num_copies=1, beta=1)
    assert gamma == 5.0 and gamma >= 1 / STD_1D
    assert trimmed_mean([malicious, *BENIGN_1D], 1)[0] == pytest.approx(-1 / 3)
    assert trimmed_mean([np.zeros(1, np.float32), *BENIGN_1D], 1)[0] == 0.0  # the naive mean


def _benign(rng, count: int, size: int) -> list[np.ndarray]:
    return [(0.5 + rng.standard_normal(size)).astype(np.float32) for _ in range(count)]


# Below, the attacker's benign updates are the server's benign set (the paper's full-knowledge
# setting), so the simulated AGR is the real one: 4 copies + 16 benign updates, beta = f = 4.
# The naive alternative sends 4 copies of the benign mean.


def test_agr_tailored_defeats_trimmed_mean_more_than_the_mean():
    benign = _benign(np.random.default_rng(1), 16, 200)
    mu = np.mean(benign, axis=0)
    malicious, gamma = attack_trimmed_mean(benign, num_copies=4, beta=4)
    assert gamma == 5.0  # already past the boundary: larger gammas do not grow the deviation
    attacked = np.linalg.norm(trimmed_mean([malicious] * 4 + benign, 4) - mu)
    naive = np.linalg.norm(trimmed_mean([mu.astype(np.float32)] * 4 + benign, 4) - mu)
    assert attacked > 3 * naive  # measured 5.71 vs 0.91


@pytest.mark.parametrize("variant", ["reference", "scores_once"])
def test_agr_tailored_defeats_multi_krum_more_than_the_mean(variant):
    benign = _benign(np.random.default_rng(2), 16, 200)
    mu = np.mean(benign, axis=0)
    malicious, gamma = attack_multi_krum(benign, num_copies=4, f=4, variant=variant)
    assert gamma > 0.5  # scores_once measured 1.342
    aggregate, selected = multi_krum([malicious] * 4 + benign, f=4, variant=variant)
    assert set(range(4)) <= set(selected.tolist())  # every copy gets through
    # just past gamma, the copies are no longer all selected
    beyond = (mu - (gamma + 1e-3) * mean_and_direction(benign)[1]).astype(np.float32)
    beyond_selected = multi_krum([beyond] * 4 + benign, f=4, variant=variant)[1]
    assert not set(range(4)) <= set(beyond_selected.tolist())
    attacked = np.linalg.norm(aggregate - mu)
    naive = multi_krum([mu.astype(np.float32)] * 4 + benign, f=4, variant=variant)[0]
    # measured: scores_once 5.12 vs 1.51 (3.4x); reference 6.30 vs 2.62 (2.4x: it averages 10
    # of the 20 updates, so even the naive copies move it further)
    factor = {"scores_once": 2.5, "reference": 2.0}[variant]
    assert attacked > factor * np.linalg.norm(naive - mu)


def test_agr_tailored_craft_follows_the_aggregator(ctx):
    info = _info(5, 1)  # one malicious client: one copy
    attack = registry.attacks.build("agr_tailored")
    (krum,) = attack.craft(BENIGN_1D, info, MultiKrum(variant="scores_once"), None, ctx)
    _, gamma = attack_multi_krum(BENIGN_1D, num_copies=1, f=1, variant="scores_once")
    np.testing.assert_array_equal(krum, np.float32([-gamma * STD_1D]))
    (trimmed,) = attack.craft(BENIGN_1D, info, TrimmedMean(), None, ctx)
    np.testing.assert_allclose(trimmed, [-5.0 * STD_1D], rtol=1e-6)
    with pytest.raises(ConfigError, match="trimmed_mean' or 'multi_krum'"):
        attack.craft(BENIGN_1D, info, Median(), None, ctx)
    with pytest.raises(ConfigError, match="attack.tolerance"):
        AGRTailored(tolerance=0)


def test_agr_tailored_with_a_single_benign_update_sends_it_unchanged():
    only = [np.array([0.5, -1.0], np.float32)]
    malicious, _ = attack_trimmed_mean(only, num_copies=1, beta=1)
    np.testing.assert_array_equal(malicious, only[0])
    malicious, gamma = attack_multi_krum(only, num_copies=1, f=1)
    np.testing.assert_array_equal(malicious, only[0])
    assert gamma == 0.0


# --- end to end on digits: naive scaling breaks FedAvg, not the robust aggregators ---------------

ROUNDS = 20


def _accuracy(tmp_path_factory, *overrides: str) -> float:
    from raysim.assembly import run

    cfg = config.load(
        CONFIGS / "fedavg_trimmed_mean_digits.yaml",
        ["runtime.backend=local", f"run.rounds={ROUNDS}", *SMALL_MODEL, *overrides],
    )
    result = run(cfg, tmp_path_factory.mktemp("run"), progress=False, tensorboard=False)
    return result.summary["final"]["accuracy"]


@pytest.mark.parametrize("seed", [0, 1])
def test_naive_scaling_breaks_fedavg_but_not_trimmed_mean_or_median(tmp_path_factory, seed):
    # Measured over seeds 0-4 after 20 rounds (20% malicious, scale -10):
    #   clean FedAvg 0.927-0.947; attacked FedAvg 0.100-0.156;
    #   attacked trimmed mean 0.878-0.911 (at most 0.062 below clean);
    #   attacked median 0.840-0.896 (at most 0.100 below clean)
    attack = ["attack.name=naive_scaling", "attack.fraction=0.2"]
    seeded = f"run.seed={seed}"
    clean = _accuracy(tmp_path_factory, "aggregator.name=weighted_mean", seeded)
    broken = _accuracy(tmp_path_factory, "aggregator.name=weighted_mean", seeded, *attack)
    trimmed = _accuracy(tmp_path_factory, "aggregator.name=trimmed_mean", seeded, *attack)
    median = _accuracy(tmp_path_factory, "aggregator.name=median", seeded, *attack)
    assert clean >= 0.9
    assert broken <= 0.25  # near chance (0.1)
    assert trimmed >= clean - 0.1
    assert median >= clean - 0.15
    assert min(trimmed, median) >= broken + 0.5


def test_sign_flip_minority_does_not_stop_signsgd(tmp_path_factory):
    from raysim.assembly import run

    cfg = config.load(
        CONFIGS / "signsgd_digits.yaml",
        [
            "runtime.backend=local",
            "run.rounds=15",
            "attack.name=sign_flip",
            "attack.fraction=0.2",
            *SMALL_MODEL,
            "algorithm.server_lr=0.01",
        ],
    )
    result = run(cfg, tmp_path_factory.mktemp("signflip"), progress=False, tensorboard=False)
    # measured over seeds 0-4 after 15 rounds: 0.844-0.920 (clean: 0.911-0.938)
    assert result.summary["final"]["accuracy"] >= 0.8


def test_attacker_pool_informs_the_attack_but_is_never_aggregated_or_counted():
    """Pool clients are trained for the attacker only: counts and bytes match a pool-free run,
    and frl-free attacks that use only their own update (naive scaling) are unaffected."""
    from raysim import config
    from raysim.assembly import run

    def go(pool: int, tmp: str):
        cfg = config.load(
            "configs/fedavg_digits.yaml",
            [
                "runtime.backend=local",
                "run.rounds=4",
                "attack.name=naive_scaling",
                "attack.fraction=0.3",
                f"attack.pool_size={pool}",
            ],
        )
        return run(cfg, tmp, progress=False, tensorboard=False)

    import tempfile

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        without, with_pool = go(0, a), go(25, b)
    for key in ("clients_done", "bytes_up", "bytes_down"):
        assert (
            with_pool.summary[key]
            == without.summary[key]
            == (4 * 10 * 9610 * 4 if key != "clients_done" else 40)
        )
    assert with_pool.state.arrays["params"].tobytes() == without.state.arrays["params"].tobytes()


# --- attack.benign_set: whose honest updates a pool-informed attack averages -------------------


def _collusion_round(benign_set: str):
    """A round of a 40-client run, 30% malicious (ids < 12), pool of 5: the round's info and
    the Collusion holding every sampled malicious client's and pool client's honest update
    (the update of client c is the constant vector c)."""
    from raysim.core.round_fold import Collusion
    from raysim.core.schedule.sampling import round_info
    from raysim.core.state import Contribution

    cfg = config.load(
        CONFIGS / "fedavg_digits.yaml",
        [
            "partition.num_clients=40",
            "clients.per_round=10",
            "attack.name=agr_tailored",
            "aggregator.name=trimmed_mean",
            "attack.fraction=0.3",
            "attack.pool_size=5",
            f"attack.benign_set={benign_set}",
        ],
    )
    for round_index in range(50):  # a round whose sampled malicious clients meet the pool
        info = round_info(cfg, 40, 10, round_index)
        sampled_bad = info.client_ids[: info.num_malicious]
        draw = np.union1d(info.attacker_pool, np.intersect1d(sampled_bad, np.arange(12)))
        if benign_set == "pool":
            draw = info.attacker_benign
        if len(np.intersect1d(sampled_bad, draw)) and len(np.setdiff1d(sampled_bad, draw)):
            break
    collusion = Collusion(info)
    for client in sampled_bad.tolist():
        collusion.malicious.append(Contribution(client, np.full(3, float(client)), 10, {}))
    for client in info.attacker_pool.tolist():
        collusion.learn(client, np.full(3, float(client)))
    return info, collusion, sampled_bad


def test_the_default_benign_set_is_the_sampled_malicious_clients_and_the_pool():
    info, collusion, sampled_bad = _collusion_round("sampled_and_pool")
    assert info.attacker_benign is None
    honest, start = collusion.honest_updates()
    assert start == 0
    assert [v[0] for v in honest] == [*sampled_bad.tolist(), *info.attacker_pool.tolist()]


def test_the_pool_benign_set_is_the_pools_whole_draw_sampled_members_included():
    """The FRL reference code's set: the pool's draw (min(pool_size, #malicious) of the
    malicious ids, sampled this round or not) and nothing else; the attack reads it after the
    own updates, which the attacks that change their own update still find first."""
    from raysim.seeds import attacker_pool_draw

    info, collusion, sampled_bad = _collusion_round("pool")
    draw = attacker_pool_draw(0, info.round_index, 12, 5)
    assert np.array_equal(info.attacker_benign, draw) and len(draw) == 5
    # the pool trains only its members the round did not sample (those train anyway)
    assert np.array_equal(info.attacker_pool, np.setdiff1d(draw, info.client_ids))
    honest, start = collusion.honest_updates()
    assert start == len(sampled_bad)
    assert [v[0] for v in honest[:start]] == sampled_bad.tolist()
    assert [v[0] for v in honest[start:]] == draw.tolist()  # sorted, each member once
    outside = np.setdiff1d(sampled_bad, draw)
    assert len(outside) and not set(outside.tolist()) & {v[0] for v in honest[start:]}


def test_attacks_average_only_the_benign_set_they_are_given(ctx):
    """frl_reversal and agr_tailored read honest[info.benign_start:]: the same crafted update
    as from that slice alone."""
    import dataclasses

    info = _info(10, 2)
    own = [np.array([9.0, -9.0, 9.0]), np.array([7.0, 7.0, -7.0])]
    pool = [np.array([1.0, 2.0, 3.0]), np.array([1.5, 1.0, 2.0]), np.array([0.5, 3.0, 1.0])]
    given = dataclasses.replace(info, benign_start=2)
    attack = AGRTailored()
    trimmed = TrimmedMean(beta=None)
    expected = attack.craft(pool, info, trimmed, None, ctx)
    assert np.array_equal(attack.craft(own + pool, given, trimmed, None, ctx)[0], expected[0])
    assert not np.array_equal(attack.craft(own + pool, info, trimmed, None, ctx)[0], expected[0])

    class Layers:
        @staticmethod
        def layer_sizes(ctx):
            return [3]

    positions = [np.array([0, 1, 2]), np.array([2, 1, 0])]
    pool_positions = [np.array([1, 0, 2]), np.array([1, 2, 0]), np.array([0, 1, 2])]
    reversal = FRLReversal().craft(positions + pool_positions, given, None, Layers, ctx)
    assert np.array_equal(reversal[0], reversed_positions(pool_positions, [3]))
    assert len(reversal) == info.num_malicious


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (("attack.benign_set=everyone",), "attack.benign_set", "'sampled_and_pool' or 'pool'"),
        (("attack.benign_set=pool", "attack.pool_size=0"), "attack.pool_size", "> 0 with"),
    ],
)
def test_a_bad_benign_set_is_one_line_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as caught:
        config.load(
            CONFIGS / "fedavg_trimmed_mean_digits.yaml",
            ["attack.name=agr_tailored", "attack.fraction=0.2", *overrides],
        )
    message = str(caught.value)
    assert "\n" not in message and key in message and says in message


def test_the_reference_configs_use_the_reference_codes_rules():
    """configs/reference: FRL masks by |score| with torch's default weights; every attack that
    averages benign updates reads the 25-client pool alone (the FRL reference code)."""
    frl = config.load(CONFIGS / "reference" / "frl_fmnist.yaml")
    assert frl.algorithm.options["mask_by_abs"] is True
    assert frl.algorithm.options["weight_init"] == "torch_default"
    for name in ("frl", "trimmed_mean", "multi_krum"):
        cfg = config.load(CONFIGS / "reference" / f"{name}_fmnist.yaml")
        assert (cfg.attack.benign_set, cfg.attack.pool_size) == ("pool", 25), name
