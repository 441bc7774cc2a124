"""The `Dataset` record every loader returns, and `load_dataset`, which builds a run's dataset.

Every loader returns a `Dataset` of plain numpy arrays (float32 features, int64 labels), because
the engine puts those arrays in the Ray object store once per run and clients slice them by index.
No loader ever downloads anything: real datasets are read from `data.root` in the layout their
usual tool writes (torchvision, LEAF), and a missing or malformed file is a `DataError` that names
the file and says how to obtain or fix it.

Loader signature: `load_<name>(root, seed, *, options)`. The keyword-only options are the keys a
config may set under `data:` (see `raysim.registry`, which names each built-in loader's module).
`load_dataset` calls the configured loader and then holds out the validation split
(`carve_validation`), which every loader's dataset gets the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raysim.errors import DataError


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
    # The validation split (`data.validation_fraction`): rows held out of the training source
    # before the client split, labels in test_y's form. None: no validation split.
    val_x: np.ndarray | None = None
    val_y: np.ndarray | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample, e.g. (1, 28, 28); what a model factory needs to size its input."""
        return tuple(self.train_x.shape[1:])


def load_dataset(config) -> Dataset:  # config: raysim.config.Config
    """The run's dataset: the `data:` section's plug-in, seeded by the run seed."""
    from raysim import registry
    from raysim.seeds import DATA, VALIDATION, purpose_seed

    data = config.data
    dataset = registry.datasets.build(
        data.name, data.root, purpose_seed(config.run.seed, DATA), **data.options
    )
    if data.validation_fraction > 0:
        dataset = carve_validation(
            dataset, data.validation_fraction, purpose_seed(config.run.seed, VALIDATION)
        )
    return dataset


def validation_rows(num_train: int, fraction: float, seed: int) -> np.ndarray:
    """The training rows (sorted) that `carve_validation` holds out: round(fraction x n) of
    them, at least 1, drawn from `seed` alone (so the same for every backend and partitioner)."""
    count = min(num_train - 1, max(1, round(fraction * num_train)))
    if count < 1:
        raise DataError(f"a validation split needs at least 2 training rows, got {num_train}")
    return np.sort(np.random.default_rng(seed).permutation(num_train)[:count])


def carve_validation(dataset: Dataset, fraction: float, seed: int) -> Dataset:
    """`dataset` with `validation_rows` moved out of its training split into val_x/val_y.

    The validation rows leave the training arrays before the client split, so no client ever
    trains on them, and they come from the training source, so they never overlap the test
    split. Labels take the test split's form (an XML dataset's padded label sets)."""
    import dataclasses

    if dataset.val_x is not None:
        raise DataError(f"dataset '{dataset.name}' already has a validation split")
    rows = validation_rows(len(dataset.train_y), fraction, seed)
    keep = np.ones(len(dataset.train_y), dtype=bool)
    keep[rows] = False
    val_y = dataset.train_y[rows]
    if dataset.train_label_sets is not None:  # evaluated like test_y: every true label
        val_y = dataset.train_label_sets[rows]

    def kept(array):
        return None if array is None else np.ascontiguousarray(array[keep])

    return dataclasses.replace(
        dataset,
        train_x=kept(dataset.train_x),
        train_y=kept(dataset.train_y),
        train_groups=kept(dataset.train_groups),
        train_label_sets=kept(dataset.train_label_sets),
        val_x=np.ascontiguousarray(dataset.train_x[rows]),
        val_y=np.ascontiguousarray(val_y),
    )
