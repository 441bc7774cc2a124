"""Everything raysim knows about torchvision, in one place (project rule: one adapter per library).

raysim reads torchvision's on-disk layouts itself (`raysim.data.idx`, `raysim.data.cifar`)
rather than through torchvision's dataset classes: those check md5 sums (so tiny test files
fail), cannot read gzipped MNIST without re-extracting it, and unpickle CIFAR batches with no
restriction. What stays here is the layout, the usual normalisation constants and the
normalisation itself (`_normalise`: ToTensor + Normalize), the message that tells a user how to
obtain the files, and `download`, the one function that imports torchvision - meant to be run
by hand on a machine with internet access, never by raysim itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from raysim.errors import ConfigError

# Folder (relative to the torchvision root) and files of each dataset, as torchvision writes them.
MNIST_RAW_DIR = os.path.join("MNIST", "raw")
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
CIFAR10_DIR = "cifar-10-batches-py"
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR10_TEST_FILES = ("test_batch",)
CIFAR100_DIR = "cifar-100-python"
CIFAR100_TRAIN_FILES = ("train",)
CIFAR100_TEST_FILES = ("test",)

# Per-channel mean/std of the training sets on the [0, 1] scale (the values used across FL papers).
MNIST_MEAN, MNIST_STD = (0.1307,), (0.3081,)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


def _normalise(images: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """uint8 NCHW -> float32 scaled to [0, 1] then standardised per channel, without float64."""
    x = images.astype(np.float32)
    x *= np.float32(1.0 / 255.0)
    channel_shape = (1, len(mean)) + (1,) * (x.ndim - 2)
    x -= np.asarray(mean, dtype=np.float32).reshape(channel_shape)
    x /= np.asarray(std, dtype=np.float32).reshape(channel_shape)
    return np.ascontiguousarray(x)


_TORCHVISION_CLASSES = {"mnist": "MNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}


def how_to_obtain(name: str, root: str) -> str:
    """The sentence an error message ends with when a torchvision dataset is missing."""
    class_name = _TORCHVISION_CLASSES[name]
    return (
        f"run torchvision.datasets.{class_name}({root!r}, download=True) (or "
        f'`python -c "from raysim.data.torchvision_adapter import download; '
        f"download('{name}', '{root}')\"`) on a machine with internet access and copy the "
        f"folder to {root!r}"
    )


def download(name: str, root: str) -> None:
    """Fetch a dataset into `root` (torchvision layout); needs internet, raysim never calls it."""
    if name not in _TORCHVISION_CLASSES:
        raise ConfigError(
            f"download: unknown dataset {name!r}; "
            f"choices: {', '.join(sorted(_TORCHVISION_CLASSES))}"
        )
    import torchvision.datasets  # the only torchvision import in raysim

    dataset_class = getattr(torchvision.datasets, _TORCHVISION_CLASSES[name])
    for train in (True, False):
        dataset_class(root, train=train, download=True)
