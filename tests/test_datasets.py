"""Dataset loaders, fed tiny files written here in the real on-disk formats."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from raysim.data.cifar import load_cifar10, load_cifar100
from raysim.data.embedded import load_digits, load_synthetic_classification
from raysim.data.femnist import load_femnist
from raysim.data.idx import load_mnist
from raysim.errors import ConfigError, DataError

# --- digits -------------------------------------------------------------------------------------


def test_digits_shapes_and_standardisation():
    data = load_digits(None, 0)
    assert data.train_x.shape == (1347, 64) and data.test_x.shape == (450, 64)
    assert data.train_x.dtype == np.float32 and data.train_x.flags.c_contiguous
    assert data.train_y.dtype == np.int64 and data.num_classes == 10
    assert data.sample_shape == (64,) and data.train_groups is None
    np.testing.assert_allclose(data.train_x.mean(axis=0), 0.0, atol=1e-5)
    std = data.train_x.std(axis=0)
    assert np.all((np.abs(std - 1) < 1e-4) | (std == 0))  # constant pixels stay 0, not NaN
    assert np.isfinite(data.test_x).all()
    assert np.bincount(data.test_y).min() >= 40  # stratified


def test_digits_split_is_fixed_across_seeds():
    first, second = load_digits(None, 0), load_digits(None, 99)
    np.testing.assert_array_equal(first.test_x, second.test_x)
    np.testing.assert_array_equal(first.train_y, second.train_y)
    assert load_digits(None, 0, test_fraction=0.5).test_x.shape == (899, 64)
    with pytest.raises(ConfigError, match=r"data\.test_fraction"):
        load_digits(None, 0, test_fraction=1.5)


# --- synthetic ----------------------------------------------------------------------------------


def test_synthetic_shape_and_determinism():
    data = load_synthetic_classification(
        None, 3, num_samples=300, num_test=50, num_classes=5, sample_shape=[1, 28, 28]
    )
    assert data.train_x.shape == (300, 1, 28, 28) and data.test_x.shape == (50, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and data.train_y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(data.train_y), [60] * 5)
    again = load_synthetic_classification(
        None, 3, num_samples=300, num_test=50, num_classes=5, sample_shape=[1, 28, 28]
    )
    np.testing.assert_array_equal(data.train_x, again.train_x)
    np.testing.assert_array_equal(data.test_y, again.test_y)
    other = load_synthetic_classification(
        None, 4, num_samples=300, num_test=50, num_classes=5, sample_shape=[1, 28, 28]
    )
    assert not np.array_equal(data.train_x, other.train_x)


def test_synthetic_is_learnable():
    from sklearn.linear_model import LogisticRegression

    data = load_synthetic_classification(None, 0, num_samples=2000, num_test=500, sample_shape=(8,))
    model = LogisticRegression(max_iter=500).fit(data.train_x, data.train_y)
    assert model.score(data.test_x, data.test_y) > 0.6  # chance is 0.1


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"sample_shape": [0, 3]}, "sample_shape"),
        ({"sample_shape": "32"}, "sample_shape"),
        ({"num_classes": 1}, "num_classes"),
        ({"num_samples": 2.5}, "num_samples"),
        ({"noise": -1.0}, "noise"),
    ],
)
def test_synthetic_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=rf"data\.{key}"):
        load_synthetic_classification(None, 0, **options)


# --- MNIST --------------------------------------------------------------------------------------


def _write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


def _write_mnist(root: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8)
    images[0, 0, 0], images[0, 0, 1] = 0, 255
    labels = np.array([3, 1, 4, 1, 5], dtype=np.uint8)
    _write_idx(raw / "train-images-idx3-ubyte", images)
    _write_idx(raw / "train-labels-idx1-ubyte", labels)
    _write_idx(raw / "t10k-images-idx3-ubyte", images[:2], compress=True)
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels[:2], compress=True)
    return images, labels


def test_mnist_reads_idx_files(tmp_path):
    images, labels = _write_mnist(tmp_path)
    data = load_mnist(str(tmp_path), 0)
    assert data.train_x.shape == (5, 1, 28, 28) and data.test_x.shape == (2, 1, 28, 28)
    assert data.train_x.dtype == np.float32 and data.num_classes == 10
    np.testing.assert_array_equal(data.train_y, labels)
    np.testing.assert_array_equal(data.test_y, labels[:2])
    assert data.train_x[0, 0, 0, 0] == pytest.approx((0 - 0.1307) / 0.3081, rel=1e-5)
    assert data.train_x[0, 0, 0, 1] == pytest.approx((1 - 0.1307) / 0.3081, rel=1e-5)
    np.testing.assert_allclose(data.test_x, data.train_x[:2])


def test_mnist_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match=r"'data\.root' must be set for dataset 'mnist'"):
        load_mnist(None, 0)
    with pytest.raises(DataError, match="not a directory"):
        load_mnist(str(tmp_path / "nowhere"), 0)
    expected = os.path.join(str(tmp_path), "MNIST", "raw", "train-images-idx3-ubyte")
    with pytest.raises(DataError, match=rf"{re.escape(expected)}.*download=True"):
        load_mnist(str(tmp_path), 0)
    _write_mnist(tmp_path)
    path = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}.*truncated"):
        load_mnist(str(tmp_path), 0)


# --- CIFAR --------------------------------------------------------------------------------------


def _cifar_batch(rng: np.random.Generator, n: int, label_key: bytes, classes: int) -> dict:
    return {
        b"batch_label": b"testing batch",
        label_key: rng.integers(0, classes, size=n).tolist(),
        b"data": rng.integers(0, 256, size=(n, 3072), dtype=np.uint8),
        b"filenames": [f"img_{i}.png".encode() for i in range(n)],
    }


def _dump(path: Path, content: object) -> None:
    with open(path, "wb") as handle:
        pickle.dump(content, handle, protocol=2)


def test_cifar10_reads_python_batches(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    batches = [_cifar_batch(rng, 3, b"labels", 10) for _ in range(6)]
    for i, batch in enumerate(batches[:5], start=1):
        _dump(folder / f"data_batch_{i}", batch)
    _dump(folder / "test_batch", batches[5])
    data = load_cifar10(str(tmp_path), 0)
    assert data.train_x.shape == (15, 3, 32, 32) and data.test_x.shape == (3, 3, 32, 32)
    assert data.train_x.dtype == np.float32 and data.num_classes == 10
    np.testing.assert_array_equal(data.train_y, sum((b[b"labels"] for b in batches[:5]), []))
    pixels = batches[0][b"data"][0].reshape(3, 32, 32)  # channel-major rows, as in CIFAR
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2470, 0.2435, 0.2616])
    want = (pixels / 255.0 - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(data.train_x[0], want, rtol=1e-5, atol=1e-5)


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(1)
    train = _cifar_batch(rng, 4, b"fine_labels", 100) | {b"coarse_labels": [0, 1, 2, 3]}
    test = _cifar_batch(rng, 2, b"fine_labels", 100) | {b"coarse_labels": [0, 1]}
    _dump(folder / "train", train)
    _dump(folder / "test", test)
    data = load_cifar100(str(tmp_path), 0)
    assert data.train_x.shape == (4, 3, 32, 32) and data.num_classes == 100
    np.testing.assert_array_equal(data.train_y, train[b"fine_labels"])
    np.testing.assert_array_equal(data.test_y, test[b"fine_labels"])


def _python2_batch(data: np.ndarray, labels: list[int]) -> bytes:
    """A batch as the original CIFAR files hold it: cPickle protocol 2 from Python 2 (str = bytes,
    numpy.core module names)."""

    def string(raw: bytes) -> bytes:  # SHORT_BINSTRING / BINSTRING
        return (
            b"U" + bytes([len(raw)]) + raw
            if len(raw) < 256
            else b"T" + struct.pack("<i", len(raw)) + raw
        )

    shape = b"M" + struct.pack("<H", data.shape[0]) + b"M" + struct.pack("<H", 3072) + b"\x86"
    return (
        b"\x80\x02}q\x00("
        + string(b"data")
        + b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01b\x87R"
        + b"(K\x01"
        + shape
        + b"cnumpy\ndtype\n"
        + string(b"u1")
        + b"\x89\x88\x87R"
        + b"(K\x03"
        + string(b"|")
        + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
        + b"\x89"
        + string(data.tobytes())
        + b"tb"
        + string(b"labels")
        + b"]("
        + b"".join(b"K" + bytes([label]) for label in labels)
        + b"e"
        + b"u."
    )


def test_cifar10_reads_python2_pickles(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, size=(2, 3072), dtype=np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(_python2_batch(data, [3, 7]))
    loaded = load_cifar10(str(tmp_path), 0)
    assert loaded.train_x.shape == (10, 3, 32, 32)
    np.testing.assert_array_equal(loaded.test_y, [3, 7])
    pixel = data[1, 1024] / 255.0  # green channel, first pixel
    assert loaded.test_x[1, 1, 0, 0] == pytest.approx((pixel - 0.4822) / 0.2435, rel=1e-5)


class _Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_cifar_refuses_a_pickle_that_runs_code(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    marker = tmp_path / "pwned"
    batch = _cifar_batch(np.random.default_rng(0), 2, b"fine_labels", 100)
    _dump(folder / "train", batch | {b"filenames": _Exploit(str(marker))})
    _dump(folder / "test", batch)
    with pytest.raises(DataError, match=r"refusing to load .*train: it references .*system"):
        load_cifar100(str(tmp_path), 0)
    assert not marker.exists()


def test_cifar_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"'data\.root' must be set for dataset 'cifar10'"):
        load_cifar10(None, 0)
    missing = os.path.join(str(tmp_path), "cifar-10-batches-py", "data_batch_1")
    with pytest.raises(DataError, match=rf"{re.escape(missing)}.*CIFAR10\(.*download=True"):
        load_cifar10(str(tmp_path), 0)
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    batch = _cifar_batch(np.random.default_rng(0), 2, b"fine_labels", 100)
    _dump(folder / "train", batch)
    (folder / "test").write_bytes((folder / "train").read_bytes()[:100])
    with pytest.raises(DataError, match=r"test is not a readable CIFAR python batch"):
        load_cifar100(str(tmp_path), 0)
    _dump(folder / "test", {b"data": batch[b"data"]})
    with pytest.raises(DataError, match=r"test: missing key b'fine_labels'"):
        load_cifar100(str(tmp_path), 0)
    _dump(folder / "test", batch | {b"fine_labels": [0, 100]})
    with pytest.raises(DataError, match=r"test: label 100 is out of range \[0, 100\)"):
        load_cifar100(str(tmp_path), 0)


# --- FEMNIST ------------------------------------------------------------------------------------


def _leaf_user(rng: np.random.Generator, n: int) -> dict:
    return {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}


def _leaf_file(users: dict[str, dict]) -> dict:
    return {
        "users": list(users),
        "num_samples": [len(u["y"]) for u in users.values()],
        "user_data": users,
    }


def _write_leaf(root: Path) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    train = {"f_b": _leaf_user(rng, 3), "f_a": _leaf_user(rng, 2), "f_c": _leaf_user(rng, 4)}
    test = {name: _leaf_user(rng, 1) for name in train}
    for split, users in (("train", train), ("test", test)):
        (root / split).mkdir(parents=True)
        first = {k: users[k] for k in ("f_b", "f_a")}
        (root / split / f"all_0_{split}.json").write_text(json.dumps(_leaf_file(first)))
        (root / split / f"all_1_{split}.json").write_text(
            json.dumps(_leaf_file({"f_c": users["f_c"]}))
        )
    return train


def test_femnist_reads_leaf_json_with_writers(tmp_path):
    train = _write_leaf(tmp_path / "data")
    for root in (tmp_path / "data", tmp_path):  # LEAF's data/ folder or its parent
        data = load_femnist(str(root), 0)
        assert data.train_x.shape == (9, 1, 28, 28) and data.test_x.shape == (3, 1, 28, 28)
        assert data.num_classes == 62 and data.train_x.dtype == np.float32
        np.testing.assert_array_equal(data.train_groups, [0, 0, 0, 1, 1, 2, 2, 2, 2])
        want_y = train["f_b"]["y"] + train["f_a"]["y"] + train["f_c"]["y"]
        np.testing.assert_array_equal(data.train_y, want_y)
        np.testing.assert_allclose(
            data.train_x[3].ravel(), np.asarray(train["f_a"]["x"][0], np.float32)
        )
    limited = load_femnist(str(tmp_path), 0, max_writers=2)
    np.testing.assert_array_equal(limited.train_groups, [0, 0, 0, 1, 1])
    assert limited.test_x.shape == (2, 1, 28, 28)


def _corrupt(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def test_femnist_malformed_files_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"'data\.root' must be set for dataset 'femnist'"):
        load_femnist(None, 0)
    with pytest.raises(DataError, match=r"folder not found: .*train"):
        load_femnist(str(tmp_path), 0)
    _write_leaf(tmp_path)
    path = tmp_path / "train" / "all_1_train.json"
    good = path.read_text()

    path.write_text(good[:-5])
    with pytest.raises(
        DataError, match=rf"{re.escape(str(path))}: invalid JSON at line 1, column \d+"
    ):
        load_femnist(str(tmp_path), 0)

    path.write_text(good)
    _corrupt(path, lambda c: c.pop("user_data"))
    with pytest.raises(DataError, match=rf"{re.escape(str(path))}: missing key 'user_data'"):
        load_femnist(str(tmp_path), 0)

    path.write_text(good)
    _corrupt(path, lambda c: c["user_data"]["f_c"]["x"][1].pop())
    with pytest.raises(
        DataError, match=rf"{re.escape(str(path))}: .*'f_c'.*x\[1\] has length 783, expected 784"
    ):
        load_femnist(str(tmp_path), 0)

    path.write_text(good)
    _corrupt(path, lambda c: c["user_data"]["f_c"]["y"].pop())
    with pytest.raises(
        DataError, match=rf"{re.escape(str(path))}: .*len\(x\) = 4 but len\(y\) = 3"
    ):
        load_femnist(str(tmp_path), 0)

    path.write_text(good)
    _corrupt(path, lambda c: c["user_data"]["f_c"]["y"].__setitem__(2, 62))
    with pytest.raises(
        DataError, match=rf"{re.escape(str(path))}: .*y\[2\] = 62 is out of range \[0, 62\)"
    ):
        load_femnist(str(tmp_path), 0)

    with pytest.raises(ConfigError, match=r"data\.max_writers"):
        load_femnist(str(tmp_path), 0, max_writers=0)
