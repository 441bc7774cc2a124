"""Extreme-classification data: the XC repository reader (tiny files written here) and the
synthetic Amazon-670K-shaped generator."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from raysim import registry
from raysim.data import xml
from raysim.data.synthetic_xml import load_synthetic_xml
from raysim.data.xc_data import XCData, label_sets_to_multi_hot, write_xc_file
from raysim.data.xc_datasets import load_extreme_classification
from raysim.data.xml import parse_xc_file
from raysim.errors import ConfigError, DataError

# Five points, 6 features, 5 labels: an empty label list written both ways (leading space; a
# line that starts with a feature), a point with labels and no features, exponents and signs.
TINY = "5 6 5\n0,2 0:1.0 3:0.5\n 1:2.5 5:-1e-1\n4\n3,1 2:0.25 0:+3 4:.5\n2:7.\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def assert_tiny(data: XCData) -> None:
    assert (data.num_features, data.num_labels, data.num_points) == (6, 5, 5)
    np.testing.assert_array_equal(data.label_indptr, [0, 2, 2, 3, 5, 5])
    np.testing.assert_array_equal(data.label_ids, [0, 2, 4, 3, 1])
    np.testing.assert_array_equal(data.feature_indptr, [0, 2, 4, 4, 7, 8])
    np.testing.assert_array_equal(data.feature_ids, [0, 3, 1, 5, 2, 0, 4, 2])
    np.testing.assert_array_equal(
        data.feature_values, np.float32([1.0, 0.5, 2.5, -0.1, 0.25, 3.0, 0.5, 7.0])
    )
    assert data.label_ids.dtype == np.int64 and data.label_indptr.dtype == np.int64
    assert data.feature_ids.dtype == np.int32 and data.feature_values.dtype == np.float32


@pytest.fixture(params=["fast", "line_by_line"])
def parse_mode(request, monkeypatch):
    """Run a test through the vectorised parser and through the line-by-line reference."""
    if request.param == "line_by_line":
        monkeypatch.setattr(xml, "_parse_block_fast", lambda *args: None)
    return request.param


# --- the reader ---------------------------------------------------------------------------------


def test_parse_tiny_file_exact(tmp_path, parse_mode):
    assert_tiny(parse_xc_file(write(tmp_path / "train.txt", TINY)))


def test_parse_tolerates_crlf_tabs_no_final_newline_and_trailing_blank_lines(tmp_path):
    text = TINY.replace("\n", "\r\n").replace("0,2 0:1.0", "0,2\t0:1.0")
    assert_tiny(parse_xc_file(write(tmp_path / "a.txt", text)))
    assert_tiny(parse_xc_file(write(tmp_path / "b.txt", TINY.rstrip("\n"))))
    assert_tiny(parse_xc_file(write(tmp_path / "c.txt", TINY + "\n  \n\n")))


def test_write_then_parse_round_trip(tmp_path):
    data = parse_xc_file(write(tmp_path / "train.txt", TINY))
    write_xc_file(tmp_path / "copy.txt", data)
    assert_tiny(parse_xc_file(tmp_path / "copy.txt"))


def test_fast_path_agrees_with_line_by_line_reference(tmp_path, monkeypatch):
    """Random valid lines in every number spelling: both paths give identical arrays."""
    rng = np.random.default_rng(0)
    spellings = ["{:.6g}", "{:.3e}", "{:+.2f}", "{:.1E}", "{}"]
    lines = []
    for _ in range(400):
        labels = ",".join(map(str, rng.choice(50, rng.integers(0, 4), replace=False)))
        pairs = []
        for feature in rng.choice(300, rng.integers(0, 12), replace=False):
            value = float(rng.normal() * 10.0 ** rng.integers(-3, 3))
            pairs.append(f"{feature}:{spellings[rng.integers(len(spellings))].format(value)}")
        sep = " " * int(rng.integers(1, 3))
        lines.append(f"{labels}{sep}{sep.join(pairs)}" if pairs else labels)
    path = write(tmp_path / "random.txt", f"{len(lines)} 300 50\n" + "\n".join(lines) + "\n")
    body = path.read_bytes().split(b"\n", 1)[1]
    assert xml._parse_block_fast(body, 300, 50) is not None  # the fast path accepts it all
    fast = parse_xc_file(path)
    monkeypatch.setattr(xml, "_parse_block_fast", lambda *args: None)
    reference = parse_xc_file(path)
    for field in ("label_indptr", "label_ids", "feature_indptr", "feature_ids", "feature_values"):
        np.testing.assert_array_equal(getattr(fast, field), getattr(reference, field))


MALFORMED = [
    # (content, line number in the message, what the message says)
    ("3 5\n0 1:1\n", 1, "bad header"),
    ("two 5 5\n", 1, "bad header"),
    ("", 1, "bad header"),
    ("2 6 5\n0 1:1\n1 3:abc\n", 3, "'3:abc' is not a feature:value pair"),
    ("2 6 5\n0 1:1\n1 3:\n", 3, "'3:' is not a feature:value pair"),
    ("2 6 5\n0 1:1\n1 :0.5\n", 3, "':0.5' is not a feature:value pair"),
    ("2 6 5\n0 1:2:3 4\n1 1:1\n", 2, "'1:2:3' is not a feature:value pair"),
    ("2 6 5\n0 1:1 4\n1 1:1\n", 2, "'4' is not a feature:value pair"),
    ("2 6 5\n0 1e0:1\n1 1:1\n", 2, "'1e0:1' is not a feature:value pair"),
    ("2 6 5\n0 1:1\n1,,2 1:1\n", 3, "label list '1,,2'"),
    ("2 6 5\n0 1:1\n1.5 1:1\n", 3, "label list '1.5'"),
    ("2 6 5\n0 1:1\n1,7 1:1\n", 3, "label id 7 is out of range [0, 5)"),
    ("2 6 5\n0 6:1\n1 1:1\n", 2, "feature id 6 is out of range [0, 6)"),
    ("2 6 5\n0 1:nan\n", 2, "non-finite value 'nan'"),
    ("2 6 5\n0 1:1\n0 2:inf\n", 3, "non-finite value 'inf'"),
    ("2 6 5\n0 1:1\n0 2:1e39\n", 3, "non-finite value '1e39'"),
    ("3 6 5\n0 1:1\n1 2:1\n", 4, "ends after 2 points but its header (line 1) says 3"),
    ("1 6 5\n0 1:1\n\n1 2:1\n", 4, "more points than the 1"),
    ("1 6 5\n0 1:1 \xe9:1\n", 2, "is not a feature:value pair"),
]


@pytest.mark.parametrize(("content", "line", "message"), MALFORMED)
def test_malformed_input_names_file_and_line(tmp_path, parse_mode, content, line, message):
    path = write(tmp_path / "bad.txt", content)
    with pytest.raises(DataError) as caught:
        parse_xc_file(path)
    text = str(caught.value)
    assert text.startswith(f"{path}, line {line}:"), text
    assert message in text
    assert "\n" not in text  # one line


def test_error_on_a_late_line_of_a_big_file_names_that_line(tmp_path):
    lines = ["0,1 1:0.5 2:0.25"] * 3000
    lines[2716] = "0,1 1:0.5 2:x"
    path = write(tmp_path / "big.txt", "3000 6 5\n" + "\n".join(lines) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}, line 2718: '2:x'")):
        parse_xc_file(path)


def test_missing_file_says_how_to_obtain(tmp_path):
    with pytest.raises(DataError, match=r"not found: .*train\.txt; download .*Extreme Classif"):
        parse_xc_file(tmp_path / "train.txt")


def test_expected_counts_must_match_the_header(tmp_path):
    path = write(tmp_path / "test.txt", TINY)
    assert_tiny(parse_xc_file(path, num_features=6, num_labels=5))
    with pytest.raises(DataError, match=r"line 1: header says 5 labels but 7 were expected"):
        parse_xc_file(path, num_labels=7)


def test_label_sets_to_multi_hot():
    multi_hot = label_sets_to_multi_hot(np.array([0, 2, 2, 3]), np.array([0, 3, 1]), 4)
    assert multi_hot.dtype == np.uint8
    np.testing.assert_array_equal(multi_hot, [[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]])


# --- the loader ---------------------------------------------------------------------------------

TEST_FILE = "2 6 5\n1,3 0:1 5:2 2:0.5\n 4:1\n"


def test_loader_builds_the_sparse_dataset(tmp_path, capsys):
    write(tmp_path / "train.txt", TINY)
    write(tmp_path / "test.txt", TEST_FILE)
    data = load_extreme_classification(str(tmp_path), 0)
    assert "dropped 2 of 5 training points that have no labels" in capsys.readouterr().err
    assert data.name == "extreme_classification"
    assert (data.num_classes, data.num_features) == (5, 6)
    pad = 6  # = num_features
    np.testing.assert_array_equal(data.train_x, [[0, 3, pad], [pad, pad, pad], [2, 0, 4]])
    np.testing.assert_array_equal(data.train_label_sets, [[0, 2], [4, -1], [3, 1]])
    np.testing.assert_array_equal(data.test_x, [[0, 5, 2], [4, pad, pad]])
    np.testing.assert_array_equal(data.test_y, [[1, 3], [-1, -1]])
    assert data.train_x.dtype == np.int32 and data.test_y.dtype == np.int64
    assert data.train_y.dtype == np.int64 and data.sample_shape == (3,)
    expected_y = data.train_label_sets[
        np.arange(3), np.random.default_rng(0).integers(0, [2, 1, 2])
    ]
    np.testing.assert_array_equal(data.train_y, expected_y)
    samples = {
        tuple(load_extreme_classification(str(tmp_path), seed).train_y) for seed in range(20)
    }
    assert len(samples) > 1  # the positive is sampled from the seed
    assert {y[0] for y in samples} == {0, 2} and {y[2] for y in samples} == {1, 3}


def test_loader_caps_features_per_point_keeping_the_highest_values(tmp_path):
    write(tmp_path / "train.txt", "1 9 2\n0 8:0.5 1:0.9 3:0.5 7:0.1 2:0.5\n")
    write(tmp_path / "test.txt", "1 9 2\n1 5:1\n")
    data = load_extreme_classification(str(tmp_path), 0, max_features_per_point=3)
    # 1:0.9 first; then the tie at 0.5 keeps the smaller ids 2 and 3; file order is kept.
    np.testing.assert_array_equal(data.train_x, [[1, 3, 2]])
    np.testing.assert_array_equal(data.test_x, [[5, 9, 9]])


def test_loader_max_test_points_is_a_fixed_subset(tmp_path):
    write(tmp_path / "train.txt", TINY)
    rows = "".join(f"{i % 5} {i % 6}:1\n" for i in range(40))
    write(tmp_path / "test.txt", f"40 6 5\n{rows}")
    first = load_extreme_classification(str(tmp_path), 0, max_test_points=10)
    second = load_extreme_classification(str(tmp_path), 7, max_test_points=10)
    assert first.test_x.shape == (10, 3)
    np.testing.assert_array_equal(first.test_x, second.test_x)  # independent of the run seed
    assert len(np.unique(first.test_x[:, 0])) > 1


def test_loader_small_dataset_split_form(tmp_path):
    write(tmp_path / "Data.txt", TINY)
    write(tmp_path / "trSplit.txt", "1 4\n4 1\n3 3\n")
    write(tmp_path / "tstSplit.txt", "2 5\n5 2\n")
    data = load_extreme_classification(str(tmp_path), 0, data_file="Data.txt", split=1)
    # split column 1: train rows 4, 1, 3; test rows 5, 2 (1-based)
    np.testing.assert_array_equal(data.train_label_sets, [[3, 1], [0, 2], [4, -1]])
    np.testing.assert_array_equal(data.train_x, [[2, 0, 4], [0, 3, 6], [6, 6, 6]])
    np.testing.assert_array_equal(data.test_y, [[-1], [-1]])
    np.testing.assert_array_equal(data.test_x, [[2, 6, 6], [1, 5, 6]])


def test_loader_split_file_errors_name_file_and_line(tmp_path):
    write(tmp_path / "Data.txt", TINY)
    write(tmp_path / "tstSplit.txt", "2\n5\n")
    write(tmp_path / "trSplit.txt", "1 4\n9 1\n")
    with pytest.raises(
        DataError, match=r"trSplit\.txt, line 2: '9' is not a row index in \[1, 5\]"
    ):
        load_extreme_classification(str(tmp_path), 0, data_file="Data.txt")
    write(tmp_path / "trSplit.txt", "1 4\n4 1\n")
    with pytest.raises(
        DataError, match=r"tstSplit\.txt, line 1: has 1 split column\(s\) but split 1"
    ):
        load_extreme_classification(str(tmp_path), 0, data_file="Data.txt", split=1)


def test_loader_errors(tmp_path):
    with pytest.raises(DataError, match=r"'data\.root' must be set .*train\.txt"):
        load_extreme_classification(None, 0)
    with pytest.raises(DataError, match=r"not found: .*train\.txt"):
        load_extreme_classification(str(tmp_path), 0)
    write(tmp_path / "train.txt", TINY)
    write(tmp_path / "test.txt", "1 7 5\n0 1:1\n")
    with pytest.raises(DataError, match=r"test\.txt, line 1: header says 7 features but 6"):
        load_extreme_classification(str(tmp_path), 0)
    with pytest.raises(ConfigError, match=r"'data\.split' must be >= 0"):
        load_extreme_classification(str(tmp_path), 0, split=-1)
    with pytest.raises(ConfigError, match=r"'data\.max_features_per_point' must be >= 1"):
        load_extreme_classification(str(tmp_path), 0, max_features_per_point=0)
    with pytest.raises(ConfigError, match=r"'data\.train_file' must be a file name"):
        load_extreme_classification(str(tmp_path), 0, train_file="")


def test_registered_with_options():
    assert "split" in registry.datasets.option_names("extreme_classification")
    with pytest.raises(ConfigError, match=r"unknown option 'data\.splits'.*did you mean 'split'"):
        registry.datasets.check_options("extreme_classification", {"splits": 1}, "data")
    assert "zipf_exponent" in registry.datasets.option_names("synthetic_xml")


# --- synthetic XML ------------------------------------------------------------------------------

SMALL = {"num_labels": 200, "num_features": 1000, "num_train": 3000, "num_test": 500}


@pytest.fixture(scope="module")
def small():
    return load_synthetic_xml(None, 5, **SMALL)


def test_synthetic_is_deterministic(small):
    again = load_synthetic_xml(None, 5, **SMALL)
    for field in ("train_x", "train_y", "test_x", "test_y", "train_label_sets"):
        np.testing.assert_array_equal(getattr(small, field), getattr(again, field))
    other = load_synthetic_xml(None, 6, **SMALL)
    assert not np.array_equal(small.train_label_sets, other.train_label_sets)


def test_synthetic_shapes_and_statistics(small):
    data = small
    assert data.name == "synthetic_xml" and data.num_classes == 200 and data.num_features == 1000
    assert data.train_x.dtype == np.int32 and data.train_x.shape[0] == 3000
    assert data.test_x.shape == (500, data.train_x.shape[1])
    assert data.train_x.min() >= 0 and data.train_x.max() == 1000  # 1000 = padding
    features = (data.train_x < 1000).sum(axis=1)
    assert 50 < features.mean() < 75 and features.min() > 10
    sets = data.train_label_sets
    counts = (sets >= 0).sum(axis=1)
    assert counts.min() >= 1 and abs(counts.mean() - 5.45) < 0.3
    assert abs((data.test_y >= 0).sum(axis=1).mean() - 5.45) < 0.5
    for row in sets[:50]:  # sorted distinct labels, then -1 padding
        labels = row[row >= 0]
        assert np.all(np.diff(labels) > 0) and np.all(row[len(labels) :] == -1)
    assert np.all((sets == data.train_y[:, None]).any(axis=1))  # the positive is a true label
    frequency = np.bincount(sets[sets >= 0], minlength=200)
    assert frequency.min() >= 1  # every label appears in training
    assert frequency.max() >= 5 * np.median(frequency)  # Zipf-like: a heavy head


def test_synthetic_scale_sets_the_sizes():
    data = load_synthetic_xml(None, 0, scale=0.002)
    assert data.num_classes == round(670_091 * 0.002)
    assert (len(data.train_y), len(data.test_y)) == (round(490_449 * 0.002), 306)
    assert data.num_features == 1000  # never below 1,000
    frequency = np.bincount(data.train_label_sets[data.train_label_sets >= 0])
    assert len(frequency) == data.num_classes and frequency.min() >= 1  # 1,340 labels, 981 points


def test_synthetic_is_learnable(small):
    """Nearest class centroid of bag-of-feature vectors: far above the frequency baseline."""
    data = small

    def bags(x: np.ndarray) -> np.ndarray:
        dense = np.zeros((len(x), data.num_features + 1), dtype=np.float32)
        np.put_along_axis(dense, x.astype(np.int64), 1.0, axis=1)
        dense = dense[:, : data.num_features]
        return dense / np.linalg.norm(dense, axis=1, keepdims=True)

    train, test = bags(data.train_x), bags(data.test_x)
    centroids = np.zeros((data.num_classes, data.num_features), dtype=np.float32)
    np.add.at(centroids, data.train_y, train)
    centroids /= np.maximum(np.linalg.norm(centroids, axis=1, keepdims=True), 1e-12)
    predicted = np.argmax(test @ centroids.T, axis=1)
    precision_at_1 = (data.test_y == predicted[:, None]).any(axis=1).mean()
    most_frequent = np.bincount(data.train_y).argmax()
    baseline = (data.test_y == most_frequent).any(axis=1).mean()
    assert baseline < 0.25 and precision_at_1 > 0.8, (precision_at_1, baseline)


def test_synthetic_option_errors():
    with pytest.raises(ConfigError, match=r"'data\.scale' must be a finite number > 0"):
        load_synthetic_xml(None, 0, scale=0)
    with pytest.raises(ConfigError, match=r"'data\.cross_cluster_probability' must be in \[0, 1\]"):
        load_synthetic_xml(None, 0, cross_cluster_probability=1.5)
    with pytest.raises(ConfigError, match=r"'data\.num_labels' must be >= 2"):
        load_synthetic_xml(None, 0, num_labels=1)
    with pytest.raises(ConfigError, match=r"'data\.num_clusters'=1 puts 5000 labels in a cluster"):
        load_synthetic_xml(None, 0, num_labels=5000, num_clusters=1, num_train=10, num_test=1)
