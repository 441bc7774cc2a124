"""The multi-label form of a `Dataset`, and its embedded synthetic source (no download).

A multi-label `Dataset` holds multi-hot targets: `train_y` and `test_y` are uint8 arrays of shape
(n, L) (1 = the label is present) and `num_classes` is L. Features are float32 as everywhere.
The multi-label sources FLAG runs on:

- `synthetic_multilabel` (here): correlated labels with uneven frequencies and features that
  carry them, any size.
- `arff` (raysim.data.arff): MULAN ARFF files (dense or sparse rows); the label attributes are
  named by the user or taken from MULAN's companion XML file.
- `coco` (raysim.data.coco): MS-COCO 2014 as 80-label multi-hot vectors.
- `xc_multilabel` (raysim.data.xc_datasets): Extreme Classification Repository text files as
  dense multi-hot targets over bag-of-words features.
- `yeast` (raysim.data.offline): MULAN's yeast from river's wheel.
"""

from __future__ import annotations

import numpy as np

from raysim.data.datasets import Dataset
from raysim.data.options import _float_option, _generated_size, _int_option
from raysim.errors import ConfigError


def load_synthetic_multilabel(
    root: str | None,
    seed: int,
    *,
    num_samples: int = 6000,
    num_test: int = 2000,
    num_labels: int = 20,
    num_features: int = 32,
    num_topics: int = 5,
    max_frequency: float = 0.35,
    min_frequency: float = 0.02,
    frequency_decay: float = 1.0,
    correlation: float = 0.7,
    signal: float = 1.0,
    noise: float = 1.0,
) -> Dataset:
    """Correlated multi-label data with uneven label frequencies and learnable features.

    Labels (a Gaussian copula with topic structure):
      - every label l has a marginal frequency p_l = max(max_frequency * (l + 1)^-decay,
        min_frequency), so label 0 is common and the last labels are rare (COCO-like skew);
      - each sample has `num_topics` latent factors h ~ N(0, I); label l loads on one topic
        with weight sqrt(correlation), z_l = sqrt(correlation) h_topic(l) + sqrt(1 -
        correlation) e_l, and y_l = 1[z_l > Phi^-1(1 - p_l)]. Labels of a topic co-occur,
        which gives k-modes clusters to find (as scenes do in COCO);
      - a sample with no label gets the one whose z is closest to its threshold (every COCO
        image has at least one label).
    Features: x = signal * y M / sqrt(mean labels per sample) + noise * e, with M a fixed
    random (L, num_features) Gaussian matrix: every label is linearly decodable, rare labels are
    harder (fewer examples), and noise sets how hard.
    """
    del root
    num_samples = _int_option("num_samples", num_samples, 1)
    num_test = _int_option("num_test", num_test, 1)
    num_labels = _int_option("num_labels", num_labels, 2)
    num_features = _int_option("num_features", num_features, 1)
    num_topics = _int_option("num_topics", num_topics, 1)
    _generated_size(
        "data synthetic_multilabel",
        (num_samples + num_test) * num_features,
        "data.num_samples, data.num_test or data.num_features",
    )
    max_frequency = _float_option("max_frequency", max_frequency, minimum=0.0, strict=True)
    min_frequency = _float_option("min_frequency", min_frequency, minimum=0.0, strict=True)
    frequency_decay = _float_option("frequency_decay", frequency_decay, minimum=0.0)
    correlation = _float_option("correlation", correlation, minimum=0.0)
    signal = _float_option("signal", signal, minimum=0.0)
    noise = _float_option("noise", noise, minimum=0.0)
    if max_frequency >= 1 or min_frequency > max_frequency:
        raise ConfigError(
            f"'data.min_frequency' <= 'data.max_frequency' < 1 is required, got "
            f"{min_frequency} and {max_frequency}"
        )
    if correlation >= 1:
        raise ConfigError(f"'data.correlation' must be in [0, 1), got {correlation}")
    from scipy.stats import norm

    rng = np.random.default_rng(seed)
    frequency = np.maximum(
        max_frequency * (np.arange(1, num_labels + 1) ** -frequency_decay), min_frequency
    )
    thresholds = norm.ppf(1.0 - frequency)
    topic_of_label = rng.permutation(np.arange(num_labels) % num_topics)
    mixing = rng.standard_normal((num_labels, num_features))
    scale = signal / np.sqrt(max(frequency.sum(), 1.0))

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        topics = rng.standard_normal((count, num_topics))
        z = np.sqrt(correlation) * topics[:, topic_of_label] + np.sqrt(
            1 - correlation
        ) * rng.standard_normal((count, num_labels))
        margin = z - thresholds
        y = margin > 0
        empty = ~y.any(axis=1)
        y[np.flatnonzero(empty), np.argmax(margin[empty], axis=1)] = True
        x = scale * (y @ mixing) + noise * rng.standard_normal((count, num_features))
        return np.ascontiguousarray(x, dtype=np.float32), y.astype(np.uint8)

    train_x, train_y = draw(num_samples)
    test_x, test_y = draw(num_test)
    return Dataset("synthetic_multilabel", train_x, train_y, test_x, test_y, num_labels)


def is_multilabel(dataset: Dataset) -> bool:
    """True for multi-hot targets (n, L); single-label datasets have (n,) class ids."""
    return np.ndim(dataset.train_y) == 2
