"""Dataset loaders: embedded defaults that need no download, and readers of files users have.

Every loader returns a `Dataset` of plain numpy arrays (float32 features, int64 labels), because
the engine puts those arrays in the Ray object store once per run and clients slice them by index.
No loader ever downloads anything: real datasets are read from `data.root` in the layout their
usual tool writes (torchvision, LEAF), and a missing or malformed file is a `DataError` that names
the file and says how to obtain or fix it.

Loader signature: `load_<name>(root, seed, *, options)`. The keyword-only options are the keys a
config may set under `data:` (see `raysim.registry`).
"""

from __future__ import annotations

import glob
import gzip
import json
import math
import operator
import os
import pickle
import stat
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.data import torchvision_adapter as tv
from raysim.errors import ConfigError, DataError


@dataclass(frozen=True)
class Dataset:
    """Train/test arrays of one dataset, ready to be shared read-only by every client."""

    name: str
    train_x: np.ndarray  # float32, C-contiguous, shape (n_train, *sample_shape)
    train_y: np.ndarray  # int64, shape (n_train,)
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    # int64 (n_train,): natural client (e.g. FEMNIST writer) of each train sample; None if none.
    train_groups: np.ndarray | None = None
    # Sparse bag-of-words inputs (Extreme Classification data): train_x/test_x are int32
    # (n, max_features_per_point) feature ids padded with `num_features` (an id no feature
    # has), and the model embeds ids 0..num_features-1. None for dense inputs.
    num_features: int | None = None
    # Multi-label sources with many labels (XML): every true label of each train point, int64
    # (n_train, max_labels) padded with -1, while train_y holds the one positive sampled per
    # point (FedAwS's multi-label -> multi-class step). test_y then has the same padded form.
    train_label_sets: np.ndarray | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. (1, 28, 28); what a model factory needs to size its input."""
        return tuple(self.train_x.shape[1:])


# --- option checks ------------------------------------------------------------------------------


def _int_option(key: str, value: Any, minimum: int) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"'data.{key}' must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"'data.{key}' must be >= {minimum}, got {number}")
    return number


def _float_option(key: str, value: Any, *, minimum: float, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.number):
        raise ConfigError(f"'data.{key}' must be a number, got {value!r}")
    number = float(value)
    if not np.isfinite(number) or number < minimum or (strict and number == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise ConfigError(f"'data.{key}' must be a finite number {bound}, got {value!r}")
    return number


def _shape_option(key: str, value: Any) -> tuple[int, ...]:
    values = (
        [value] if isinstance(value, int | np.integer) and not isinstance(value, bool) else value
    )
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) == 0:
        raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
    shape = []
    for item in values:
        if isinstance(item, bool) or not isinstance(item, int | np.integer) or item < 1:
            raise ConfigError(f"'data.{key}' must be a list of positive integers, got {value!r}")
        shape.append(int(item))
    return tuple(shape)


def _how_to_obtain(name: str, root: str) -> str:
    return _FEMNIST_HOW if name == "femnist" else tv.how_to_obtain(name, root)


def _require_root(root: str | None, name: str, expected: str) -> str:
    if root is None:
        raise DataError(
            f"'data.root' must be set for dataset '{name}' (the folder containing {expected}); "
            f"{_how_to_obtain(name, '<data.root>')}"
        )
    if not os.path.isdir(root):
        raise DataError(
            f"dataset '{name}': data.root {root!r} is not a directory (expected a "
            f"folder containing {expected}); {_how_to_obtain(name, root)}"
        )
    return root


def _normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 NCHW -> float32 scaled to [0, 1] then standardised per channel, without float64."""
    x = images.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    channel_shape = (1, len(mean)) + (1,) * (x.ndim - 2)
    x -= np.asarray(mean, dtype=np.float32).reshape(channel_shape)
    x /= np.asarray(std, dtype=np.float32).reshape(channel_shape)
    return np.ascontiguousarray(x)


# --- embedded defaults --------------------------------------------------------------------------


def load_digits(root: str | None, seed: int, *, test_fraction: float = 0.25) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1,797 samples): a real dataset that needs no download.

    The train/test split is fixed (random_state=0, not `seed`) so every run, whatever its seed,
    is evaluated on the same test set and results are comparable.
    """
    from sklearn.datasets import load_digits as sklearn_load_digits
    from sklearn.model_selection import train_test_split

    del root, seed  # bundled data; the split is deliberately independent of the run seed
    fraction = _float_option("test_fraction", test_fraction, minimum=0.0, strict=True)
    if fraction >= 1.0:
        raise ConfigError(f"'data.test_fraction' must be in (0, 1), got {test_fraction!r}")
    bunch = sklearn_load_digits()
    x = bunch.data.astype(np.float64)
    y = bunch.target.astype(np.int64)
    try:
        train_x, test_x, train_y, test_y = train_test_split(
            x, y, test_size=fraction, stratify=y, random_state=0
        )
    except ValueError as error:
        raise ConfigError(
            f"'data.test_fraction'={test_fraction!r} is too extreme for the 1,797 digits ({error})"
        ) from None
    mean = train_x.mean(axis=0)
    std = train_x.std(axis=0)
    std[std == 0] = 1.0  # constant border pixels: centre them, do not divide by zero
    return Dataset(
        name="digits",
        train_x=np.ascontiguousarray((train_x - mean) / std, dtype=np.float32),
        train_y=np.ascontiguousarray(train_y, dtype=np.int64),
        test_x=np.ascontiguousarray((test_x - mean) / std, dtype=np.float32),
        test_y=np.ascontiguousarray(test_y, dtype=np.int64),
        num_classes=10,
    )


def load_synthetic_classification(
    root: str | None,
    seed: int,
    *,
    num_samples: int = 10000,
    num_test: int = 2000,
    num_classes: int = 10,
    sample_shape: Sequence[int] = (32,),
    class_separation: float = 1.0,
    noise: float = 1.0,
) -> Dataset:
    """Learnable synthetic data of any size and sample shape, drawn from `seed`.

    Each class has a mean pattern (every coordinate ~ N(0, class_separation^2)); a sample is its
    class's pattern plus N(0, noise^2) noise. Labels are balanced. Everything is generated in
    float32 and in place, so 4,000,000 x 16 samples cost 256 MB and no float64 copy.
    """
    del root
    num_samples = _int_option("num_samples", num_samples, 1)
    num_test = _int_option("num_test", num_test, 1)
    num_classes = _int_option("num_classes", num_classes, 2)
    shape = _shape_option("sample_shape", sample_shape)
    class_separation = _float_option("class_separation", class_separation, minimum=0.0)
    noise = _float_option("noise", noise, minimum=0.0)

    rng = np.random.default_rng(seed)
    patterns = rng.standard_normal((num_classes, *shape), dtype=np.float32)
    patterns *= np.float32(class_separation)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.arange(count, dtype=np.int64) % num_classes
        rng.shuffle(labels)
        x = rng.standard_normal((count, *shape), dtype=np.float32)
        x *= np.float32(noise)
        chunk = max(1, (1 << 22) // max(1, int(np.prod(shape))))  # ~16 MB of patterns at a time
        for start in range(0, count, chunk):
            x[start : start + chunk] += patterns[labels[start : start + chunk]]
        return x, labels

    train_x, train_y = draw(num_samples)
    test_x, test_y = draw(num_test)
    return Dataset("synthetic_classification", train_x, train_y, test_x, test_y, num_classes)


# --- MNIST (torchvision layout, idx files) ------------------------------------------------------


def _find_file(directory: str, filename: str, name: str, root: str) -> str:
    for candidate in (filename, filename + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.isfile(path):
            return path
    raise DataError(
        f"dataset '{name}': file not found: {os.path.join(directory, filename)} (or .gz); "
        f"{tv.how_to_obtain(name, root)}"
    )


# deflate cannot expand data more than ~1032x; a .gz whose header promises more is a lie
_GZIP_MAX_RATIO = 1100


def _read_idx(path: str, expected_dims: int) -> np.ndarray:
    """Read an idx file (the MNIST format: big-endian header, then unsigned bytes).

    The header is checked before the data is read, and the data size it promises against the
    file (or, for .gz, what its compressed size can hold), so a hostile or broken file costs
    at most the memory its true contents need."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise DataError(f"{path} is not a regular file")
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as handle:
            head = handle.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0:
                raise DataError(
                    f"{path} is not an idx file (bad magic number; truncated or corrupted?)"
                )
            if head[2] != 0x08:
                raise DataError(
                    f"{path}: idx data type 0x{head[2]:02x} is not unsigned byte (0x08)"
                )
            dims = head[3]
            if dims != expected_dims:
                raise DataError(f"{path}: idx file has {dims} dimensions, expected {expected_dims}")
            sizes = handle.read(4 * dims)
            if len(sizes) < 4 * dims:
                raise DataError(f"{path}: truncated idx header")
            shape = tuple(int.from_bytes(sizes[4 * i : 4 * i + 4], "big") for i in range(dims))
            payload = math.prod(shape)  # exact: np.prod would wrap around for huge shapes
            header = 4 + 4 * dims
            limit = info.st_size * _GZIP_MAX_RATIO if path.endswith(".gz") else info.st_size
            if header + payload > limit:
                raise DataError(
                    f"{path}: idx header says shape {shape} ({header + payload} bytes in all) "
                    f"but the file has {info.st_size} bytes (truncated or corrupted?)"
                )
            raw = handle.read(payload + 1)  # one more: a longer file is caught too
    except (OSError, EOFError, zlib.error) as error:  # zlib.error: a corrupted .gz stream
        raise DataError(f"cannot read {path}: {error} (truncated or corrupted?)") from None
    if len(raw) != payload:
        size = header + len(raw) if len(raw) <= payload else "more than that"
        raise DataError(
            f"{path}: idx header says shape {shape} ({header + payload} bytes in all) but the "
            f"file has {size} bytes (truncated or corrupted?)"
        )
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def _load_mnist_split(directory: str, split: str, root: str) -> tuple[np.ndarray, np.ndarray]:
    image_name, label_name = tv.MNIST_FILES[split]
    image_path = _find_file(directory, image_name, "mnist", root)
    label_path = _find_file(directory, label_name, "mnist", root)
    images = _read_idx(image_path, 3)
    labels = _read_idx(label_path, 1).astype(np.int64)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{image_path}: images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(
            f"{image_path} has {len(images)} images but {label_path} has {len(labels)} labels"
        )
    if len(labels) and labels.max() > 9:
        raise DataError(f"{label_path}: label {labels.max()} is out of range [0, 10)")
    x = _normalise(images[:, None, :, :], tv.MNIST_MEAN, tv.MNIST_STD)
    return x, labels


def load_mnist(root: str | None, seed: int) -> Dataset:
    """MNIST from `root/MNIST/raw/*-ubyte[.gz]` (torchvision's layout), NCHW (1, 28, 28)."""
    del seed
    root = _require_root(root, "mnist", tv.MNIST_RAW_DIR)
    directory = os.path.join(root, tv.MNIST_RAW_DIR)
    train_x, train_y = _load_mnist_split(directory, "train", root)
    test_x, test_y = _load_mnist_split(directory, "test", root)
    return Dataset("mnist", train_x, train_y, test_x, test_y, num_classes=10)


# --- CIFAR (torchvision layout, python pickle batches) ------------------------------------------

# What a CIFAR python batch may reference: containers, bytes, and numpy array reconstruction.
# Python 2 module names ('__builtin__', 'copy_reg') appear in the original files.
_ALLOWED_GLOBALS = {
    ("builtins", "dict"),
    ("builtins", "list"),
    ("builtins", "bytes"),
    ("builtins", "str"),
    ("__builtin__", "dict"),
    ("__builtin__", "list"),
    ("__builtin__", "bytes"),
    ("__builtin__", "str"),
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickler that can build dicts, lists, bytes and numpy arrays - and nothing else.

    A pickle can run arbitrary code when loaded; a CIFAR batch only needs these few globals, so
    anything else (e.g. os.system) means the file is not what it claims and is refused.
    """

    def __init__(self, file: Any, path: str) -> None:
        super().__init__(file, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise DataError(
                f"refusing to load {self.path}: it references {module}.{name}, which a CIFAR "
                f"batch never contains (only dict, list, bytes, str and numpy arrays are allowed)"
            )
        return super().find_class(module, name)


def _read_cifar_batch(path: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    try:
        with open(path, "rb") as handle:
            batch = _RestrictedUnpickler(handle, path).load()
    except DataError:
        raise
    except OSError as error:
        raise DataError(f"cannot read {path}: {error}") from None
    except Exception as error:  # any unpickling failure means a truncated or foreign file
        raise DataError(
            f"{path} is not a readable CIFAR python batch (truncated or corrupted?): "
            f"{type(error).__name__}: {error}"
        ) from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: expected a pickled dict, got {type(batch).__name__}")
    batch = {
        key.decode("latin1") if isinstance(key, bytes) else key: value
        for key, value in batch.items()
    }
    for key in ("data", label_key):
        if key not in batch:
            raise DataError(f"{path}: missing key b'{key}' (found {sorted(map(str, batch))})")
    data = batch["data"]
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3 * 32 * 32
    ):
        description = (
            f"{data.dtype} array of shape {data.shape}"
            if isinstance(data, np.ndarray)
            else type(data).__name__
        )
        raise DataError(
            f"{path}: b'data' must be a uint8 array of shape (n, 3072), got {description}"
        )
    labels = batch[label_key]
    if isinstance(labels, np.ndarray) and labels.dtype.kind in "iu":
        labels = labels.tolist()
    if not isinstance(labels, list) or not all(
        isinstance(label, int) and not isinstance(label, bool) for label in labels
    ):
        raise DataError(f"{path}: b'{label_key}' must be a list of integers")
    for label in labels:  # before the int64 conversion, which would overflow on huge values
        if not 0 <= label < num_classes:
            raise DataError(f"{path}: label {label} is out of range [0, {num_classes})")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.shape != (len(data),):
        raise DataError(f"{path}: {len(data)} images but b'{label_key}' has shape {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _load_cifar(
    root: str | None,
    name: str,
    folder: str,
    files: tuple[tuple[str, ...], ...],
    label_key: str,
    num_classes: int,
    mean: Sequence[float],
    std: Sequence[float],
) -> Dataset:
    root = _require_root(root, name, folder + "/")
    directory = os.path.join(root, folder)
    arrays = []
    for split_files in files:
        images, labels = [], []
        for filename in split_files:
            path = os.path.join(directory, filename)
            if not os.path.isfile(path):
                raise DataError(
                    f"dataset '{name}': file not found: {path}; {tv.how_to_obtain(name, root)}"
                )
            batch_images, batch_labels = _read_cifar_batch(path, label_key, num_classes)
            images.append(batch_images)
            labels.append(batch_labels)
        arrays.append((_normalise(np.concatenate(images), mean, std), np.concatenate(labels)))
    (train_x, train_y), (test_x, test_y) = arrays
    return Dataset(name, train_x, train_y, test_x, test_y, num_classes)


def load_cifar10(root: str | None, seed: int) -> Dataset:
    """CIFAR-10 from `root/cifar-10-batches-py/` (torchvision's layout), NCHW (3, 32, 32)."""
    del seed
    return _load_cifar(
        root,
        "cifar10",
        tv.CIFAR10_DIR,
        (tv.CIFAR10_TRAIN_FILES, tv.CIFAR10_TEST_FILES),
        "labels",
        10,
        tv.CIFAR10_MEAN,
        tv.CIFAR10_STD,
    )


def load_cifar100(root: str | None, seed: int) -> Dataset:
    """CIFAR-100 (fine labels) from `root/cifar-100-python/` (torchvision's layout)."""
    del seed
    return _load_cifar(
        root,
        "cifar100",
        tv.CIFAR100_DIR,
        (tv.CIFAR100_TRAIN_FILES, tv.CIFAR100_TEST_FILES),
        "fine_labels",
        100,
        tv.CIFAR100_MEAN,
        tv.CIFAR100_STD,
    )


# --- FEMNIST (LEAF json) ------------------------------------------------------------------------

FEMNIST_CLASSES = 62
_FEMNIST_HOW = (
    "generate it with LEAF (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) "
    "on a machine with internet access and copy its data/ folder"
)


def _femnist_files(root: str, split: str) -> list[str]:
    for directory in (os.path.join(root, split), os.path.join(root, "data", split)):
        if os.path.isdir(directory):
            files = sorted(glob.glob(os.path.join(directory, "*.json")))
            if not files:
                raise DataError(
                    f"dataset 'femnist': no *.json files in {directory}; {_FEMNIST_HOW}"
                )
            return files
    raise DataError(
        f"dataset 'femnist': folder not found: {os.path.join(root, split)} (nor "
        f"{os.path.join(root, 'data', split)}); expected LEAF json files in "
        f"<data.root>/train/*.json and <data.root>/test/*.json; {_FEMNIST_HOW}"
    )


def read_json_file(path: str, kind: str) -> Any:
    """A JSON data file, every failure one DataError naming the file (and line, if known)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {kind} {path}: {error}") from None
    except (ValueError, RecursionError) as error:  # an over-long integer; absurd nesting
        raise DataError(f"{path}: not a {kind} file: {error}") from None


def _read_leaf_file(path: str) -> tuple[list[str], dict]:
    content = read_json_file(path, "LEAF json")
    if not isinstance(content, dict):
        raise DataError(f"{path}: expected a JSON object with keys 'users' and 'user_data'")
    for key in ("users", "user_data"):
        if key not in content:
            raise DataError(
                f"{path}: missing key '{key}' (a LEAF file has 'users', "
                f"'num_samples' and 'user_data')"
            )
    users, user_data = content["users"], content["user_data"]
    if not isinstance(users, list) or not isinstance(user_data, dict):
        raise DataError(f"{path}: 'users' must be a list and 'user_data' an object")
    return [str(user) for user in users], user_data


def _leaf_user_arrays(path: str, user: str, user_data: dict) -> tuple[np.ndarray, np.ndarray]:
    where = f"{path}: user_data[{user!r}]"
    record = user_data.get(user)
    if not isinstance(record, dict):
        raise DataError(f"{where} is missing (user listed in 'users' has no data)")
    for key in ("x", "y"):
        if not isinstance(record.get(key), list):
            raise DataError(f"{where}: missing list '{key}'")
    x_rows, y_values = record["x"], record["y"]
    if len(x_rows) != len(y_values):
        raise DataError(f"{where}: len(x) = {len(x_rows)} but len(y) = {len(y_values)}")
    for row_number, row in enumerate(x_rows):
        if not isinstance(row, list) or len(row) != 784:
            length = len(row) if isinstance(row, list) else type(row).__name__
            raise DataError(
                f"{where}: x[{row_number}] has length {length}, expected 784 "
                f"(a flattened 28x28 image)"
            )
    try:
        # Without a dtype first: strings, booleans and None must not be converted silently.
        pixels = np.asarray(x_rows) if x_rows else np.zeros((0, 784), dtype=np.float32)
    except (TypeError, ValueError, OverflowError):
        raise DataError(f"{where}: x must contain only numbers") from None
    if pixels.dtype.kind not in "fiu":
        raise DataError(f"{where}: x must contain only numbers")
    with np.errstate(over="ignore"):
        x = pixels.astype(np.float32).reshape(-1, 1, 28, 28)
    if not np.isfinite(x).all():
        raise DataError(f"{where}: x must contain only finite numbers (float32 range)")
    for index, label in enumerate(y_values):
        if isinstance(label, bool) or not isinstance(label, int):
            raise DataError(f"{where}: y must contain only integer labels")
        if not 0 <= label < FEMNIST_CLASSES:
            raise DataError(
                f"{where}: label y[{index}] = {label} is out of range [0, {FEMNIST_CLASSES})"
            )
    return x, np.asarray(y_values, dtype=np.int64)


def _read_leaf_split(
    files: list[str], wanted: set[str] | None, limit: int | None
) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """Users (in file order) with their arrays: those in `wanted`, or the first `limit` users."""
    users_read: list[str] = []
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    for path in files:
        users, user_data = _read_leaf_file(path)
        for user in users:
            if wanted is not None and user not in wanted:
                continue
            if limit is not None and len(users_read) >= limit:
                break
            x, y = _leaf_user_arrays(path, user, user_data)
            users_read.append(user)
            xs.append(x)
            ys.append(y)
        done_wanted = wanted is not None and len(users_read) >= len(wanted)
        if done_wanted or (limit is not None and len(users_read) >= limit):
            break
    return users_read, xs, ys


def load_femnist(root: str | None, seed: int, *, max_writers: int | None = None) -> Dataset:
    """FEMNIST from LEAF json (`root/train/*.json`, `root/test/*.json`): 62 classes, writers.

    `train_groups` holds each train sample's writer (numbered in sorted-file order, then the
    order of 'users'), so the 'natural' partition gives every writer its own client.
    `max_writers` reads only the first writers (for quick runs); the test set is then restricted
    to those writers' test samples (LEAF's default per-writer split), or, if the test files hold
    other writers, to the first `max_writers` test writers.
    """
    del seed
    if max_writers is not None:
        max_writers = _int_option("max_writers", max_writers, 1)
    root = _require_root(root, "femnist", "LEAF's train/ and test/ json folders")
    train_files = _femnist_files(root, "train")
    test_files = _femnist_files(root, "test")

    train_users, train_xs, train_ys = _read_leaf_split(train_files, None, max_writers)
    writer_of: dict[str, int] = {}
    groups = []
    for user, y in zip(train_users, train_ys, strict=True):
        writer = writer_of.setdefault(user, len(writer_of))
        groups.append(np.full(len(y), writer, dtype=np.int64))
    if max_writers is None:
        _, test_xs, test_ys = _read_leaf_split(test_files, None, None)
    else:
        _, test_xs, test_ys = _read_leaf_split(test_files, set(writer_of), None)
        if not test_xs:  # test files hold other writers (LEAF's user-based split)
            _, test_xs, test_ys = _read_leaf_split(test_files, None, max_writers)

    def stack(arrays: list[np.ndarray], empty_shape: tuple[int, ...], dtype: type) -> np.ndarray:
        return np.concatenate(arrays) if arrays else np.zeros(empty_shape, dtype=dtype)

    train_y = stack(train_ys, (0,), np.int64)
    if len(train_y) == 0:
        raise DataError(
            f"dataset 'femnist': the train files in {os.path.dirname(train_files[0])} "
            f"hold no samples"
        )
    test_y = stack(test_ys, (0,), np.int64)
    if len(test_y) == 0:
        raise DataError(
            f"dataset 'femnist': the test files in {os.path.dirname(test_files[0])} hold no samples"
        )
    return Dataset(
        name="femnist",
        train_x=stack(train_xs, (0, 1, 28, 28), np.float32),
        train_y=train_y,
        test_x=stack(test_xs, (0, 1, 28, 28), np.float32),
        test_y=test_y,
        num_classes=FEMNIST_CLASSES,
        train_groups=np.concatenate(groups),
    )


def load_dataset(config) -> Dataset:  # config: raysim.config.Config
    """The run's dataset: the `data:` section's plug-in, seeded by the run seed."""
    from raysim import registry
    from raysim.core.sampling import DATA, purpose_seed

    data = config.data
    return registry.datasets.build(
        data.name, data.root, purpose_seed(config.run.seed, DATA), **data.options
    )
