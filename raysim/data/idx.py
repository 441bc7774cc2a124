"""MNIST-style IDX files: the checked reader of an image/label pair, and the MNIST loader.

MNIST is read from torchvision's layout (`root/MNIST/raw/*-ubyte[.gz]`); `read_idx_images` is
shared with Fashion-MNIST (raysim.data.offline), which uses the same format. Every header is
checked against the size of its file before anything is allocated.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib

import numpy as np

from raysim.data import torchvision_adapter as tv
from raysim.data.datasets import Dataset
from raysim.data.files import _GZIP_MAX_RATIO, _find_file, _require_root, open_regular_file
from raysim.data.torchvision_adapter import _normalise
from raysim.errors import DataError


def _read_idx(path: str, expected_dims: int) -> np.ndarray:
    """Read an idx file (the MNIST format: big-endian header, then unsigned bytes).

    The header is checked before the data is read, and the data size it promises against the
    file (or, for .gz, what its compressed size can hold), so a hostile or broken file costs
    at most the memory its true contents need."""
    raw_handle, file_size = open_regular_file(path, "idx file", None)
    try:
        with (
            gzip.GzipFile(fileobj=raw_handle, mode="rb") if path.endswith(".gz") else raw_handle
        ) as handle:
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
            limit = file_size * _GZIP_MAX_RATIO if path.endswith(".gz") else file_size
            if header + payload > limit:
                raise DataError(
                    f"{path}: idx header says shape {shape} ({header + payload} bytes in all) "
                    f"but the file has {file_size} bytes (truncated or corrupted?)"
                )
            raw = handle.read(payload + 1)  # one more: a longer file is caught too
    except (OSError, EOFError, zlib.error) as error:  # zlib.error: a corrupted .gz stream
        raise DataError(f"cannot read {path}: {error} (truncated or corrupted?)") from None
    finally:
        raw_handle.close()
    if len(raw) != payload:
        size = header + len(raw) if len(raw) <= payload else "more than that"
        raise DataError(
            f"{path}: idx header says shape {shape} ({header + payload} bytes in all) but the "
            f"file has {size} bytes (truncated or corrupted?)"
        )
    return np.frombuffer(raw, dtype=np.uint8).reshape(shape)


def read_idx_images(image_path: str, label_path: str) -> tuple[np.ndarray, np.ndarray]:
    """28x28 uint8 images and their int64 labels from a pair of idx files (MNIST's format),
    checked to match."""
    images = _read_idx(image_path, 3)
    labels = _read_idx(label_path, 1).astype(np.int64)
    if images.shape[1:] != (28, 28):
        raise DataError(f"{image_path}: images are {images.shape[1:]}, expected 28x28")
    if len(images) != len(labels):
        raise DataError(
            f"{image_path} has {len(images)} images but {label_path} has {len(labels)} labels"
        )
    return images, labels


def _load_mnist_split(directory: str, split: str, root: str) -> tuple[np.ndarray, np.ndarray]:
    image_name, label_name = tv.MNIST_FILES[split]
    image_path = _find_file(directory, image_name, "mnist", root)
    label_path = _find_file(directory, label_name, "mnist", root)
    images, labels = read_idx_images(image_path, label_path)
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
