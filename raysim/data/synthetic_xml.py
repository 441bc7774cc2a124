"""Synthetic extreme-classification data shaped like Amazon-670K, at any scale, with no download.

Generative story (all vectorised numpy, one `np.random.Generator` from the seed):

- Labels get Zipf weights `w = rank^-zipf_exponent` (ranks a random permutation), and are split
  into `num_clusters` clusters of near-equal size (about 16 labels each by default).
- Each label has `signature_features` feature ids, each cluster `cluster_features` ids (uniform
  over the vocabulary): the features that carry the labels.
- A point picks a cluster (train: a quota that lets every label appear, the rest in proportion
  to the clusters' total weight; test: in proportion to weight), then `1 + Poisson(mean - 1)`
  distinct labels: most from its cluster, drawn without replacement in proportion to `w`
  (Gumbel top-k), each with probability `cross_cluster_probability` from the whole label set.
  Labels of a cluster therefore co-occur and share features (real nearest-class structure).
- Its features: each signature feature of each of its labels with probability 0.8, each of its
  cluster's features with probability 0.5, and `Poisson` noise features drawn from a Zipf(1)
  distribution over the vocabulary (frequent "stop words"), to `features_per_point` on average
  before duplicates are merged.

Coverage guarantee: every label appears in at least one training point's label set, always
(clusters are capped at `num_train`, and each label of a cluster is assigned to one of the
cluster's training points). When `num_labels` is large against `num_train` this raises the mean
labels per train point above `labels_per_point` (at most ceil(num_labels / num_train) assigned
labels per point). Every point has at least one label.
"""

from __future__ import annotations

import math

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.options import _float_option, _generated_size, _int_option
from raysim.data.xc_data import XCData
from raysim.data.xc_datasets import xc_to_dataset
from raysim.errors import ConfigError
from raysim.seeds import synthetic_xml_streams

# Amazon-670K (Extreme Classification Repository) at scale 1.
AMAZON_670K = {"labels": 670_091, "features": 135_909, "train": 490_449, "test": 153_025}
_SIGNATURE_KEEP = 0.8  # probability that a label's signature feature shows in a point
_CLUSTER_KEEP = 0.5  # probability that a cluster feature shows in a point of that cluster
_MAX_LABELS_PER_CLUSTER = 4096
_BLOCK_ENTRIES = 1 << 22  # points are generated in blocks of about this many candidate entries


def _scaled(value: int | None, key: str, full: int, scale: float, minimum: int) -> int:
    if value is not None:
        return _int_option(key, value, minimum)
    return max(minimum, int(round(full * scale)))


def _clusters(
    rng: np.random.Generator, num_labels: int, num_clusters: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels of each cluster padded with -1: (C, m_max), cluster sizes, cluster of label)."""
    order = rng.permutation(num_labels)
    cluster_of_position = np.arange(num_labels, dtype=np.int64) * num_clusters // num_labels
    sizes = np.bincount(cluster_of_position, minlength=num_clusters)
    starts = np.cumsum(sizes) - sizes
    column = np.arange(num_labels) - starts[cluster_of_position]
    members = np.full((num_clusters, int(sizes.max())), -1, dtype=np.int64)
    members[cluster_of_position, column] = order
    cluster_of_label = np.empty(num_labels, dtype=np.int64)
    cluster_of_label[order] = cluster_of_position
    return members, sizes, cluster_of_label


def _train_clusters(
    rng: np.random.Generator,
    sizes: np.ndarray,
    popularity: np.ndarray,
    num_train: int,
    labels_per_point: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cluster of each train point, its rank among its cluster's points, points per cluster.

    Every cluster gets at least ceil(size / f) points (f labels assigned per point, the smallest
    f >= labels_per_point / 2 that fits), so each of its labels can be assigned to one of them;
    the remaining points go to clusters in proportion to their popularity.
    """
    per_point = max(1, math.ceil(labels_per_point / 2))
    while np.sum(-(-sizes // per_point)) > num_train:
        per_point += 1
    quota = -(-sizes // per_point)
    extra = rng.multinomial(num_train - int(quota.sum()), popularity / popularity.sum())
    counts = quota + extra
    sorted_cluster = np.repeat(np.arange(len(sizes)), counts)
    sorted_rank = np.arange(num_train) - np.repeat(np.cumsum(counts) - counts, counts)
    shuffle = rng.permutation(num_train)
    return sorted_cluster[shuffle], sorted_rank[shuffle], counts


def _draw_labels(
    rng: np.random.Generator,
    point_cluster: np.ndarray,
    point_rank: np.ndarray | None,
    cluster_points: np.ndarray | None,
    members: np.ndarray,
    sizes: np.ndarray,
    log_weight: np.ndarray,
    cumulative_weight: np.ndarray,
    labels_per_point: float,
    cross_probability: float,
) -> tuple[np.ndarray, np.ndarray]:
    """CSR (indptr, sorted label ids) of distinct labels for each point of one block."""
    points = len(point_cluster)
    num_labels = len(log_weight)
    wanted = 1 + rng.poisson(labels_per_point - 1.0, size=points)
    cross = rng.binomial(wanted - 1, cross_probability)
    size = sizes[point_cluster]
    candidates = members[point_cluster]  # (points, m_max), -1 padded
    keys = np.where(candidates >= 0, log_weight[np.maximum(candidates, 0)], -np.inf)
    keys += rng.gumbel(size=keys.shape)
    within = wanted - cross
    if point_rank is not None:  # train: assigned labels first (every label in some point)
        point_count = cluster_points[point_cluster]
        column = np.arange(members.shape[1])
        assigned = (column[None, :] % point_count[:, None] == point_rank[:, None]) & (
            column[None, :] < size[:, None]
        )
        keys[assigned] = np.inf
        within = np.maximum(within, assigned.sum(axis=1))
    within = np.minimum(within, size)
    order = np.argsort(-keys, axis=1, kind="stable")
    take = np.arange(members.shape[1])[None, :] < within[:, None]
    rows_within = np.nonzero(take)[0]
    labels_within = np.take_along_axis(candidates, order, axis=1)[take]
    rows_cross = np.repeat(np.arange(points), cross)
    draws = rng.random(len(rows_cross)) * cumulative_weight[-1]
    labels_cross = np.minimum(np.searchsorted(cumulative_weight, draws), num_labels - 1)
    key = _sorted_unique(
        np.concatenate([rows_within, rows_cross]) * num_labels
        + np.concatenate([labels_within, labels_cross])
    )
    rows = key // num_labels
    indptr = np.zeros(points + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=points), out=indptr[1:])
    return indptr, key - rows * num_labels


def _draw_features(
    rng: np.random.Generator,
    label_indptr: np.ndarray,
    label_ids: np.ndarray,
    point_cluster: np.ndarray,
    signatures: np.ndarray,
    cluster_features: np.ndarray,
    noise_order: np.ndarray,
    noise_mean: float,
) -> tuple[np.ndarray, np.ndarray]:
    """CSR (indptr, sorted int32 feature ids) of each point of one block."""
    points = len(point_cluster)
    num_features = len(noise_order)
    label_rows = np.repeat(np.arange(points), np.diff(label_indptr))
    signature_ids = signatures[label_ids]  # (labels in block, s)
    keep = rng.random(signature_ids.shape) < _SIGNATURE_KEEP
    signature_rows = np.broadcast_to(label_rows[:, None], signature_ids.shape)[keep]
    shared_ids = cluster_features[point_cluster]  # (points, cf)
    keep_shared = rng.random(shared_ids.shape) < _CLUSTER_KEEP
    shared_rows = np.broadcast_to(np.arange(points)[:, None], shared_ids.shape)[keep_shared]
    noise_counts = rng.poisson(noise_mean, size=points)
    noise_rows = np.repeat(np.arange(points), noise_counts)
    # Zipf(1) by inverse CDF: rank floor((F+1)^u) has P(k) = log((k+1)/k) / log(F+1) ~ 1/k.
    noise_rank = np.exp(rng.random(len(noise_rows)) * math.log(num_features + 1.0))
    noise_rank = np.clip(noise_rank.astype(np.int64) - 1, 0, num_features - 1)
    noise_ids = noise_order[noise_rank]
    rows = np.concatenate([signature_rows, shared_rows, noise_rows]).astype(np.int64)
    ids = np.concatenate([signature_ids[keep], shared_ids[keep_shared], noise_ids])
    key = _sorted_unique(rows * num_features + ids)
    rows = key // num_features
    indptr = np.zeros(points + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=points), out=indptr[1:])
    return indptr, (key - rows * num_features).astype(np.int32)


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique by one in-place sort (numpy 2's hash-based unique is ~10x slower here)."""
    values.sort()
    keep = np.empty(len(values), dtype=bool)
    keep[:1] = True
    np.not_equal(values[1:], values[:-1], out=keep[1:])
    return values[keep]


def _concatenate_csr(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    counts = np.concatenate([np.diff(indptr) for indptr, _ in parts])
    indptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, np.concatenate([ids for _, ids in parts])


def generate_synthetic_xml(
    seed: int | np.random.Generator,
    *,
    num_labels: int,
    num_features: int,
    num_train: int,
    num_test: int,
    labels_per_point: float = 5.45,
    zipf_exponent: float = 0.6,
    num_clusters: int | None = None,
    features_per_point: float = 75.0,
    signature_features: int = 4,
    cluster_features: int = 8,
    cross_cluster_probability: float = 0.1,
) -> tuple[XCData, XCData]:
    """(train, test) as XCData with feature values 1.0; see the module docstring."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if num_clusters is None:
        num_clusters = max(1, round(num_labels / 16))
    num_clusters = min(num_clusters, num_labels, num_train)
    members, sizes, cluster_of_label = _clusters(rng, num_labels, num_clusters)
    if members.shape[1] > _MAX_LABELS_PER_CLUSTER:
        raise ConfigError(
            f"'data.num_clusters'={num_clusters} puts {members.shape[1]} labels in a cluster; "
            f"at most {_MAX_LABELS_PER_CLUSTER} are supported (use more clusters)"
        )
    weight = (rng.permutation(num_labels) + 1.0) ** -zipf_exponent
    log_weight = np.log(weight)
    cumulative_weight = np.cumsum(weight)
    popularity = np.bincount(cluster_of_label, weights=weight, minlength=num_clusters)
    signatures = rng.integers(
        0, num_features, size=(num_labels, signature_features), dtype=np.int32
    )
    shared = rng.integers(0, num_features, size=(num_clusters, cluster_features), dtype=np.int32)
    noise_order = rng.permutation(num_features).astype(np.int32)  # feature of each noise rank
    signal = labels_per_point * signature_features * _SIGNATURE_KEEP
    noise_mean = max(0.0, features_per_point - signal - cluster_features * _CLUSTER_KEEP)

    train_cluster, train_rank, cluster_points = _train_clusters(
        rng, sizes, popularity, num_train, labels_per_point
    )
    test_cluster = rng.choice(num_clusters, size=num_test, p=popularity / popularity.sum())
    block = max(1, _BLOCK_ENTRIES // max(members.shape[1], int(features_per_point), 1))

    def split(point_cluster: np.ndarray, point_rank: np.ndarray | None, count: int) -> XCData:
        label_parts, feature_parts = [], []
        for start in range(0, count, block):
            stop = min(count, start + block)
            clusters = point_cluster[start:stop]
            label_indptr, label_ids = _draw_labels(
                rng,
                clusters,
                None if point_rank is None else point_rank[start:stop],
                cluster_points,
                members,
                sizes,
                log_weight,
                cumulative_weight,
                labels_per_point,
                cross_cluster_probability,
            )
            label_parts.append((label_indptr, label_ids))
            feature_parts.append(
                _draw_features(
                    rng,
                    label_indptr,
                    label_ids,
                    clusters,
                    signatures,
                    shared,
                    noise_order,
                    noise_mean,
                )
            )
        label_indptr, label_ids = _concatenate_csr(label_parts)
        feature_indptr, feature_ids = _concatenate_csr(feature_parts)
        # Values are all 1.0: a zero-stride view, so no memory for 37M ones at scale 1.
        values = np.broadcast_to(np.float32(1.0), feature_ids.shape)
        return XCData(
            num_features, num_labels, label_indptr, label_ids, feature_indptr, feature_ids, values
        )

    train = split(train_cluster, train_rank, num_train)
    test = split(test_cluster, None, num_test)
    return train, test


def load_synthetic_xml(
    root: str | None,
    seed: int,
    *,
    scale: float = 0.01,
    num_labels: int | None = None,
    num_features: int | None = None,
    num_train: int | None = None,
    num_test: int | None = None,
    labels_per_point: float = 5.45,
    zipf_exponent: float = 0.6,
    num_clusters: int | None = None,
    features_per_point: float = 75.0,
    signature_features: int = 4,
    cluster_features: int = 8,
    cross_cluster_probability: float = 0.1,
) -> Dataset:
    """Synthetic XML data shaped like Amazon-670K (scale 1: 670,091 labels, 135,909 features,
    490,449 train and 153,025 test points, 5.45 labels per point, Zipf-like label frequencies).

    `num_*` options override the scaled sizes (num_features never goes below 1,000, so a small
    label set keeps a vocabulary in which labels are distinguishable). `features_per_point`
    counts draws before duplicate ids merge (75 leaves ~60 distinct ids per point on a 1,000-word
    vocabulary, ~69 at scale 1). The output is the XC loader's sparse Dataset form with one
    positive sampled per train point. Scale 1 takes ~7 s of CPU and ~0.75 GB above the imports.
    """
    del root
    scale = _float_option("scale", scale, minimum=0.0, strict=True)
    num_labels = _scaled(num_labels, "num_labels", AMAZON_670K["labels"], scale, 2)
    if num_features is None:
        num_features = max(1000, int(round(AMAZON_670K["features"] * scale)))
    num_features = _int_option("num_features", num_features, 1)
    num_train = _scaled(num_train, "num_train", AMAZON_670K["train"], scale, 1)
    num_test = _scaled(num_test, "num_test", AMAZON_670K["test"], scale, 1)
    labels_per_point = _float_option("labels_per_point", labels_per_point, minimum=1.0)
    zipf_exponent = _float_option("zipf_exponent", zipf_exponent, minimum=0.0)
    if num_clusters is not None:
        num_clusters = _int_option("num_clusters", num_clusters, 1)
    features_per_point = _float_option("features_per_point", features_per_point, minimum=0.0)
    signature_features = _int_option("signature_features", signature_features, 1)
    cluster_features = _int_option("cluster_features", cluster_features, 0)
    cross_cluster_probability = _float_option(
        "cross_cluster_probability", cross_cluster_probability, minimum=0.0
    )
    # Label and feature ids are int32; points hold ~features_per_point + labels_per_point ids.
    for key, count in (("num_labels", num_labels), ("num_features", num_features)):
        if count > np.iinfo(np.int32).max:
            raise ConfigError(f"'data.{key}' must be <= 2^31 - 1 (int32 ids), got {count}")
    _generated_size(
        "data synthetic_xml",
        int((num_train + num_test) * (features_per_point + labels_per_point)),
        "data.scale, data.num_train, data.num_test or data.features_per_point",
    )
    if cross_cluster_probability > 1.0:
        raise ConfigError(
            f"'data.cross_cluster_probability' must be in [0, 1], got {cross_cluster_probability}"
        )
    generator_seed, positive_seed = synthetic_xml_streams(seed)
    train, test = generate_synthetic_xml(
        np.random.default_rng(generator_seed),
        num_labels=num_labels,
        num_features=num_features,
        num_train=num_train,
        num_test=num_test,
        labels_per_point=labels_per_point,
        zipf_exponent=zipf_exponent,
        num_clusters=num_clusters,
        features_per_point=features_per_point,
        signature_features=signature_features,
        cluster_features=cluster_features,
        cross_cluster_probability=cross_cluster_probability,
    )
    return xc_to_dataset("synthetic_xml", train, test, np.random.default_rng(positive_seed))
