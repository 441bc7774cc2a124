"""CIFAR-10 and CIFAR-100 from torchvision's layout (python pickle batches), NCHW (3, 32, 32).

Each batch is unpickled by raysim.data.restricted_pickle (never by pickle's own loader) and
checked to be CIFAR's dict of a uint8 (n, 3072) array and n labels in range.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence

import numpy as np

from raysim.data import torchvision_adapter as tv
from raysim.data.datasets import Dataset
from raysim.data.files import _require_root, read_regular_file
from raysim.data.restricted_pickle import RestrictedUnpickler
from raysim.data.torchvision_adapter import _normalise
from raysim.errors import DataError

# A CIFAR python batch is a few dozen MB (CIFAR-100's train file, re-pickled by Python 3 with
# protocol 2, about 230 MB); a file far larger is not one, and is refused before it is read.
_CIFAR_MAX_BYTES = 1 << 30


def _read_cifar_batch(path: str, label_key: str, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    content = read_regular_file(path, "CIFAR python batch", _CIFAR_MAX_BYTES)
    try:
        # From memory: a length in the pickle larger than the file then costs nothing.
        batch = RestrictedUnpickler(io.BytesIO(content), path, len(content)).load()
    except DataError:
        raise
    except Exception as error:  # any unpickling failure means a truncated or foreign file
        raise DataError(
            f"{path} is not a readable CIFAR python batch (truncated or corrupted?): "
            f"{type(error).__name__}: {str(error)[:200]}"
        ) from None
    finally:
        del content
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
            if not os.path.lexists(path):  # a FIFO or folder there is refused by the reader
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
