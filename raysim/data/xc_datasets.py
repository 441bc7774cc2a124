"""Extreme Classification Repository data as `Dataset`s: FedAwS's sparse form and FLAG's dense one.

`load_extreme_classification` turns the files into the sparse-input `Dataset` form (see
`raysim.data.datasets.Dataset`): feature ids padded with `num_features`, one positive label
sampled per train point for FedAwS (multi-label -> multi-class), and every true label kept in
`train_label_sets` / `test_y` (padded with -1) for P@k. `load_xc_multilabel` reads the small
sets as FLAG data: dense features and multi-hot labels. Both read the files with
raysim.data.xml's parser.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.files import resolve_data_path
from raysim.data.options import _int_option
from raysim.data.xc_data import XCData, label_sets_to_multi_hot
from raysim.data.xml import XC_HOW_TO_OBTAIN, parse_xc_file, read_split_file
from raysim.errors import ConfigError, DataError

# --- XCData -> Dataset --------------------------------------------------------------------------


def padded_feature_ids(data: XCData, width: int | None = None) -> np.ndarray:
    """int32 (points, width) feature ids padded with `num_features`.

    width None: the largest number of features of any point (at least 1). A smaller width keeps
    each point's highest-valued features (ties: smaller feature id first), in file order.
    """
    counts = np.diff(data.feature_indptr)
    if width is None:
        width = max(1, int(counts.max(initial=0)))
    ids = data.feature_ids[data.feature_indptr[0] : data.feature_indptr[-1]]
    if counts.max(initial=0) > width:
        rows = np.repeat(np.arange(data.num_points, dtype=np.int64), counts)
        values = data.feature_values[data.feature_indptr[0] : data.feature_indptr[-1]]
        order = np.lexsort((ids, -values, rows))
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order)) - (
            data.feature_indptr[rows[order]] - data.feature_indptr[0]
        )
        keep = rank < width
        ids = ids[keep]
        counts = np.minimum(counts, width)
    x = np.full((data.num_points, width), data.num_features, dtype=np.int32)
    # A boolean mask assigns in row-major order, which is CSR order.
    x[np.arange(width)[None, :] < counts[:, None]] = ids
    return x


def padded_label_sets(label_indptr: np.ndarray, label_ids: np.ndarray) -> np.ndarray:
    """int64 (points, max labels per point) label ids padded with -1 (width at least 1)."""
    counts = np.diff(label_indptr)
    width = max(1, int(counts.max(initial=0)))
    sets = np.full((len(counts), width), -1, dtype=np.int64)
    sets[np.arange(width)[None, :] < counts[:, None]] = label_ids[
        label_indptr[0] : label_indptr[-1]
    ]
    return sets


def sample_positive_labels(data: XCData, rng: np.random.Generator) -> np.ndarray:
    """One label per point, uniform over its labels (every point must have one)."""
    counts = np.diff(data.label_indptr)
    return data.label_ids[data.label_indptr[:-1] + rng.integers(0, counts)].astype(np.int64)


def xc_to_dataset(
    name: str,
    train: XCData,
    test: XCData,
    seed: int | np.random.Generator,
    *,
    max_features_per_point: int | None = None,
) -> Dataset:
    """The sparse-input Dataset: train points without labels dropped, one positive sampled each.

    The padded width is shared by train and test: the largest feature count of any point, or
    `max_features_per_point`.
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    train_counts = np.diff(train.label_indptr)
    unlabelled = int(np.count_nonzero(train_counts == 0))
    if unlabelled:
        print(
            f"raysim: dataset '{name}': dropped {unlabelled} of {train.num_points} training "
            f"points that have no labels",
            file=sys.stderr,
            flush=True,
        )
        train = train.take(np.flatnonzero(train_counts > 0))
    if train.num_points == 0:
        raise DataError(f"dataset '{name}': no training point has a label")
    width = max_features_per_point
    if width is None:
        counts = np.concatenate([np.diff(train.feature_indptr), np.diff(test.feature_indptr)])
        width = max(1, int(counts.max(initial=0)))
        padded_bytes = 4 * width * len(counts)
        if padded_bytes > 256 << 20 and width > 4 * counts.mean():
            print(
                f"raysim: dataset '{name}': padding every point to its largest feature count "
                f"({width}; mean {counts.mean():.1f}) takes {padded_bytes / 2**20:.0f} MB; set "
                f"data.max_features_per_point to keep only each point's highest-valued features",
                file=sys.stderr,
                flush=True,
            )
    return Dataset(
        name=name,
        train_x=padded_feature_ids(train, width),
        train_y=sample_positive_labels(train, rng),
        test_x=padded_feature_ids(test, width),
        test_y=padded_label_sets(test.label_indptr, test.label_ids),
        num_classes=train.num_labels,
        num_features=train.num_features,
        train_label_sets=padded_label_sets(train.label_indptr, train.label_ids),
    )


# --- the dataset loader -------------------------------------------------------------------------


def _file_option(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"'data.{key}' must be a file name, got {value!r}")
    return value


def load_extreme_classification(
    root: str | None,
    seed: int,
    *,
    train_file: str = "train.txt",
    test_file: str = "test.txt",
    data_file: str | None = None,
    split: int = 0,
    max_features_per_point: int | None = None,
    max_test_points: int | None = None,
    train_split_file: str = "trSplit.txt",
    test_split_file: str = "tstSplit.txt",
) -> Dataset:
    """An Extreme Classification Repository dataset from `root` (e.g. Amazon-670K).

    Either `train_file` + `test_file` (the large datasets), or `data_file` with the split files
    `train_split_file` / `test_split_file` and the split column `split` (the small datasets).
    `max_test_points` evaluates on a fixed random subset of the test points (the same for every
    run seed, so results stay comparable). `seed` draws the one positive per train point.
    """
    train_file = _file_option("train_file", train_file)
    test_file = _file_option("test_file", test_file)
    train_split_file = _file_option("train_split_file", train_split_file)
    test_split_file = _file_option("test_split_file", test_split_file)
    if data_file is not None:
        data_file = _file_option("data_file", data_file)
    split = _int_option("split", split, 0)
    if max_features_per_point is not None:
        max_features_per_point = _int_option("max_features_per_point", max_features_per_point, 1)
    if max_test_points is not None:
        max_test_points = _int_option("max_test_points", max_test_points, 1)
    if root is None:
        raise DataError(
            f"'data.root' must be set for dataset 'extreme_classification' (the folder "
            f"holding train.txt and test.txt); {XC_HOW_TO_OBTAIN}"
        )
    if not os.path.isdir(root):
        raise DataError(
            f"dataset 'extreme_classification': data.root {root!r} is not a directory; "
            f"{XC_HOW_TO_OBTAIN}"
        )
    if data_file is None:
        train = parse_xc_file(os.path.join(root, train_file))
        test = parse_xc_file(
            os.path.join(root, test_file),
            num_features=train.num_features,
            num_labels=train.num_labels,
        )
    else:
        data = parse_xc_file(os.path.join(root, data_file))
        train = data.take(
            read_split_file(os.path.join(root, train_split_file), split, data.num_points)
        )
        test = data.take(
            read_split_file(os.path.join(root, test_split_file), split, data.num_points)
        )
    if test.num_points == 0:
        raise DataError(f"dataset 'extreme_classification': the test file in {root} has no points")
    if max_test_points is not None and max_test_points < test.num_points:
        chosen = np.random.default_rng(0).choice(test.num_points, max_test_points, replace=False)
        test = test.take(np.sort(chosen))
    return xc_to_dataset(
        "extreme_classification", train, test, seed, max_features_per_point=max_features_per_point
    )


# --- dense multi-label data for FLAG ------------------------------------------------------------

XC_DENSE_LIMIT = 1 << 28  # dense feature values (1 GiB of float32) a FLAG-sized XC set may use


def load_xc_multilabel(
    root: str | None,
    seed: int,
    *,
    train_file: str = "train.txt",
    test_file: str = "test.txt",
) -> Dataset:
    """Small XC datasets (Mediamill, Bibtex, Delicious, ...) as FLAG data: dense features and
    multi-hot labels, read with raysim.data.xml's parser (which names file and line on error).

    FLAG's models take dense vectors, so features are densified; sets whose points x features
    exceed XC_DENSE_LIMIT are refused (FedAwS's sparse path is the one for extreme sizes).
    """
    del seed
    train_path, test_path = resolve_data_path(root, train_file), resolve_data_path(root, test_file)
    for path in (train_path, test_path):
        if not os.path.lexists(path):  # a FIFO or folder there is refused by the reader
            raise DataError(f"dataset 'xc_multilabel': file not found: {path}")
    train = parse_xc_file(train_path)
    test = parse_xc_file(test_path, num_features=train.num_features, num_labels=train.num_labels)
    points = train.num_points + test.num_points
    # Both dense tables are sized by the header's counts: check them before allocating.
    for count, name in ((train.num_features, "features"), (train.num_labels, "labels")):
        if points * count > XC_DENSE_LIMIT:
            raise DataError(
                f"{train_path}: {points} points x {count} {name} is too large to densify for "
                f"FLAG (limit {XC_DENSE_LIMIT} values); use a smaller XC dataset"
            )

    def dense(data) -> np.ndarray:
        x = np.zeros((data.num_points, data.num_features), dtype=np.float32)
        rows = np.repeat(np.arange(data.num_points), np.diff(data.feature_indptr))
        x[rows, data.feature_ids] = data.feature_values
        return x

    def labels(data) -> np.ndarray:
        return label_sets_to_multi_hot(data.label_indptr, data.label_ids, data.num_labels)

    return Dataset(
        "xc_multilabel", dense(train), labels(train), dense(test), labels(test), train.num_labels
    )
