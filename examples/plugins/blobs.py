"""A dataset plug-in: Gaussian blobs (scikit-learn's make_classification), generated locally.

A dataset loader takes `root` (the config's `data.root`, a folder or None) and `seed` (derived
from the run seed) positionally, options as keyword-only parameters, and returns a
`raysim.data.datasets.Dataset`: float32 features, int64 labels, train and test. Bad input is a
one-line `raysim.DataError` or `ConfigError` naming what and where.
Named in a config as `data: {name: blobs:load_blobs, num_samples: 2000}`.
"""

from __future__ import annotations

import numpy as np

import raysim
from raysim import ConfigError
from raysim.data.datasets import Dataset


@raysim.plugin("dataset")
def load_blobs(
    root: str | None,
    seed: int,
    *,
    num_samples: int = 2000,
    num_features: int = 20,
    num_classes: int = 5,
    test_fraction: float = 0.25,
) -> Dataset:
    from sklearn.datasets import make_classification

    del root  # generated, nothing to read
    if num_samples < 10 or num_classes < 2 or not 0 < test_fraction < 1:
        raise ConfigError(
            "'data.num_samples' must be >= 10, 'data.num_classes' >= 2 and "
            f"'data.test_fraction' in (0, 1); got {num_samples}, {num_classes}, {test_fraction}"
        )
    x, y = make_classification(
        n_samples=num_samples,
        n_features=num_features,
        n_informative=min(num_features, 2 * num_classes),
        n_redundant=0,
        n_classes=num_classes,
        n_clusters_per_class=1,
        random_state=seed % 2**32,  # sklearn takes 32-bit seeds
    )
    num_test = int(round(test_fraction * num_samples))
    x = x.astype(np.float32)
    return Dataset(
        name="blobs",
        train_x=np.ascontiguousarray(x[num_test:]),
        train_y=y[num_test:].astype(np.int64),
        test_x=np.ascontiguousarray(x[:num_test]),
        test_y=y[:num_test].astype(np.int64),
        num_classes=num_classes,
    )
