"""FLAG's label occurrence, two readings (`algorithm.occurrence`): `count` (the default,
positive labels) and `per_sample` (positive labels over the client's sample count). Tiny,
hand-computed, no real data."""

from __future__ import annotations

import numpy as np
import pytest

from raysim import config as config_module
from raysim.algorithms.flag import (
    FLAG,
    LabelWeightedMean,
    client_occurrence,
    declared_stats,
    label_weights,
)
from raysim.core.state import Contribution
from raysim.errors import ConfigError

# Three clients, L = 4 labels:
#   client 0: 5 samples, labels {0, 1, 2, 3}, 10 positives (2 per sample)
#   client 1: 30 samples, label {0} only, 30 positives (1 per sample)
#   client 2: 5 samples, labels {0, 1}, 10 positives (2 per sample)
LABELS = 4
Y = [
    np.array([[1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0], [0, 0, 1, 1], [1, 1, 0, 0]]),
    np.tile([1, 0, 0, 0], (30, 1)),
    np.tile([1, 1, 0, 0], (5, 1)),
]
DELTAS = [np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)]
DELTAS.append(np.array([1.0, 1.0], np.float32))
# D / sum D = [4, 1, 2] / 7 for both readings (wideness [1, 1/4, 1/2]).
# count:      O = [10, 30, 10],  O / sum O = [0.2, 0.6, 0.2]
#             w = 0.7 [4, 1, 2] / 7 + 0.3 [0.2, 0.6, 0.2] = [0.46, 0.28, 0.26]
# per_sample: O = [2, 1, 2],     O / sum O = [0.4, 0.2, 0.4]
#             w = 0.7 [4, 1, 2] / 7 + 0.3 [0.4, 0.2, 0.4] = [0.52, 0.16, 0.32]
COUNT = [0.46, 0.28, 0.26]
PER_SAMPLE = [0.52, 0.16, 0.32]


def contributions() -> list[Contribution]:
    """What the three clients send: delta, num_samples and the declared statistics, the
    latter computed from their label matrices as a FLAG client computes them."""
    return [
        Contribution(c, delta, len(y), declared_stats(y, LABELS))
        for c, (delta, y) in enumerate(zip(DELTAS, Y, strict=True))
    ]


def test_per_sample_weights_on_a_hand_computed_three_client_example():
    np.testing.assert_allclose(
        client_occurrence([10, 30, 10], [5, 30, 5], "per_sample"), [2.0, 1.0, 2.0]
    )
    aggregator = FLAG(alpha=0.3, occurrence="per_sample").default_aggregator
    assert aggregator.occurrence == "per_sample"
    weights = aggregator.client_weights(contributions())
    np.testing.assert_allclose(weights, PER_SAMPLE, rtol=0, atol=1e-15)
    assert weights.sum() == pytest.approx(1.0)
    expected = sum(w * d for w, d in zip(PER_SAMPLE, DELTAS, strict=True))
    np.testing.assert_allclose(aggregator.aggregate(contributions()), expected, rtol=1e-6)
    # alpha 1: occurrence only; a client without samples has occurrence 0.
    np.testing.assert_allclose(
        LabelWeightedMean(alpha=1.0, occurrence="per_sample").client_weights(contributions()),
        [0.4, 0.2, 0.4],
    )
    np.testing.assert_array_equal(client_occurrence([0, 4], [0, 2], "per_sample"), [0.0, 2.0])


def test_default_occurrence_is_the_count_and_unchanged():
    """The default gives the same weights as before the option (label_weights on the raw
    positive counts), bit for bit, whether `occurrence` is left out or set to count."""
    before = label_weights(np.array([4, 1, 2]) / 4, np.array([10, 30, 10]), 0.3)
    np.testing.assert_allclose(before, COUNT, rtol=0, atol=1e-15)
    for algorithm in (FLAG(alpha=0.3), FLAG(alpha=0.3, occurrence="count")):
        aggregator = algorithm.default_aggregator
        assert aggregator.occurrence == "count"
        np.testing.assert_array_equal(aggregator.client_weights(contributions()), before)
    np.testing.assert_array_equal(
        LabelWeightedMean(alpha=0.3).aggregate(contributions()),
        FLAG(alpha=0.3, occurrence="count").default_aggregator.aggregate(contributions()),
    )
    np.testing.assert_array_equal(client_occurrence([10, 30, 10], [5, 30, 5]), [10, 30, 10])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algorithm.occurrence=per_label"], "'algorithm.occurrence'"),
        (["aggregator={name: label_weighted, occurrence: per_label}"], "'aggregator.occurrence'"),
    ],
)
def test_a_bad_occurrence_is_one_line_naming_the_key(overrides, key):
    base = {
        "data": {"name": "synthetic_multilabel"},
        "partition": {"name": "kmodes", "num_clients": 3},
        "clients": {"per_round": 3},
        "model": {"name": "mlp", "hidden": [8]},
        "algorithm": {"name": "flag", "alpha": 0.3},
        "runtime": {"backend": "local"},
    }
    with pytest.raises(ConfigError) as error:
        config_module.from_dict(base, overrides)
    message = str(error.value)
    assert "\n" not in message
    assert key in message and "count, per_sample" in message and "per_label" in message
