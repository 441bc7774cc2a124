"""What `raysim partition CONFIG` prints about a split: client sizes, each client's label mix and
the label skew (single-label data), the multi-label report of raysim.data.cmda (multi-hot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from raysim.data import cmda
from raysim.data.split import ClientSplit, PartitionResult

if TYPE_CHECKING:
    from raysim.data.datasets import Dataset


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


def describe_partition(result: PartitionResult, dataset: Dataset, max_rows: int = 20) -> str:
    """`raysim partition CONFIG`'s report: `describe_split` for single-label data; sizes, top
    labels and pairwise label KL of the training and validation splits for multi-hot labels."""
    if np.ndim(dataset.train_y) == 2:  # multi-hot labels
        parts = [("train", result.train, dataset.train_y)]
        if result.validation is not None:
            parts.append(("validation", result.validation, dataset.test_y))
        texts = []
        for what, split, labels in parts:
            lines = cmda.describe_report(cmda.split_report(labels, split), f"{what}: ").splitlines()
            hidden = split.num_clients - max_rows
            lines = lines[: 2 + max_rows]
            if hidden > 0:
                lines.append(f"... {hidden} more clients not shown")
            texts.append("\n".join(lines))
        return "\n".join(texts)
    text = describe_split(result.train, dataset.train_y, dataset.num_classes, max_rows)
    if result.validation is not None:
        sizes = result.validation.sizes
        text += (
            f"\nvalidation: {len(result.validation.indices)} test rows, client size min "
            f"{sizes.min()} max {sizes.max()}"
        )
    return text
