"""Partitioners: who holds which training sample, as one CSR `ClientSplit`.

A split is two int64 arrays (`indices` grouped by client, `offsets`), never one object per client,
so a million clients cost two object-store entries and partitioning is vectorised numpy. Every
partitioner is a pure function of (labels or groups, num_clients, seed, options): same inputs,
same split, on any machine.

Partitioner signature: `name(labels, num_clients, seed, *, options)`; the keyword-only options are
the `partition.*` config keys it reads.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.errors import ConfigError, closest

if TYPE_CHECKING:
    from raysim.data.datasets import Dataset

DIRICHLET_MAX_TRIES = 1000


@dataclass(frozen=True)
class ClientSplit:
    """Client c owns train samples `indices[offsets[c]:offsets[c + 1]]` (ascending)."""

    indices: np.ndarray  # int64 train-sample ids grouped by client, ascending within each client
    offsets: np.ndarray  # int64 (num_clients + 1,)

    def __post_init__(self) -> None:
        indices, offsets = self.indices, self.offsets
        if indices.ndim != 1 or offsets.ndim != 1 or len(offsets) < 2:
            raise ValueError("ClientSplit needs 1-D indices and at least 2 offsets")
        if indices.dtype != np.int64 or offsets.dtype != np.int64:
            raise ValueError(
                f"ClientSplit arrays must be int64, got {indices.dtype}, {offsets.dtype}"
            )
        if offsets[0] != 0 or offsets[-1] != len(indices) or np.any(np.diff(offsets) < 0):
            raise ValueError("ClientSplit offsets must rise from 0 to len(indices)")

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        """Number of samples of each client (int64, length num_clients)."""
        return np.diff(self.offsets)

    def client_indices(self, client: int) -> np.ndarray:
        """The train-sample ids of one client (a view, no copy)."""
        return self.indices[self.offsets[client] : self.offsets[client + 1]]

    def client_ids(self) -> np.ndarray:
        """The client of each entry of `indices` (int64, same length)."""
        return np.repeat(np.arange(self.num_clients, dtype=np.int64), self.sizes)


# --- helpers ------------------------------------------------------------------------------------


def _from_assignment(client_of: np.ndarray, num_clients: int) -> ClientSplit:
    """CSR from 'client of each sample' (-1: unassigned); a stable sort keeps ids ascending."""
    assigned = np.flatnonzero(client_of >= 0)
    owners = client_of[assigned]
    order = np.argsort(owners, kind="stable")
    counts = np.bincount(owners, minlength=num_clients)
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return ClientSplit(indices=assigned[order].astype(np.int64), offsets=offsets)


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


def _even_sizes(total: int, parts: int) -> np.ndarray:
    """Sizes of `parts` pieces of `total` differing by at most 1 (larger pieces first)."""
    sizes = np.full(parts, total // parts, dtype=np.int64)
    sizes[: total % parts] += 1
    return sizes


# --- partitioners -------------------------------------------------------------------------------


def iid(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
    """Uniformly random split into equal-ish clients (sizes differ by at most 1): the baseline."""
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    rng = np.random.default_rng(seed)
    client_of = np.empty(len(labels), dtype=np.int64)
    client_of[rng.permutation(len(labels))] = np.repeat(
        np.arange(num_clients, dtype=np.int64), _even_sizes(len(labels), num_clients)
    )
    return _from_assignment(client_of, num_clients)


def dirichlet(
    labels: np.ndarray, num_clients: int, seed: int, *, alpha: float = 0.5, min_size: int = 1
) -> ClientSplit:
    """Label skew: each class is spread over clients by proportions ~ Dirichlet(alpha).

    Smaller alpha => each client sees fewer classes. Draws are repeated (same rng stream, so still
    deterministic) until every client holds at least `min_size` samples.
    """
    labels = _check_labels(labels)
    num_clients = _check_num_clients(num_clients, len(labels))
    if (
        isinstance(alpha, bool)
        or not isinstance(alpha, int | float | np.number)
        or not np.isfinite(alpha)
        or alpha <= 0
    ):
        raise ConfigError(f"'partition.alpha' must be a finite number > 0, got {alpha!r}")
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


def shards(
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


def one_class(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
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


def natural(groups: np.ndarray | None, num_clients: int, seed: int) -> ClientSplit:
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


def kmodes(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
    """CMDA: clients = k-modes clusters of multi-hot label vectors (raysim.data.cmda)."""
    from raysim.data import cmda

    return cmda.kmodes(labels, num_clients, seed)


def random(labels: np.ndarray, num_clients: int, seed: int) -> ClientSplit:
    """Uniformly random near-equal clients for any label shape (raysim.data.cmda)."""
    from raysim.data import cmda

    return cmda.random(labels, num_clients, seed)


PARTITIONERS: dict[str, Callable[..., ClientSplit]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shards": shards,
    "one_class": one_class,
    "natural": natural,
    "kmodes": kmodes,
    "random": random,
}


def make_split(
    dataset: Dataset,
    name: str,
    num_clients: int,
    seed: int,
    *,
    alpha: float,
    shards_per_client: int,
    min_size: int = 1,
) -> ClientSplit:
    """Split `dataset`'s training set with the partitioner called `name` (the config entry)."""
    if name not in PARTITIONERS:
        choices = sorted(PARTITIONERS)
        raise ConfigError(
            f"unknown partition.name '{name}'{closest(name, choices)}; "
            f"choices: {', '.join(choices)}"
        )
    if np.ndim(dataset.train_y) == 2 and name != "natural":
        # Multi-hot labels: the multi-label splits, which also place the validation set.
        from raysim.data.cmda import split_multilabel

        return split_multilabel(
            dataset.train_y, dataset.test_y, name, num_clients, seed, alpha=alpha
        ).train
    if name == "kmodes":
        raise ConfigError(
            f"partition 'kmodes' clusters multi-hot label vectors; dataset '{dataset.name}' "
            f"is single-label"
        )
    if name == "natural":
        if dataset.train_groups is None:
            raise ConfigError(
                f"partition 'natural': dataset '{dataset.name}' has no natural "
                f"clients; choose another partition.name"
            )
        return natural(dataset.train_groups, num_clients, seed)
    if name == "dirichlet":
        return dirichlet(dataset.train_y, num_clients, seed, alpha=alpha, min_size=min_size)
    if name == "shards":
        return shards(dataset.train_y, num_clients, seed, shards_per_client=shards_per_client)
    return PARTITIONERS[name](dataset.train_y, num_clients, seed)


# --- inspection ---------------------------------------------------------------------------------


def label_histograms(split: ClientSplit, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """(num_clients, num_classes) int64 label counts of every client, in one bincount."""
    keys = split.client_ids() * num_classes + np.asarray(labels, dtype=np.int64)[split.indices]
    counts = np.bincount(keys, minlength=split.num_clients * num_classes)
    return counts.reshape(split.num_clients, num_classes)


def label_skew(split: ClientSplit, labels: np.ndarray, num_classes: int) -> float:
    """Mean over clients of the total-variation distance to the global label distribution.

    0 = every client looks like the whole dataset, 1 = clients share no labels with it. Computed
    on the (client, label) pairs that occur, so it needs no dense clients x classes matrix.
    """
    labels = np.asarray(labels, dtype=np.int64)
    client_labels = labels[split.indices]
    nonempty = split.sizes > 0
    if not nonempty.any():
        return 0.0
    global_dist = np.bincount(client_labels, minlength=num_classes) / len(client_labels)
    keys = split.client_ids() * num_classes + client_labels  # sorted by client already
    pair_keys, pair_counts = np.unique(keys, return_counts=True)
    pair_client, pair_label = np.divmod(pair_keys, num_classes)
    sizes = split.sizes
    share = pair_counts / sizes[pair_client]
    # TV = 1/2 (sum over present labels |q - g| + global mass of the labels the client lacks)
    abs_diff = np.bincount(
        pair_client, np.abs(share - global_dist[pair_label]), minlength=split.num_clients
    )
    covered = np.bincount(pair_client, global_dist[pair_label], minlength=split.num_clients)
    distance = 0.5 * (abs_diff + 1.0 - covered)
    return float(distance[nonempty].mean())


def _histogram_text(counts: np.ndarray, num_classes: int) -> str:
    if num_classes <= 20:
        return " ".join(str(c) for c in counts)
    nonzero = np.flatnonzero(counts)
    top = nonzero[np.argsort(-counts[nonzero], kind="stable")][:8]
    text = " ".join(f"{label}:{counts[label]}" for label in top)
    return text + (f" ... (+{len(nonzero) - len(top)} labels)" if len(nonzero) > len(top) else "")


def describe_split(
    split: ClientSplit, labels: np.ndarray, num_classes: int, max_rows: int = 20
) -> str:
    """Readable report of a split for `raysim partition CONFIG`: sizes, label mix, skew."""
    labels = np.asarray(labels, dtype=np.int64)
    sizes = split.sizes
    lines = [
        f"clients: {split.num_clients}   samples: {len(split.indices)}   classes: {num_classes}",
        f"client size: min {sizes.min()}  median {np.median(sizes):g}  "
        f"mean {sizes.mean():.2f}  max {sizes.max()}",
        f"label skew (mean total-variation distance to the global label distribution; "
        f"0 = iid, 1 = disjoint): {label_skew(split, labels, num_classes):.4f}",
    ]
    header = (
        f"labels (count per class 0..{num_classes - 1})"
        if num_classes <= 20
        else "labels (label:count, most frequent first)"
    )
    width = max(6, len(str(split.num_clients - 1)))
    lines.append(f"{'client':>{width}} {'size':>8}  {header}")
    shown = min(max_rows, split.num_clients)
    for client in range(shown):
        counts = np.bincount(labels[split.client_indices(client)], minlength=num_classes)
        lines.append(
            f"{client:>{width}} {sizes[client]:>8}  {_histogram_text(counts, num_classes)}"
        )
    if split.num_clients > shown:
        lines.append(f"... {split.num_clients - shown} more clients not shown")
    return "\n".join(lines)
