"""Partitioners: who holds which sample, as CSR `ClientSplit`s, behind one dispatcher.

Partitioner contract
--------------------
A partitioner is a callable registered in `raysim.registry.partitioners` (a built-in name, or
any `package.module:attr` a config names)::

    def my_partitioner(dataset: Dataset, num_clients: int, seed: int, *, option: float = 1.0
                       ) -> ClientSplit | PartitionResult

- `dataset` is the whole `raysim.data.datasets.Dataset`: labels (`train_y`, 1-D int64, or 2-D
  multi-hot for multi-label data), `train_groups` (natural clients), `test_y`, features, ...
- `num_clients` is `partition.num_clients`; `seed` is the run's partition seed. The split must
  be a pure function of (dataset, num_clients, seed, options): same inputs, same split.
- Options are keyword-only parameters with annotations and defaults. Every key of the config's
  `partition:` section except `name`, `num_clients` and `cache_dir` is passed as an option, and
  checked against the parameters by `registry.partitioners.check_options` when the config is
  read (unknown keys and wrong types are refused in one line, as for models and algorithms).
  A partitioner may also carry a `check_options(**options)` attribute that checks values that
  are wrong whatever the data (e.g. `alpha > 0`); it runs when the config is read too.
- It returns a `ClientSplit` over the training rows (exactly `num_clients` clients), or a
  `PartitionResult` whose `validation` places rows of the test set on the same clients (the
  multi-label splits do: FLAG measures each client on its own validation rows), and whose
  `validation_of_val` places the rows of the dataset's validation split (`val_y`, when it has
  one) the same way; without it the run calls the partitioner again with those rows as its
  test set, so a plug-in need not give it.
- A mistake of the user (an option out of range, a label shape the partitioner cannot split)
  is a one-line `ConfigError` naming the `partition.*` key.

`split_dataset(dataset, name, num_clients, seed, options)` resolves and calls a partitioner and
checks its result (a run's partition, with the parquet cache of `partition.cache_dir`, is
raysim.assembly.plan's; the reports of `raysim partition` are raysim.data.partition_report's).
The built-ins (`iid`, `dirichlet`, `shards`, `one_class`, `natural`,
`kmodes`, `random`) handle single-label and multi-hot labels themselves where they can (the
multi-label algorithms are in raysim.data.cmda) and refuse the other shape with a ConfigError.
Their label-array algorithms (`iid_split`, `dirichlet_split`, ...) are plain functions of labels.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.data import cmda
from raysim.data.split import ClientSplit, PartitionResult
from raysim.data.split import from_assignment as _from_assignment
from raysim.errors import ConfigError

if TYPE_CHECKING:
    from raysim.data.datasets import Dataset

__all__ = ["ClientSplit", "PartitionResult", "split_dataset"]

DIRICHLET_MAX_TRIES = 1000


# --- helpers ------------------------------------------------------------------------------------


def _check_int(
    key: str, value: Any, minimum: int, maximum: int | None = None, why_maximum: str = ""
) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"'{key}' must be an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"'{key}' must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"'{key}' must be <= {maximum}{why_maximum}, got {number}")
    return number


def _check_labels(labels: Any, what: str = "labels") -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or len(array) == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(
            f"partition: {what} must be a non-empty 1-D integer array, got "
            f"{array.dtype} array of shape {array.shape}"
        )
    return array.astype(np.int64, copy=False)


def _check_num_clients(num_clients: Any, num_samples: int) -> int:
    return _check_int(
        "partition.num_clients", num_clients, 1, num_samples, " (the number of training samples)"
    )


def _check_alpha(alpha: Any) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.number):
        raise ConfigError(f"'partition.alpha' must be a number > 0, got {alpha!r}")
    if not alpha > 0:
        raise ConfigError(f"'partition.alpha' must be > 0, got {alpha!r}")
    if not np.isfinite(alpha):
        raise ConfigError(f"'partition.alpha' must be finite, got {alpha!r}")


def _even_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of `parts` pieces of `total` differing by at most 1 (larger pieces first)."""
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


# --- label-array algorithms ---------------------------------------------------------------------


def iid_split(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
    """Uniformly random split into equal-ish clients (sizes differ by at most 1): the baseline."""
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    client_of = np.empty(len(labels), dtype=np.int64)
    client_of[rng.permutation(len(labels))] = np.repeat(
        np.arange(num_clients, dtype=np.int64), _even_sizes(len(labels), num_clients)
    )
    return _from_assignment(client_of, num_clients)


def dirichlet_split(
    labels: np.ndarray, num_clients: int, seed: int, *, alpha: float = 0.5, min_size: int = 1
) -> ClientSplit:
    """Label skew: each class is spread over clients by proportions ~ Dirichlet(alpha).

    Smaller alpha => each client sees fewer classes. Draws are repeated (same rng stream, so still
    deterministic) until every client holds at least `min_size` samples.
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    _check_alpha(alpha)
    min_size = _check_int(
        "partition.min_size",
        min_size,
        0,
        len(labels) // num_clients,
        " (= training samples // partition.num_clients)",
    )
    rng = np.random.default_rng(seed)
    classes, class_of = np.unique(labels, return_inverse=True)
    members = np.argsort(class_of, kind="stable")
    class_sizes = np.bincount(class_of, minlength=len(classes))
    class_starts = np.concatenate(([0], np.cumsum(class_sizes)))
    if min_size >= 1:  # before any draw: the rng stream, so the split, stays the same
        _check_dirichlet_feasible(class_sizes, num_clients, float(alpha), min_size, len(labels))
    concentration = np.full(num_clients, float(alpha))

    for _ in range(DIRICHLET_MAX_TRIES):
        per_class_counts = []
        totals = np.zeros(num_clients, dtype=np.int64)
        for size in class_sizes:
            proportions = rng.dirichlet(concentration)
            cuts = np.floor(np.cumsum(proportions) * size).astype(np.int64)
            np.clip(cuts, 0, size, out=cuts)
            cuts[-1] = size
            counts = np.diff(cuts, prepend=0)
            per_class_counts.append(counts)
            totals += counts
        if totals.min() >= min_size:
            break
    else:
        raise ConfigError(
            f"partition 'dirichlet': after {DIRICHLET_MAX_TRIES} draws some client still had "
            f"fewer than partition.min_size={min_size} samples with partition.alpha={alpha} and "
            f"partition.num_clients={num_clients} ({len(labels)} samples); use a larger "
            f"partition.alpha or fewer partition.num_clients"
        )

    client_ids = np.arange(num_clients, dtype=np.int64)
    client_of = np.empty(len(labels), dtype=np.int64)
    for class_index, counts in enumerate(per_class_counts):
        samples = members[class_starts[class_index] : class_starts[class_index + 1]]
        client_of[rng.permutation(samples)] = np.repeat(client_ids, counts)
    return _from_assignment(client_of, num_clients)


# Refuse when the expected number of clients left without a row in a draw exceeds this: the
# chance that a draw leaves none empty is then about exp(-50), so all DIRICHLET_MAX_TRIES
# draws would fail (at O(classes x clients) each: 10 minutes for a million clients).
DIRICHLET_MAX_EXPECTED_EMPTY = 50.0


def _check_dirichlet_feasible(
    class_sizes: np.ndarray, num_clients: int, alpha: float, min_size: int, num_samples: int
) -> None:
    """O(classes) estimate, before the draws, of whether any draw can give every client a row.

    A client's share of a class of n rows is p ~ Beta(alpha, (K-1) alpha) (K clients); its
    count is 0 with probability E[(1 - n p)+] (the floor of the cumulative cuts), which is
    I_{1/n}(a, b) - n a/(a+b) I_{1/n}(a+1, b). Classes are drawn independently, so a client is
    empty with the product over classes, and K times that is the expected number of empty
    clients."""
    try:
        from scipy.special import betainc
    except ImportError:  # no estimate: the draws decide, as before
        return
    a, b = alpha, (num_clients - 1) * alpha
    if b <= 0:
        return
    empty = 1.0
    for size in np.asarray(class_sizes, dtype=np.float64):
        x = min(1.0, 1.0 / size)
        zero = betainc(a, b, x) - size * a / (a + b) * betainc(a + 1, b, x)
        empty *= min(1.0, max(0.0, float(zero)))
    expected = num_clients * empty
    if expected > DIRICHLET_MAX_EXPECTED_EMPTY:
        raise ConfigError(
            f"partition 'dirichlet': with partition.alpha={alpha} and "
            f"partition.num_clients={num_clients} ({num_samples} samples) a draw leaves about "
            f"{expected:,.0f} clients without a sample, so no draw can give every client "
            f"partition.min_size={min_size}; use a larger partition.alpha or fewer "
            "partition.num_clients"
        )


def shards_split(
    labels: np.ndarray, num_clients: int, seed: int, *, shards_per_client: int = 2
) -> ClientSplit:
    """McMahan et al.'s pathological non-IID split: sort by label, deal out contiguous shards.

    With balanced classes each client sees at most `shards_per_client` classes.
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    shards_per_client = _check_int(
        "partition.shards_per_client",
        shards_per_client,
        1,
        len(labels) // num_clients,
        " (= training samples // partition.num_clients, so every shard holds a sample)",
    )
    rng = np.random.default_rng(seed)
    num_shards = num_clients * shards_per_client
    by_label = np.argsort(labels, kind="stable")
    shard_of_position = np.repeat(
        np.arange(num_shards, dtype=np.int64), _even_sizes(len(labels), num_shards)
    )
    client_of_shard = np.empty(num_shards, dtype=np.int64)
    client_of_shard[rng.permutation(num_shards)] = (
        np.arange(num_shards, dtype=np.int64) // shards_per_client
    )
    client_of = np.empty(len(labels), dtype=np.int64)
    client_of[by_label] = client_of_shard[shard_of_position]
    return _from_assignment(client_of, num_clients)


def one_class_split(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
    """Each client holds one class only (FedAwS's setting): client i gets class i mod C'.

    C' counts the classes present (ascending); a class shared by several clients has its
    shuffled samples split evenly among them. Vectorised, so 670,000 classes are fine.
    """
    labels = _check_labels(labels)
    classes, class_of = np.unique(labels, return_inverse=True)
    present = len(classes)
    num_clients = _check_num_clients(num_clients, len(labels))
    if num_clients < present:
        raise ConfigError(
            f"partition 'one_class': 'partition.num_clients' must be >= {present} (the number of "
            f"classes present, so that every class has a client), got {num_clients}"
        )
    clients_per_class = np.bincount(np.arange(num_clients) % present, minlength=present)
    class_sizes = np.bincount(class_of, minlength=present)
    short = np.flatnonzero(class_sizes < clients_per_class)
    if len(short):
        first = short[0]
        raise ConfigError(
            f"partition 'one_class': class {classes[first]} has {class_sizes[first]} samples but "
            f"partition.num_clients={num_clients} gives it {clients_per_class[first]} clients, so "
            f"a client would be empty; use fewer partition.num_clients or another partition"
        )
    rng = np.random.default_rng(seed)
    # Shuffle, then stable-sort by class: samples grouped by class in random order within it.
    shuffled = rng.permutation(len(labels))
    grouped = shuffled[np.argsort(class_of[shuffled], kind="stable")]
    cls = class_of[grouped]
    starts = np.concatenate(([0], np.cumsum(class_sizes)))[:-1]
    rank = np.arange(len(labels), dtype=np.int64) - starts[cls]
    # Piece of an even split of n into m pieces (first n % m pieces one larger), per sample.
    base = class_sizes[cls] // clients_per_class[cls]
    extra = class_sizes[cls] % clients_per_class[cls]
    big = extra * (base + 1)
    piece = np.where(rank < big, rank // (base + 1), extra + (rank - big) // np.maximum(base, 1))
    client_of = np.empty(len(labels), dtype=np.int64)
    client_of[grouped] = cls + piece * present
    return _from_assignment(client_of, num_clients)


def natural_split(groups: np.ndarray | None, num_clients: int, seed: int) -> ClientSplit:
    """Clients = the dataset's natural groups (e.g. FEMNIST writers), in ascending group order.

    With fewer clients than groups, a seeded random subset of groups is used (the other samples
    belong to no client).
    """
    if groups is None:
        raise ConfigError(
            "partition 'natural': this dataset has no natural clients (no "
            "train_groups); choose another partition.name"
        )
    groups = _check_labels(groups, "groups")
    unique_groups, group_of = np.unique(groups, return_inverse=True)
    num_clients = _check_int(
        "partition.num_clients",
        num_clients,
        1,
        len(unique_groups),
        " (the dataset's number of natural clients)",
    )
    if num_clients == len(unique_groups):
        return _from_assignment(group_of.astype(np.int64), num_clients)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(len(unique_groups), size=num_clients, replace=False))
    client_of_group = np.full(len(unique_groups), -1, dtype=np.int64)
    client_of_group[chosen] = np.arange(num_clients, dtype=np.int64)
    return _from_assignment(client_of_group[group_of], num_clients)


# --- the registered partitioners (the contract in the module docstring) ------------------------


def _multi_hot(dataset: Dataset) -> bool:
    return np.ndim(dataset.train_y) == 2


def _multilabel_result(split: cmda.MultiLabelSplit) -> PartitionResult:
    return PartitionResult(split.train, split.validation, split.validation_of_val)


def _single_label_only(name: str, dataset: Dataset) -> None:
    if _multi_hot(dataset):
        raise ConfigError(
            f"partition '{name}' splits single-label data; dataset '{dataset.name}' has "
            f"multi-hot labels: choose partition.name kmodes, random, iid or dirichlet"
        )


def iid(dataset: Dataset, num_clients: int, seed: int) -> ClientSplit | PartitionResult:
    """Uniformly random near-equal clients (the baseline); on multi-hot labels the test set is
    split over the clients the same way (CMDA's random split)."""
    if _multi_hot(dataset):
        split = cmda.random_split(
            dataset.train_y, dataset.test_y, num_clients, seed, val_labels=dataset.val_y
        )
        return _multilabel_result(split)
    return iid_split(dataset.train_y, num_clients, seed)


def dirichlet(
    dataset: Dataset, num_clients: int, seed: int, *, alpha: float = 0.5, min_size: int = 1
) -> ClientSplit | PartitionResult:
    """Label skew ~ Dirichlet(alpha) per class; on multi-hot labels per primary (rarest) label,
    for the training and the test rows alike (raysim.data.cmda.dirichlet_split)."""
    if _multi_hot(dataset):
        _check_alpha(alpha)
        if min_size != 1:
            raise ConfigError(
                f"partition 'dirichlet' on multi-hot labels (dataset '{dataset.name}') does not "
                f"take 'partition.min_size'"
            )
        split = cmda.dirichlet_split(
            dataset.train_y, dataset.test_y, num_clients, seed, alpha, val_labels=dataset.val_y
        )
        return _multilabel_result(split)
    return dirichlet_split(dataset.train_y, num_clients, seed, alpha=alpha, min_size=min_size)


def _check_dirichlet_options(*, alpha: float = 0.5, min_size: int = 1) -> None:
    _check_alpha(alpha)
    _check_int("partition.min_size", min_size, 0)


dirichlet.check_options = _check_dirichlet_options  # type: ignore[attr-defined]


def shards(
    dataset: Dataset, num_clients: int, seed: int, *, shards_per_client: int = 2
) -> ClientSplit:
    """McMahan et al.'s pathological non-IID split (single-label data)."""
    _single_label_only("shards", dataset)
    return shards_split(dataset.train_y, num_clients, seed, shards_per_client=shards_per_client)


def _check_shards_options(*, shards_per_client: int = 2) -> None:
    _check_int("partition.shards_per_client", shards_per_client, 1)


shards.check_options = _check_shards_options  # type: ignore[attr-defined]


def one_class(dataset: Dataset, num_clients: int, seed: int) -> ClientSplit:
    """Each client holds one class only (FedAwS's setting; single-label data)."""
    _single_label_only("one_class", dataset)
    return one_class_split(dataset.train_y, num_clients, seed)


def natural(dataset: Dataset, num_clients: int, seed: int) -> ClientSplit:
    """Clients = the dataset's natural groups (`train_groups`, e.g. FEMNIST writers)."""
    if dataset.train_groups is None:
        raise ConfigError(
            f"partition 'natural': dataset '{dataset.name}' has no natural "
            f"clients; choose another partition.name"
        )
    return natural_split(dataset.train_groups, num_clients, seed)


def kmodes(dataset: Dataset, num_clients: int, seed: int) -> PartitionResult:
    """CMDA: clients = k-modes clusters of multi-hot label vectors; test rows go to the nearest
    training mode (raysim.data.cmda.kmodes_split)."""
    if not _multi_hot(dataset):
        raise ConfigError(
            f"partition 'kmodes' clusters multi-hot label vectors; dataset '{dataset.name}' "
            f"is single-label"
        )
    split = cmda.kmodes_split(
        dataset.train_y, dataset.test_y, num_clients, seed, val_labels=dataset.val_y
    )
    return _multilabel_result(split)


def random(dataset: Dataset, num_clients: int, seed: int) -> ClientSplit | PartitionResult:
    """Uniformly random near-equal clients for any label shape (raysim.data.cmda.random_split);
    on multi-hot labels the test set is split too."""
    if _multi_hot(dataset):
        split = cmda.random_split(
            dataset.train_y, dataset.test_y, num_clients, seed, val_labels=dataset.val_y
        )
        return _multilabel_result(split)
    return cmda.random_split(dataset.train_y, dataset.train_y[:1], num_clients, seed).train


# --- the dispatcher -------------------------------------------------------------------------------


def split_dataset(
    dataset: Dataset,
    name: str,
    num_clients: int,
    seed: int,
    options: Mapping[str, Any] | None = None,
) -> PartitionResult:
    """Split `dataset` with the partitioner `name` (registered name or `module:attr`).

    Single- and multi-label data alike: the partitioner decides what it can split. Its result
    is checked (a ClientSplit or PartitionResult, `num_clients` clients, row ids in range).
    """
    from raysim import registry

    checked = registry.partitioners.check_option_values(name, options or {}, "partition")
    produced = registry.partitioners.build(name, dataset, num_clients, seed, **checked)
    if isinstance(produced, ClientSplit):
        produced = PartitionResult(produced)
    if not isinstance(produced, PartitionResult):
        raise ConfigError(
            f"partitioner '{name}' returned a {type(produced).__name__}; a partitioner returns "
            f"a ClientSplit or a PartitionResult"
        )
    val_rows = 0 if dataset.val_y is None else len(dataset.val_y)
    for what, split, rows in (
        ("training", produced.train, len(dataset.train_y)),
        ("validation", produced.validation, len(dataset.test_y)),
        ("validation-split", produced.validation_of_val, val_rows),
    ):
        if split is None:
            continue
        if split.num_clients != num_clients:
            raise ConfigError(
                f"partitioner '{name}' returned {split.num_clients} {what} clients, but "
                f"partition.num_clients is {num_clients}"
            )
        if len(split.indices) and (split.indices.min() < 0 or split.indices.max() >= rows):
            raise ConfigError(f"partitioner '{name}' returned {what} row ids outside [0, {rows})")
    return produced


def options_with_defaults(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The partitioner's keyword-only defaults overridden by `options` (the partition cache's
    key: raysim.assembly.plan)."""
    import inspect

    from raysim import registry

    parameters = inspect.signature(registry.partitioners.get(name)).parameters.values()
    return {
        p.name: p.default
        for p in parameters
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
    } | dict(options)
