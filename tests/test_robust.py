"""Robust aggregators (trimmed mean, median, Multi-Krum) and the compressed baselines (SignSGD,
TopK): exact values on hand-computed examples, exact byte counts. No Ray; runs in seconds."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from raysim import config, registry
from raysim.algorithms.fedavg import FedAvg
from raysim.algorithms.signsgd import SignSGD, majority_vote, pack_signs, unpack_signs
from raysim.algorithms.topk import TopK, num_kept, top_k
from raysim.core.aggregators import contributions_of
from raysim.core.algorithm import RunContext
from raysim.core.codecs import TopK as TopKCodec
from raysim.core.codecs import VectorLayout
from raysim.core.payload import encoded_nbytes
from raysim.core.robust import (
    Median,
    MultiKrum,
    TrimmedMean,
    coordinate_median,
    multi_krum,
    trimmed_mean,
)
from raysim.core.state import RoundInfo, ServerState
from raysim.core.validation import wire_format
from raysim.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
# The numbers below were measured on MLP 64-128-10 (the configs now use 64-512-512-10 so the
# FRL study compares like with like); pin the small net here.
SMALL_MODEL = ["model.hidden=[128]", "clients.lr=0.05"]
SMALL_SIGNSGD = [*SMALL_MODEL, "algorithm.server_lr=0.01"]
NUM_PARAMS = 64 * 128 + 128 + 128 * 10 + 10  # the digits MLP: 9,610 parameters


def _vectors(*rows) -> list[np.ndarray]:
    return [np.asarray(row, dtype=np.float32) for row in rows]


def _info(num_clients: int, num_malicious: int) -> RoundInfo:
    """A round of `num_clients` clients whose first `num_malicious` are malicious (ids < 100)."""
    ids = np.concatenate([np.arange(num_malicious), 100 + np.arange(num_clients - num_malicious)])
    return RoundInfo(round_index=0, client_ids=ids, malicious_below=100)


# --- trimmed mean and median ---------------------------------------------------------------------

FIVE = _vectors([1, 10], [2, -5], [3, 0], [100, 1], [-50, 2])


def test_trimmed_mean_hand_computed():
    # coordinate 0 sorted: -50 1 2 3 100 -> drop -50 and 100 -> mean(1, 2, 3) = 2
    # coordinate 1 sorted: -5 0 1 2 10   -> drop -5 and 10   -> mean(0, 1, 2) = 1
    result = trimmed_mean(FIVE, beta=1)
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result, [2.0, 1.0])
    np.testing.assert_array_equal(trimmed_mean(FIVE, beta=2), [2.0, 1.0])  # the median
    np.testing.assert_array_equal(
        trimmed_mean(FIVE, beta=0), np.float32([11.2, 1.6])
    )  # the plain mean


def test_trimmed_mean_rejects_trimming_everything():
    with pytest.raises(ValueError, match="2\\*beta < n"):
        trimmed_mean(FIVE, beta=3)
    with pytest.raises(ValueError, match="2\\*beta < n"):
        trimmed_mean(FIVE[:4], beta=2)


def test_coordinate_median_odd_and_even():
    np.testing.assert_array_equal(coordinate_median(FIVE), [2.0, 1.0])
    # four updates (v3 left out): the mean of the two middle values
    # coordinate 0 sorted: -50 1 2 3 -> (1 + 2) / 2; coordinate 1 sorted: -5 0 2 10 -> (0 + 2) / 2
    np.testing.assert_array_equal(coordinate_median(FIVE[:3] + FIVE[4:]), [1.5, 1.0])


def test_trimmed_mean_beta_defaults_to_the_rounds_malicious_count():
    aggregator = registry.aggregators.build("trimmed_mean")
    assert isinstance(aggregator, TrimmedMean) and aggregator.linear is False
    # 1 malicious of 5: beta = 1
    np.testing.assert_array_equal(
        aggregator.aggregate(contributions_of(FIVE, [1] * 5), _info(5, 1)), [2.0, 1.0]
    )
    # no malicious client: beta = 0, the plain (unweighted: weights are ignored) mean
    np.testing.assert_array_equal(
        aggregator.aggregate(contributions_of(FIVE, [9, 1, 1, 1, 1]), _info(5, 0)),
        np.float32([11.2, 1.6]),
    )
    # an explicit beta wins over the round's count
    fixed = TrimmedMean(beta=1)
    np.testing.assert_array_equal(
        fixed.aggregate(contributions_of(FIVE, [1] * 5), _info(5, 0)), [2.0, 1.0]
    )


def test_trimmed_mean_config_errors():
    with pytest.raises(ConfigError, match="aggregator.beta"):
        TrimmedMean(beta=-1)
    with pytest.raises(ConfigError, match="2\\*beta < clients per round"):
        TrimmedMean(beta=3).aggregate(contributions_of(FIVE, [1] * 5), _info(5, 0))
    with pytest.raises(ValueError, match="no RoundInfo"):
        TrimmedMean().aggregate(contributions_of(FIVE, [1] * 5), None)


def test_median_aggregator_is_registered():
    aggregator = registry.aggregators.build("median")
    assert isinstance(aggregator, Median) and aggregator.linear is False
    np.testing.assert_array_equal(
        aggregator.aggregate(contributions_of(FIVE, [1] * 5), _info(5, 2)), [2.0, 1.0]
    )


# --- Multi-Krum ----------------------------------------------------------------------------------

# Five 2-D updates, the second coordinate always 0. With f = 1 each score sums the squared
# distances to the n - f - 2 = 2 nearest others:
#   v0 = 0:   1 (v1) + 4 (v2)     = 5
#   v1 = 1:   1 (v0) + 1 (v2)     = 2
#   v2 = 2:   1 (v1) + 4 (v0)     = 5
#   v3 = 10:  64 (v2) + 81 (v1)   = 145
#   v4 = -20: 400 (v0) + 441 (v1) = 841
KRUM = _vectors([0, 0], [1, 0], [2, 0], [10, 0], [-20, 0])


def test_multi_krum_selects_by_score_hand_computed():  # the scores_once variant
    aggregate, selected = multi_krum(KRUM, f=1, m=4, variant="scores_once")  # m = n - f
    assert selected.tolist() == [1, 0, 2, 3]  # v0 and v2 tie at 5: the lower index first
    np.testing.assert_array_equal(aggregate, [3.25, 0.0])  # (1 + 0 + 2 + 10) / 4
    aggregate, selected = multi_krum(KRUM, f=1, m=3, variant="scores_once")
    assert selected.tolist() == [1, 0, 2]
    np.testing.assert_array_equal(aggregate, [1.0, 0.0])
    aggregate, selected = multi_krum(KRUM, f=1, m=1, variant="scores_once")  # Krum
    assert selected.tolist() == [1]
    np.testing.assert_array_equal(aggregate, [1.0, 0.0])
    # default m = n - f
    assert multi_krum(KRUM, f=1, variant="scores_once")[1].tolist() == [1, 0, 2, 3]


def test_multi_krum_with_more_neighbours():
    # f = 0: three nearest others. v0: 1+4+100 = 105, v1: 1+1+81 = 83, v2: 1+4+64 = 69,
    # v3: 64+81+100 = 245, v4: 400+441+484 = 1325 -> order v2, v1, v0, v3, v4
    aggregate, selected = multi_krum(KRUM, f=0, m=2, variant="scores_once")
    assert selected.tolist() == [2, 1]
    np.testing.assert_array_equal(aggregate, [1.5, 0.0])


# The reference variant (the FRL reference code's Multi-Krum) on KRUM, f = 1: while more than
# 2f + 2 = 4 updates remain, score each by its r - 2 - f = 2 smallest squared distances among the
# r remaining, its own 0 included (so: the distance to its nearest other):
#   v0: 0 + 1 = 1, v1: 0 + 1 = 1, v2: 0 + 1 = 1, v3: 0 + 64, v4: 0 + 400 -> v0 (lowest index);
# then 4 remain: stop. One update selected: n - 2f - 2 = 1.
# With f = 0 (2 remaining kept): r = 5, 3 smallest: v0: 0+1+4 = 5, v1: 0+1+1 = 2, v2: 0+1+4 = 5,
# v3: 0+64+81, v4: 0+400+441 -> v1; r = 4 among v0, v2, v3, v4: 2 smallest: v0: 0+4 = 4,
# v2: 0+4 = 4, v3: 0+64, v4: 0+400 -> v0; r = 3 among v2, v3, v4: v2: 0+64, v3: 0+64, v4: 0+484
# -> v2; 2 remain: stop. Selected v1, v0, v2: mean 1.
def test_reference_multi_krum_selects_iteratively_hand_computed():
    aggregate, selected = multi_krum(KRUM, f=1)
    assert selected.tolist() == [0]
    np.testing.assert_array_equal(aggregate, [0.0, 0.0])
    aggregate, selected = multi_krum(KRUM, f=0)
    assert selected.tolist() == [1, 0, 2]
    np.testing.assert_array_equal(aggregate, [1.0, 0.0])
    # n = 10, f = 2: 4 updates averaged (the select-once variant averages n - f = 8)
    ten = _vectors(*[[float(i), 0.0] for i in range(10)])
    assert len(multi_krum(ten, f=2)[1]) == 4
    assert len(multi_krum(ten, f=2, variant="scores_once")[1]) == 8


def test_multi_krum_defaults_to_the_reference_and_the_rounds_malicious_count():
    aggregator = registry.aggregators.build("multi_krum")
    assert isinstance(aggregator, MultiKrum) and aggregator.linear is False
    assert aggregator.variant == "reference"
    # 1 malicious of 5: f = 1 -> v0 alone (see above)
    np.testing.assert_array_equal(
        aggregator.aggregate(contributions_of(KRUM, [1] * 5), _info(5, 1)), [0.0, 0.0]
    )
    # no malicious: f = 0 -> v1, v0, v2
    np.testing.assert_allclose(
        aggregator.aggregate(contributions_of(KRUM, [1] * 5), _info(5, 0)), [1.0, 0.0]
    )
    once = MultiKrum(variant="scores_once")  # 1 malicious: m = n - f = 4 -> (1 + 0 + 2 + 10) / 4
    np.testing.assert_array_equal(
        once.aggregate(contributions_of(KRUM, [1] * 5), _info(5, 1)), [3.25, 0.0]
    )
    explicit = MultiKrum(num_byzantine=0, num_selected=2, variant="scores_once")
    np.testing.assert_array_equal(
        explicit.aggregate(contributions_of(KRUM, [1] * 5), _info(5, 1)), [1.5, 0.0]
    )


def test_multi_krum_errors():
    with pytest.raises(ValueError, match="n >= f \\+ 3"):
        multi_krum(KRUM, f=3, variant="scores_once")
    with pytest.raises(ValueError, match="n >= 2f \\+ 3 needed"):
        multi_krum(KRUM, f=2)
    with pytest.raises(ValueError, match="1 <= m <= n"):
        multi_krum(KRUM, f=1, m=6, variant="scores_once")
    with pytest.raises(ValueError, match="takes no m"):
        multi_krum(KRUM, f=1, m=3)
    with pytest.raises(ConfigError, match="at least f \\+ 3 = 6 updates"):
        MultiKrum(num_byzantine=3, variant="scores_once").aggregate(
            contributions_of(KRUM, [1] * 5), _info(5, 0)
        )
    with pytest.raises(ConfigError, match="at least 2f \\+ 3 = 7 updates"):
        MultiKrum(num_byzantine=2).aggregate(contributions_of(KRUM, [1] * 5), _info(5, 0))
    with pytest.raises(ConfigError, match="num_selected"):
        MultiKrum(num_selected=0)
    with pytest.raises(ConfigError, match="applies to variant 'scores_once'"):
        MultiKrum(num_selected=3)
    with pytest.raises(ConfigError, match="aggregator.variant"):
        MultiKrum(variant="blanchard")
    with pytest.raises(ConfigError, match="num_byzantine"):
        MultiKrum(num_byzantine=-1)


def test_robust_aggregators_in_config(tmp_path):
    cfg = config.load(
        REPO_ROOT / "configs" / "fedavg_multi_krum_digits.yaml",
        [
            "aggregator.num_byzantine=2",
            "aggregator.num_selected=5",
            "aggregator.variant=scores_once",
        ],
    )
    assert cfg.aggregator.options == {
        "num_byzantine": 2,
        "num_selected": 5,
        "variant": "scores_once",
    }
    with pytest.raises(ConfigError, match="unknown option 'aggregator.beta'"):
        config.load(REPO_ROOT / "configs" / "fedavg_multi_krum_digits.yaml", ["aggregator.beta=1"])


# --- SignSGD -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ctx() -> RunContext:
    cfg = config.load(
        REPO_ROOT / "configs" / "signsgd_digits.yaml", ["runtime.backend=local", *SMALL_SIGNSGD]
    )
    return RunContext(config=cfg, input_shape=(64,), num_classes=10)


@pytest.fixture(scope="module")
def client_data():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((24, 64)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 24))
    return x, y


def _client_update(algorithm, ctx, client_data):
    """One client's update from the initial global model, with a fixed generator, encoded as
    the client task sends it (the algorithm's codec)."""
    state = algorithm.init_server(ctx)
    payload = algorithm.server_payload(state)
    x, y = client_data
    update = algorithm.client_update(payload, x, y, 3, torch.Generator().manual_seed(7), ctx)
    codec, layout = wire_format(algorithm, ctx)
    return update.encoded(codec, layout)


def _decode(algorithm, ctx, message):
    codec, layout = wire_format(algorithm, ctx)
    return codec.decode(message, layout)


def test_sign_packing_is_one_bit_per_parameter():
    vector = np.array([0.5, -1.0, 0.0, -0.0, 2.0, -3.0, 1e-9, -1e-9, 4.0, -4.0], np.float32)
    bits = pack_signs(vector)
    assert bits.dtype == np.uint8 and bits.nbytes == 2 == math.ceil(10 / 8)
    # a zero (either sign) goes up as +1: one bit has no room for 0
    np.testing.assert_array_equal(unpack_signs(bits, 10), [1, -1, 1, 1, 1, -1, 1, -1, 1, -1])
    assert unpack_signs(bits, 10).dtype == np.int8
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_signs(bits, 17)


def test_majority_vote_hand_computed():
    signs = [
        np.array([1, 1, -1, -1, 1], np.int8),
        np.array([1, -1, -1, 1, -1], np.int8),
        np.array([-1, 1, -1, 1, -1], np.int8),
    ]
    np.testing.assert_array_equal(majority_vote(signs), [1, 1, -1, 1, -1])
    # two voters disagreeing: a tie, no step
    np.testing.assert_array_equal(majority_vote(signs[:2]), [1, 0, -1, 0, 0])


def test_signsgd_client_sends_ceil_d_over_8_bytes(ctx, client_data):
    signsgd = registry.algorithms.build("signsgd")
    assert signsgd.default_aggregator == "sum" and signsgd.server_lr == 0.01
    update = _client_update(signsgd, ctx, client_data)
    assert encoded_nbytes(update.message) == math.ceil(NUM_PARAMS / 8) == 1202
    # the decoded signs are exactly those of FedAvg's delta for the same client and generator
    delta = _client_update(FedAvg(), ctx, client_data).message
    decoded = _decode(signsgd, ctx, update.message)
    assert decoded.dtype == np.int8 and decoded.shape == (NUM_PARAMS,)
    np.testing.assert_array_equal(decoded, np.where(delta >= 0, 1, -1))


def test_signsgd_server_steps_by_lr_times_the_sign_of_the_vote():
    params = np.array([1.0, 1.0, 1.0, 1.0], np.float32)
    state = ServerState(4, {"params": params})
    new, diagnostics = SignSGD(server_lr=0.25).server_update(state, np.array([3, -1, 0, 10]), None)
    assert diagnostics == {}
    assert new.round == 5
    np.testing.assert_array_equal(new.arrays["params"], [1.25, 0.75, 1.0, 1.25])


def test_signsgd_rejects_a_server_optimizer(ctx):
    with pytest.raises(ConfigError, match="server_lr"):
        SignSGD(server_lr=0)
    adam = RunContext(
        config=ctx.config.replace(server__optimizer="adam"), input_shape=(64,), num_classes=10
    )
    with pytest.raises(ConfigError, match="server.optimizer"):
        SignSGD().init_server(adam)


# --- TopK ----------------------------------------------------------------------------------------


def test_top_k_hand_computed():
    vector = np.array([0.5, -3.0, 1.0, 2.0, -0.1], np.float32)
    message = top_k(vector, 2)
    assert message["indices"].dtype == np.int32 and message["values"].dtype == np.float32
    assert message["indices"].tolist() == [1, 3]
    assert message["values"].tolist() == [-3.0, 2.0]
    assert encoded_nbytes(message) == 16  # 8 bytes per kept entry
    np.testing.assert_array_equal(
        TopKCodec().decode(message, VectorLayout(5)), [0.0, -3.0, 0.0, 2.0, 0.0]
    )
    # equal magnitudes: the lower index wins, so the message is deterministic
    assert top_k(np.array([1.0, -1.0, 1.0], np.float32), 2)["indices"].tolist() == [0, 1]


def test_num_kept():
    assert num_kept(NUM_PARAMS, 0.1) == 961  # round(0.1 * 9610), not ceil(961.0000000000001)
    assert num_kept(10, 0.01) == 1 and num_kept(10, 1.0) == 10


def test_topk_client_sends_8k_bytes_and_decodes_exactly(ctx, client_data):
    topk = registry.algorithms.build("topk", fraction=0.1)
    assert topk.default_aggregator == "weighted_mean"
    update = _client_update(topk, ctx, client_data)
    assert encoded_nbytes(update.message) == 8 * 961
    delta = _client_update(FedAvg(), ctx, client_data).message
    decoded = _decode(topk, ctx, update.message)
    kept = update.message["indices"]
    assert decoded.dtype == np.float32 and decoded.shape == (NUM_PARAMS,)
    np.testing.assert_array_equal(decoded[kept], delta[kept])
    dropped = np.setdiff1d(np.arange(NUM_PARAMS), kept)
    assert not decoded[dropped].any()
    assert np.abs(delta[kept]).min() >= np.abs(delta[dropped]).max()
    with pytest.raises(ConfigError, match="algorithm.fraction"):
        TopK(fraction=0.0)


# --- the baselines learn on digits, with exact bytes ---------------------------------------------


@pytest.mark.parametrize(
    ("name", "bytes_up_per_client", "accuracy"),
    [
        # measured after 10 rounds, seeds 0-2: 0.90-0.92 and 0.83-0.90 (chance is 0.1;
        # 0.94-0.96 after the configs' 30 rounds)
        ("signsgd", 1202, 0.8),
        ("topk", 961 * 8, 0.75),
    ],
)
def test_compressed_baselines_learn_with_exact_bytes(tmp_path, name, bytes_up_per_client, accuracy):
    from raysim.assembly import run

    cfg = config.load(
        REPO_ROOT / "configs" / f"{name}_digits.yaml",
        [
            "runtime.backend=local",
            "run.rounds=10",
            *(SMALL_SIGNSGD if name == "signsgd" else SMALL_MODEL),
        ],
    )
    result = run(cfg, tmp_path, progress=False, tensorboard=False)
    assert result.summary["bytes_up"] == 10 * 10 * bytes_up_per_client
    assert result.summary["bytes_down"] == 10 * 10 * 4 * NUM_PARAMS  # dense float32 weights
    assert result.summary["final"]["accuracy"] >= accuracy
