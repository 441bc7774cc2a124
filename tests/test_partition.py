"""Partitioners: coverage, sizes, determinism, skew, and errors that name the config key."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.data.datasets import Dataset
from raysim.data.partition import (
    ClientSplit,
    PartitionResult,
    dirichlet_split,
    iid_split,
    natural_split,
    one_class_split,
    shards_split,
    split_dataset,
)
from raysim.data.partition_report import describe_split, label_histograms, label_skew
from raysim.errors import ConfigError

NUM_CLASSES = 10
PER_CLASS = 100


@pytest.fixture
def labels() -> np.ndarray:
    """1,000 balanced labels in random order."""
    rng = np.random.default_rng(123)
    return rng.permutation(np.repeat(np.arange(NUM_CLASSES, dtype=np.int64), PER_CLASS))


@pytest.fixture
def groups() -> np.ndarray:
    """Natural groups 0..4 of 1,000 samples with unequal sizes, interleaved."""
    rng = np.random.default_rng(7)
    return rng.permutation(np.repeat(np.arange(5, dtype=np.int64), [100, 150, 200, 250, 300]))


def _dataset(labels: np.ndarray, groups: np.ndarray | None = None) -> Dataset:
    x = np.zeros((len(labels), 2), dtype=np.float32)
    return Dataset("tiny", x, labels, x[:10], labels[:10], NUM_CLASSES, groups)


def _check_csr(split: ClientSplit, num_samples: int, every_sample: bool = True) -> None:
    assert split.indices.dtype == np.int64 and split.offsets.dtype == np.int64
    assert split.offsets[0] == 0 and split.offsets[-1] == len(split.indices)
    assert np.all(np.diff(split.offsets) >= 0)
    for client in range(split.num_clients):
        ids = split.client_indices(client)
        assert np.all(np.diff(ids) > 0), "ids must be ascending within a client"
    if every_sample:
        np.testing.assert_array_equal(np.sort(split.indices), np.arange(num_samples))
    else:
        assert len(np.unique(split.indices)) == len(split.indices)


PARTITIONS = {
    "iid": lambda y, g, seed: iid_split(y, 30, seed),
    "dirichlet": lambda y, g, seed: dirichlet_split(y, 30, seed, alpha=0.5),
    "shards": lambda y, g, seed: shards_split(y, 30, seed, shards_per_client=2),
    "one_class": lambda y, g, seed: one_class_split(y, 30, seed),
    "natural": lambda y, g, seed: natural_split(g, 3, seed),
}


@pytest.mark.parametrize("name", sorted(PARTITIONS))
def test_partition_is_a_deterministic_exact_cover(name, labels, groups):
    split = PARTITIONS[name](labels, groups, 0)
    _check_csr(split, len(labels), every_sample=name != "natural")
    assert split.num_clients == (3 if name == "natural" else 30)
    assert np.all(split.sizes >= 1)
    again = PARTITIONS[name](labels, groups, 0)
    np.testing.assert_array_equal(split.indices, again.indices)
    np.testing.assert_array_equal(split.offsets, again.offsets)
    other = PARTITIONS[name](labels, groups, 1)
    differs = not (
        np.array_equal(split.indices, other.indices)
        and np.array_equal(split.offsets, other.offsets)
    )
    assert differs


def test_iid_sizes_differ_by_at_most_one(labels):
    split = iid_split(labels, 7, seed=3)
    assert split.sizes.sum() == 1000
    assert split.sizes.max() - split.sizes.min() <= 1
    assert label_skew(split, labels, NUM_CLASSES) < 0.2


def test_dirichlet_skew_grows_as_alpha_shrinks(labels):
    skews = [
        label_skew(dirichlet_split(labels, 20, seed=0, alpha=alpha), labels, NUM_CLASSES)
        for alpha in (100.0, 1.0, 0.1)
    ]
    assert skews[0] < 0.15
    assert skews[0] < skews[1] < skews[2]
    assert skews[2] > 0.5


def test_dirichlet_respects_min_size(labels):
    split = dirichlet_split(labels, 50, seed=4, alpha=0.3, min_size=5)
    _check_csr(split, len(labels))
    assert split.sizes.min() >= 5


def test_dirichlet_gives_up_with_a_clear_error(labels):
    with pytest.raises(ConfigError, match=r"partition\.alpha.*larger partition\.alpha"):
        dirichlet_split(labels, 200, seed=0, alpha=0.01, min_size=5)


def test_shards_limit_classes_per_client(labels):
    split = shards_split(labels, 50, seed=0, shards_per_client=2)
    _check_csr(split, len(labels))
    assert np.all(split.sizes == 20)
    classes_per_client = (label_histograms(split, labels, NUM_CLASSES) > 0).sum(axis=1)
    assert classes_per_client.max() <= 2
    split3 = shards_split(labels, 20, seed=0, shards_per_client=5)
    assert (label_histograms(split3, labels, NUM_CLASSES) > 0).sum(axis=1).max() <= 5


def test_shards_spread_the_remainder():
    labels = np.arange(103, dtype=np.int64) % 3
    split = shards_split(labels, 10, seed=0, shards_per_client=2)
    _check_csr(split, 103)
    assert split.sizes.sum() == 103 and split.sizes.min() >= 10 and split.sizes.max() <= 12


def test_one_class_gives_each_client_exactly_one_class():
    labels = np.repeat(np.array([3, 5, 9], dtype=np.int64), [10, 11, 12])
    labels = np.random.default_rng(0).permutation(labels)
    split = one_class_split(labels, 7, seed=0)
    _check_csr(split, len(labels))
    present = np.array([3, 5, 9])
    for client in range(7):
        client_labels = np.unique(labels[split.client_indices(client)])
        np.testing.assert_array_equal(client_labels, [present[client % 3]])
    # class 3 is shared by clients 0, 3, 6: its 10 samples split 4/3/3
    np.testing.assert_array_equal(split.sizes[[0, 3, 6]], [4, 3, 3])
    np.testing.assert_array_equal(split.sizes[[1, 4]], [6, 5])


def test_one_class_errors_name_the_key_and_class():
    labels = np.repeat(np.arange(3, dtype=np.int64), [5, 1, 5])
    with pytest.raises(ConfigError, match=r"partition\.num_clients.*>= 3"):
        one_class_split(labels, 2, seed=0)
    with pytest.raises(ConfigError, match=r"class 1 has 1 samples.*empty"):
        one_class_split(labels, 5, seed=0)


def test_natural_uses_whole_groups(groups):
    split = natural_split(groups, 5, seed=0)
    _check_csr(split, len(groups))
    for client in range(5):
        np.testing.assert_array_equal(
            split.client_indices(client), np.flatnonzero(groups == client)
        )
    subset = natural_split(groups, 3, seed=0)
    chosen = [int(groups[subset.client_indices(c)][0]) for c in range(3)]
    assert chosen == sorted(chosen)
    for client, group in enumerate(chosen):
        np.testing.assert_array_equal(
            subset.client_indices(client), np.flatnonzero(groups == group)
        )


def test_natural_errors(groups, labels):
    with pytest.raises(ConfigError, match=r"partition\.num_clients.*<= 5"):
        natural_split(groups, 6, seed=0)
    with pytest.raises(ConfigError, match="dataset 'tiny' has no natural clients"):
        split_dataset(_dataset(labels), "natural", 3, 0)
    with pytest.raises(ConfigError, match="no natural clients"):
        natural_split(None, 3, seed=0)


def test_split_dataset_dispatches_through_the_registry(labels, groups):
    dataset = _dataset(labels, groups)
    expected = {
        "iid": ({}, iid_split(labels, 10, 5)),
        "dirichlet": ({"alpha": 0.3}, dirichlet_split(labels, 10, 5, alpha=0.3)),
        "shards": ({"shards_per_client": 3}, shards_split(labels, 10, 5, shards_per_client=3)),
        "one_class": ({}, one_class_split(labels, 10, 5)),
        "natural": ({}, natural_split(groups, 4, 5)),
    }
    for name, (options, want) in expected.items():
        got = split_dataset(dataset, name, want.num_clients, 5, options)
        assert isinstance(got, PartitionResult) and got.validation is None
        np.testing.assert_array_equal(got.train.indices, want.indices)
        np.testing.assert_array_equal(got.train.offsets, want.offsets)


@pytest.mark.parametrize(
    ("name", "options", "num_clients", "pattern"),
    [
        ("dirichlet", {"alpha": 0.0}, 10, r"partition\.alpha"),
        ("dirichlet", {"alpha": -1.0}, 10, r"partition\.alpha"),
        ("iid", {}, 0, r"partition\.num_clients.*>= 1"),
        ("iid", {}, 1001, r"partition\.num_clients.*<= 1000"),
        ("shards", {"shards_per_client": 0}, 10, r"partition\.shards_per_client.*>= 1"),
        ("shards", {"shards_per_client": 101}, 10, r"partition\.shards_per_client.*<= 100"),
        ("iid", {}, 2.5, r"partition\.num_clients.*integer"),
        ("shard", {}, 10, r"unknown partitioner 'shard' \(did you mean 'shards'\?\).*choices"),
        ("iid", {"alpha": 0.5}, 10, r"unknown option 'partition\.alpha'.*valid options: \(none\)"),
        ("shards", {"alpha": 0.5}, 10, r"'partition\.alpha'.*valid options: shards_per_client"),
        ("kmodes", {}, 10, r"partition 'kmodes'.*dataset 'tiny' is single-label"),
    ],
)
def test_split_dataset_errors_name_the_key(labels, name, options, num_clients, pattern):
    with pytest.raises(ConfigError, match=pattern) as caught:
        split_dataset(_dataset(labels), name, num_clients, 0, options)
    assert "\n" not in str(caught.value)


def test_label_histograms_and_skew_match_a_brute_force(labels):
    split = dirichlet_split(labels, 15, seed=2, alpha=0.5)
    histograms = label_histograms(split, labels, NUM_CLASSES)
    assert histograms.shape == (15, NUM_CLASSES) and histograms.dtype == np.int64
    for client in range(15):
        want = np.bincount(labels[split.client_indices(client)], minlength=NUM_CLASSES)
        np.testing.assert_array_equal(histograms[client], want)
    global_dist = np.bincount(labels, minlength=NUM_CLASSES) / len(labels)
    client_dist = histograms / histograms.sum(axis=1, keepdims=True)
    want_skew = 0.5 * np.abs(client_dist - global_dist).sum(axis=1).mean()
    assert label_skew(split, labels, NUM_CLASSES) == pytest.approx(want_skew, abs=1e-12)
    # one class per client with 10 balanced classes: TV = 1 - 1/10 exactly
    assert label_skew(one_class_split(labels, 20, 0), labels, NUM_CLASSES) == pytest.approx(0.9)


def test_describe_split_reports_the_numbers(labels):
    split = shards_split(labels, 50, seed=0, shards_per_client=2)
    text = describe_split(split, labels, NUM_CLASSES, max_rows=5)
    assert "clients: 50" in text and "samples: 1000" in text
    assert "min 20" in text and "median 20" in text and "mean 20.00" in text and "max 20" in text
    skew = label_skew(split, labels, NUM_CLASSES)
    assert f"{skew:.4f}" in text
    first = np.bincount(labels[split.client_indices(0)], minlength=NUM_CLASSES)
    assert " ".join(map(str, first)) in text
    assert "45 more clients not shown" in text
    assert len(text.splitlines()) == 4 + 5 + 1


def test_describe_split_is_compact_for_many_classes():
    labels = np.arange(500, dtype=np.int64) % 100
    split = iid_split(labels, 5, seed=0)
    text = describe_split(split, labels, 100)
    assert "label:count" in text
    assert max(len(line) for line in text.splitlines()) < 200


def test_split_dataset_gives_multi_hot_data_the_cmda_splits_with_validation():
    from raysim.data import cmda

    rng = np.random.default_rng(0)
    train_y = (rng.random((300, 6)) < 0.3).astype(np.float32)
    test_y = (rng.random((90, 6)) < 0.3).astype(np.float32)
    x = np.zeros((300, 2), dtype=np.float32)
    dataset = Dataset("multi", x, train_y, x[:90], test_y, 6)
    expected = {
        "iid": ({}, cmda.random_split(train_y, test_y, 5, 3)),
        "random": ({}, cmda.random_split(train_y, test_y, 5, 3)),
        "dirichlet": ({"alpha": 0.3}, cmda.dirichlet_split(train_y, test_y, 5, 3, 0.3)),
        "kmodes": ({}, cmda.kmodes_split(train_y, test_y, 5, 3)),
    }
    for name, (options, want) in expected.items():
        got = split_dataset(dataset, name, 5, 3, options)
        for a, b in ((got.train, want.train), (got.validation, want.validation)):
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.offsets, b.offsets)
    for name in ("shards", "one_class"):
        with pytest.raises(ConfigError, match=rf"^partition '{name}' splits single-label data"):
            split_dataset(dataset, name, 5, 3)
