"""The datasets that need no file: scikit-learn's bundled digits and synthetic classification.

`digits` is the default of the quick-start configs (a real dataset without a download);
`synthetic_classification` is learnable data of any size and sample shape, drawn from the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.options import _float_option, _generated_size, _int_option, _shape_option
from raysim.errors import ConfigError


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
    _generated_size(
        "data synthetic_classification",
        (num_samples + num_test) * math.prod(shape),
        "data.num_samples, data.num_test or data.sample_shape",
    )

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
