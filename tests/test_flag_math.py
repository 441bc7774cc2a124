"""FLAG's pure pieces: Asymmetric Loss, mAP, label weights, the CMDA split and its report."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysim.algorithms.flag import label_statistics, label_weights
from raysim.data import cmda
from raysim.data.multilabel import load_synthetic_multilabel
from raysim.losses import asymmetric_loss, binary_cross_entropy
from raysim.metrics.multilabel import mean_average_precision, rounds_to_target


def test_asymmetric_loss_matches_a_hand_computation():
    logits = torch.tensor([[2.0, -1.0], [0.0, 0.5]])
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    gamma_neg, gamma_pos, clip = 4.0, 1.0, 0.05

    def positive(x):  # y = 1: (1 - p)^g+ log p
        p = sig(x)
        return (1 - p) ** gamma_pos * math.log(p)

    def negative(x):  # y = 0: p_m^g- log(1 - p_m), p_m = max(p - m, 0)
        pm = max(sig(x) - clip, 0.0)
        return pm**gamma_neg * math.log(1 - pm)

    expected = -((positive(2.0) + negative(-1.0)) + (negative(0.0) + positive(0.5))) / 2
    got = asymmetric_loss(logits, targets, gamma_neg, gamma_pos, clip)
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_asymmetric_loss_without_focusing_or_clip_is_bce():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 5, generator=generator)
    targets = (torch.rand(8, 5, generator=generator) > 0.6).float()
    asl = asymmetric_loss(logits, targets, gamma_neg=0.0, gamma_pos=0.0, clip=0.0)
    assert float(asl) == pytest.approx(float(binary_cross_entropy(logits, targets)), rel=1e-5)


def test_map_equals_scikit_learn_macro_average_precision():
    from sklearn.metrics import average_precision_score

    rng = np.random.default_rng(0)
    targets = (rng.random((300, 12)) < 0.2).astype(np.uint8)
    targets[0] = 1  # every label has a positive
    scores = rng.normal(size=(300, 12)) + targets
    scores[:50, 3] = 0.25  # ties, which scikit-learn groups into one threshold
    expected = average_precision_score(targets, scores, average="macro")
    assert mean_average_precision(scores, targets) == pytest.approx(expected, abs=1e-12)


def test_map_skips_labels_without_positives():
    targets = np.array([[1, 0], [0, 0], [1, 0]])
    scores = np.array([[0.9, 0.1], [0.2, 0.5], [0.8, 0.3]])
    assert mean_average_precision(scores, targets) == 1.0


def test_label_weights_on_a_hand_made_three_client_example():
    # L = 4 labels. Client 0: labels {0,1,2,3} with 10 positives; 1: {0} with 30; 2: {0,1}, 10.
    wideness = np.array([4, 1, 2]) / 4
    occurrence = np.array([10, 30, 10])
    weights = label_weights(wideness, occurrence, alpha=0.3)
    # D / sum D = [4, 1, 2] / 7 ; O / sum O = [10, 30, 10] / 50
    expected = 0.7 * np.array([4, 1, 2]) / 7 + 0.3 * np.array([0.2, 0.6, 0.2])
    np.testing.assert_allclose(weights, expected, rtol=0, atol=1e-15)
    assert weights.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(label_weights(wideness, occurrence, 0.0), [4 / 7, 1 / 7, 2 / 7])
    np.testing.assert_allclose(label_weights(wideness, occurrence, 1.0), [0.2, 0.6, 0.2])


def test_label_statistics_are_distinct_labels_and_positive_count():
    y = np.array([[1, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 1]])
    assert label_statistics(y).tolist() == [2, 4]


def test_rounds_to_target():
    assert rounds_to_target([0.1, 0.5, 0.79, 0.81, 0.9], 0.8) == 4
    assert rounds_to_target([0.1, float("nan")], 0.8) is None


def test_kmodes_validation_points_go_to_the_training_modes():
    from kmodes.kmodes import KModes

    data = load_synthetic_multilabel(None, 0, num_samples=600, num_test=200, num_labels=8)
    split = cmda.kmodes_split(data.train_y, data.test_y, 4, seed=3)
    # The same k-modes fit (package kmodes, Huang init, same seed) gives the same modes ...
    reference = KModes(n_clusters=4, init="Huang", n_init=1, random_state=3).fit(data.train_y)
    np.testing.assert_array_equal(split.modes, reference.cluster_centroids_)
    # ... and every validation point belongs to its nearest TRAINING mode (Hamming distance).
    hamming = (data.test_y[:, None, :] != split.modes[None, :, :]).sum(axis=2)
    client_of = np.empty(len(data.test_y), dtype=np.int64)
    client_of[split.validation.indices] = split.validation.client_ids()
    assert set(split.validation.indices.tolist()) == set(range(len(data.test_y)))
    np.testing.assert_array_equal(client_of, hamming.argmin(axis=1))
    np.testing.assert_array_equal(client_of, reference.predict(data.test_y))


def test_cmda_is_far_more_skewed_than_a_random_split():
    data = load_synthetic_multilabel(None, 0, num_samples=3000, num_test=500)
    kmodes = cmda.split_report(
        data.train_y, cmda.kmodes_split(data.train_y, data.test_y, 10, 0).train
    )
    random = cmda.split_report(
        data.train_y, cmda.random_split(data.train_y, data.test_y, 10, 0).train
    )
    assert kmodes["kl_total"] > 100 * random["kl_total"]
    assert kmodes["size_ratio"] >= 5
    assert random["size_ratio"] <= 1.01


def test_pairwise_kl_hand_example():
    counts = np.array([[1, 0], [0, 1]])
    dist = cmda.label_distributions(counts, epsilon=1e-3)
    a = 1.001 / 1.002
    b = 0.001 / 1.002
    kl = a * math.log(a / b) + b * math.log(b / a)
    np.testing.assert_allclose(cmda.pairwise_kl(dist), [[0, kl], [kl, 0]], rtol=1e-12)


def test_dirichlet_multilabel_split_covers_every_sample_once(tmp_path):
    data = load_synthetic_multilabel(None, 1, num_samples=500, num_test=100)
    split = cmda.dirichlet_split(data.train_y, data.test_y, 5, seed=0, alpha=0.3)
    assert sorted(split.train.indices.tolist()) == list(range(500))
    assert sorted(split.validation.indices.tolist()) == list(range(100))
    report = cmda.split_report(data.train_y, split.train)
    paths = cmda.save_split_plots(report, tmp_path, "dirichlet")
    from PIL import Image

    for path in paths.values():
        assert Image.open(path).size[0] > 100
