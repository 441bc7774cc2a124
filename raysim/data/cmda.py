"""CMDA (Chang et al., arXiv 2302.13571): clients from k-modes clusters of label vectors.

A multi-label split gives every client its training samples AND its validation samples (the
test set split over the same clients), because FLAG's metrics (AmAP, WmAP, GmAP) are measured
on each client's own validation data:

- `kmodes` (CMDA): k-modes (package `kmodes`, Hamming dissimilarity, Huang init by default) with
  k = number of clients on the training label vectors; client c = cluster c; every validation
  point goes to the nearest learned mode (the training modes, ties to the lowest client id).
- `random` / `iid`: a uniformly random split of both sets into near-equal clients.
- `dirichlet`: label skew on each sample's rarest label ("primary label"): proportions
  ~ Dirichlet(alpha) per primary label, applied to its training and validation samples alike.

This module holds the multi-label algorithms only (on label arrays); the registered partitioners
`kmodes`, `random`, `iid` and `dirichlet` (raysim.data.partition) call them for multi-hot data.

`split_report` measures the label-distribution skew as FLAG's paper measures it:
Ldist_c[l] = (count_c(l) + eps) / sum_l (count_c(l) + eps), the pairwise KL matrix
KL(Ldist_i || Ldist_j) and its total, with epsilon, the count of zero client x label cells and the
total at several epsilons (zero cells make it depend on epsilon); `save_split_plots` draws the KL
heatmap (axes, colour bar) and the client size bar chart with matplotlib as PNG files and logs
them to TensorBoard.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raysim.data.split import ClientSplit
from raysim.data.split import from_assignment as _from_assignment
from raysim.errors import ConfigError

KL_EPSILON = 1e-3
# Epsilons at which split_report also gives the total KL: with zero counts the total depends on
# epsilon (the k-modes / random ratio moves from ~121x to ~319x between 1 and 1e-6).
KL_SENSITIVITY_EPSILONS = (1.0, 1e-2, 1e-3, 1e-4, 1e-6)


@dataclass(frozen=True)
class MultiLabelSplit:
    """Training and validation samples of every client (CSR over train / test rows)."""

    train: ClientSplit
    validation: ClientSplit
    modes: np.ndarray | None = None  # k-modes only: (num_clients, L) uint8 cluster modes
    # the dataset's own validation rows (`val_labels`), placed exactly as the test rows are
    validation_of_val: ClientSplit | None = None


def _check_multi_hot(labels: Any, what: str) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 2 or len(array) == 0:
        raise ConfigError(
            f"partition: {what} must be multi-hot label vectors (n, L), got shape {array.shape}"
        )
    return (array != 0).astype(np.uint8)


def assign_to_modes(labels: np.ndarray, modes: np.ndarray) -> np.ndarray:
    """Index of the nearest mode (Hamming distance) of every row; ties -> the lowest index."""
    labels = np.asarray(labels, dtype=np.int32)
    modes = np.asarray(modes, dtype=np.int32)
    # Hamming distance of binary vectors: |a| + |b| - 2 a.b, one matrix product per chunk.
    assignment = np.empty(len(labels), dtype=np.int64)
    mode_sizes = modes.sum(axis=1)
    for start in range(0, len(labels), 65536):
        chunk = labels[start : start + 65536]
        distance = chunk.sum(axis=1, keepdims=True) + mode_sizes[None, :] - 2 * chunk @ modes.T
        assignment[start : start + 65536] = np.argmin(distance, axis=1)
    return assignment


# k-modes is fitted once per (labels, k, seed, init) and process: the training split and the
# validation assignment of one run ask for the same modes.
_MODES_CACHE: dict[tuple, np.ndarray] = {}


def kmodes_modes(
    train_labels: np.ndarray, num_clients: int, seed: int, init: str = "Huang", n_init: int = 1
) -> np.ndarray:
    """k-modes cluster modes (num_clients, L) of the training label vectors."""
    import hashlib

    labels = _check_multi_hot(train_labels, "labels")
    key = (
        hashlib.sha1(np.ascontiguousarray(labels).tobytes()).hexdigest(),
        labels.shape,
        num_clients,
        seed,
        init,
        n_init,
    )
    if key not in _MODES_CACHE:
        _MODES_CACHE.clear()
        _MODES_CACHE[key] = _fit_kmodes(labels, num_clients, seed, init, n_init)
    return _MODES_CACHE[key].copy()


def _fit_kmodes(
    labels: np.ndarray, num_clients: int, seed: int, init: str, n_init: int
) -> np.ndarray:
    from kmodes.kmodes import KModes

    if not 1 <= num_clients <= len(labels):
        raise ConfigError(
            f"'partition.num_clients' must be in [1, {len(labels)}] for k-modes, got {num_clients}"
        )
    model = KModes(
        n_clusters=num_clients, init=init, n_init=n_init, random_state=seed % (2**31), n_jobs=1
    )
    model.fit(labels)
    return np.asarray(model.cluster_centroids_, dtype=np.uint8)


def kmodes_split(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    seed: int,
    init: str = "Huang",
    val_labels: np.ndarray | None = None,
) -> MultiLabelSplit:
    """CMDA: client c = k-modes cluster c; validation points (the test rows, and `val_labels`'
    rows when given) go to the nearest training mode."""
    modes = kmodes_modes(train_labels, num_clients, seed, init)
    train_clients = assign_to_modes(_check_multi_hot(train_labels, "labels"), modes)
    test_clients = assign_to_modes(_check_multi_hot(test_labels, "test labels"), modes)
    val = None
    if val_labels is not None:
        val_clients = assign_to_modes(_check_multi_hot(val_labels, "validation labels"), modes)
        val = _from_assignment(val_clients, num_clients)
    return MultiLabelSplit(
        _from_assignment(train_clients, num_clients),
        _from_assignment(test_clients, num_clients),
        modes,
        val,
    )


def _even_random(count: int, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    client_of = np.empty(count, dtype=np.int64)
    client_of[rng.permutation(count)] = np.arange(count, dtype=np.int64) % num_clients
    return client_of


def _held_out(rng: np.random.Generator, place, rows: Sequence[Any]) -> list:
    """`place(rows_i, rng)` for each held-out set, each from the generator's state after the
    training rows: the test rows and the validation rows are placed by the same draws, as
    if each had been the only held-out set (a call per set would give the same)."""
    after_train = rng.bit_generator.state
    placed = []
    for held in rows:
        rng.bit_generator.state = after_train
        placed.append(place(held, rng))
    return placed


def random_split(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    seed: int,
    val_labels: np.ndarray | None = None,
) -> MultiLabelSplit:
    """Uniformly random clients of near-equal size, for training and validation alike (the
    test rows, and `val_labels`' rows when given)."""
    rng = np.random.default_rng(seed)
    train = _even_random(len(train_labels), num_clients, rng)
    held = [test_labels] + ([] if val_labels is None else [val_labels])
    placed = _held_out(rng, lambda rows, r: _even_random(len(rows), num_clients, r), held)
    splits = [_from_assignment(client_of, num_clients) for client_of in placed]
    return MultiLabelSplit(
        _from_assignment(train, num_clients),
        splits[0],
        validation_of_val=splits[1] if len(splits) > 1 else None,
    )


def primary_labels(labels: np.ndarray, frequency: np.ndarray) -> np.ndarray:
    """Each row's rarest positive label (by `frequency`; ties -> lowest id); -1 for none."""
    labels = np.asarray(labels) != 0
    rarity = np.where(labels, frequency[None, :], np.inf)
    primary = np.argmin(rarity, axis=1).astype(np.int64)
    primary[~labels.any(axis=1)] = -1
    return primary


def dirichlet_split(
    train_labels: np.ndarray,
    test_labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    val_labels: np.ndarray | None = None,
) -> MultiLabelSplit:
    """Dirichlet(alpha) label skew over each sample's primary (rarest) label (the test rows,
    and `val_labels`' rows when given, by the same proportions)."""
    if not alpha > 0:
        raise ConfigError(f"'partition.alpha' must be > 0, got {alpha!r}")
    train_labels = _check_multi_hot(train_labels, "labels")
    test_labels = _check_multi_hot(test_labels, "test labels")
    frequency = train_labels.mean(axis=0)
    train_primary = primary_labels(train_labels, frequency)
    test_primary = primary_labels(test_labels, frequency)
    rng = np.random.default_rng(seed)
    concentration = np.full(num_clients, float(alpha))
    clients = np.arange(num_clients, dtype=np.int64)
    assignments = []
    proportions = {
        label: rng.dirichlet(concentration) for label in range(-1, train_labels.shape[1])
    }

    def place(primary: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        client_of = np.empty(len(primary), dtype=np.int64)
        for label, share in proportions.items():
            members = rng.permutation(np.flatnonzero(primary == label))
            cuts = np.floor(np.cumsum(share) * len(members)).astype(np.int64)
            cuts[-1] = len(members)
            client_of[members] = np.repeat(clients, np.diff(cuts, prepend=0))
        return client_of

    assignments.append(place(train_primary, rng))
    held = [test_primary]
    if val_labels is not None:
        held.append(primary_labels(_check_multi_hot(val_labels, "validation labels"), frequency))
    assignments += _held_out(rng, place, held)
    splits = [_from_assignment(client_of, num_clients) for client_of in assignments]
    return MultiLabelSplit(
        splits[0], splits[1], validation_of_val=splits[2] if len(splits) > 2 else None
    )


# --- label-distribution skew ----------------------------------------------------------------------


def client_label_counts(labels: np.ndarray, split: ClientSplit) -> np.ndarray:
    """(num_clients, L) int64: how many samples of each client carry each label."""
    labels = np.asarray(labels) != 0
    counts = np.zeros((split.num_clients, labels.shape[1]), dtype=np.int64)
    np.add.at(counts, split.client_ids(), labels[split.indices].astype(np.int64))
    return counts


def label_distributions(counts: np.ndarray, epsilon: float = KL_EPSILON) -> np.ndarray:
    """Ldist_c[l] = (count_c(l) + eps) / sum_l (count_c(l) + eps), float64 (K, L)."""
    smoothed = np.asarray(counts, dtype=np.float64) + epsilon
    return smoothed / smoothed.sum(axis=1, keepdims=True)


def pairwise_kl(distributions: np.ndarray) -> np.ndarray:
    """KL(P_i || P_j) for every pair of clients (K, K); zero diagonal."""
    p = np.asarray(distributions, dtype=np.float64)
    log_p = np.log(p)
    # KL(i||j) = sum_l p_i log p_i - sum_l p_i log p_j (>= 0; clip float rounding)
    kl = np.maximum((p * log_p).sum(axis=1)[:, None] - p @ log_p.T, 0.0)
    np.fill_diagonal(kl, 0.0)
    return kl


def split_report(
    labels: np.ndarray, split: ClientSplit, epsilon: float = KL_EPSILON
) -> dict[str, Any]:
    """Sizes, label distributions, pairwise KL matrix and its total for one split."""
    counts = client_label_counts(labels, split)
    distributions = label_distributions(counts, epsilon)
    kl = pairwise_kl(distributions)
    sizes = split.sizes
    nonempty = sizes[sizes > 0]
    return {
        "sizes": sizes,
        "label_counts": counts,
        "label_distributions": distributions,
        "kl_matrix": kl,
        "kl_total": float(kl.sum()),
        "epsilon": float(epsilon),
        # client x label cells without a sample: there KL rests on epsilon alone, so the total
        # moves with it (reported at several epsilons below)
        "zero_cells": int(np.count_nonzero(counts == 0)),
        "cells": int(counts.size),
        "kl_total_by_epsilon": {
            eps: float(pairwise_kl(label_distributions(counts, eps)).sum())
            for eps in KL_SENSITIVITY_EPSILONS
        },
        "size_ratio": float(nonempty.max() / nonempty.min()) if len(nonempty) else float("nan"),
    }


def describe_report(report: dict[str, Any], title: str = "") -> str:
    """Readable text of `split_report` (what `raysim partition` and the example print)."""
    sizes = report["sizes"]
    lines = [
        f"{title}clients {len(sizes)}  sizes min {sizes.min()} max {sizes.max()} "
        f"(largest/smallest {report['size_ratio']:.2f})  total pairwise KL "
        f"{report['kl_total']:.4g} at epsilon {report['epsilon']:g}; "
        f"{report['zero_cells']} of {report['cells']} client x label counts are 0; total at "
        "epsilon "
        + ", ".join(
            f"{eps:g}: {total:.4g}" for eps, total in report["kl_total_by_epsilon"].items()
        ),
        f"{'client':>6} {'size':>7}  top labels (label:count)",
    ]
    for client, counts in enumerate(report["label_counts"]):
        top = np.argsort(-counts, kind="stable")[:6]
        text = " ".join(f"{label}:{counts[label]}" for label in top if counts[label])
        lines.append(f"{client:>6} {sizes[client]:>7}  {text}")
    return "\n".join(lines)


# --- plots (matplotlib; the same images go to TensorBoard) ------------------------------------


def _figure_image(figure) -> np.ndarray:
    """An RGB uint8 array of a matplotlib figure (then closed)."""
    import io

    from matplotlib import pyplot
    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    buffer.seek(0)
    return np.asarray(Image.open(buffer).convert("RGB"))


def heatmap_image(matrix: np.ndarray, title: str, epsilon: float | None = None) -> np.ndarray:
    """The pairwise KL matrix: rows P_i, columns P_j, cell KL(P_i || P_j), a colour bar; the
    values are printed in the cells when there are few clients."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    size = len(matrix)
    figure, axes = pyplot.subplots(figsize=(1.6 + 0.45 * max(size, 6), 1.0 + 0.4 * max(size, 6)))
    shown = axes.imshow(matrix, cmap="viridis")
    colour_bar = figure.colorbar(shown, ax=axes)
    colour_bar.set_label("KL(P_i || P_j)" + (f", epsilon {epsilon:g}" if epsilon else ""))
    axes.set_xlabel("client j")
    axes.set_ylabel("client i")
    axes.set_title(title, fontsize=9)
    if size <= 16:
        axes.set_xticks(range(size))
        axes.set_yticks(range(size))
        peak = float(matrix.max()) if matrix.size else 0.0
        for i in range(size):
            for j in range(size):
                value = matrix[i, j]
                shade = "white" if peak <= 0 or value < peak / 2 else "black"
                text = f"{value:.2f}" if value < 10 else f"{value:.0f}"
                axes.text(j, i, text, ha="center", va="center", fontsize=6, color=shade)
    figure.tight_layout()
    return _figure_image(figure)


def bar_chart_image(values: np.ndarray, title: str) -> np.ndarray:
    """Client sizes: one bar per client, with axis labels."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    count = len(values)
    figure, axes = pyplot.subplots(figsize=(max(4.0, 0.4 * count + 1.5), 3.2))
    axes.bar(np.arange(count), values, color="C0")
    axes.set_xlabel("client")
    axes.set_ylabel("training samples")
    axes.set_title(title, fontsize=9)
    if count <= 32:
        axes.set_xticks(range(count))
    figure.tight_layout()
    return _figure_image(figure)


def save_split_plots(
    report: dict[str, Any], out_dir: str | Path, prefix: str = "split", writer=None, step: int = 0
) -> dict[str, Path]:
    """Write `{prefix}_kl_heatmap.png` and `{prefix}_sizes.png`; also to TensorBoard if a
    SummaryWriter is given. Returns the PNG paths."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = {
        "kl_heatmap": heatmap_image(
            report["kl_matrix"],
            f"{prefix}: pairwise KL, total {report['kl_total']:.4g} "
            f"({report['zero_cells']} of {report['cells']} label counts are 0)",
            report.get("epsilon"),
        ),
        "sizes": bar_chart_image(report["sizes"], f"{prefix}: client sizes"),
    }
    paths = {}
    for name, image in images.items():
        path = out_dir / f"{prefix}_{name}.png"
        Image.fromarray(image).save(path)
        paths[name] = path
        if writer is not None:
            writer.add_image(f"{prefix}/{name}", image, step, dataformats="HWC")
    return paths
