"""Extreme multi-label classification metrics computed on the server: precision@k against
all true labels, and the spread of class embeddings (mean pairwise cosine)."""

from __future__ import annotations

import numpy as np


def precision_at_k(scores_top: np.ndarray, label_sets: np.ndarray, ks=(1, 3, 5)) -> dict:
    """P@k = |top-k predictions that are true labels| / k, averaged over points.

    `scores_top`: (n, >= max k) predicted class ids, best first; `label_sets`: (n, L) true
    labels padded with -1 (or (n,) single labels)."""
    if label_sets.ndim == 1:
        label_sets = label_sets[:, None]
    out = {}
    for k in ks:
        top = scores_top[:, :k]
        hits = (top[:, :, None] == label_sets[:, None, :]) & (label_sets[:, None, :] >= 0)
        out[f"p@{k}"] = float(hits.any(axis=2).sum(axis=1).mean() / k) if len(top) else 0.0
    return out


def mean_pairwise_cosine(rows: np.ndarray) -> float:
    """Mean of w_c . w_c' over pairs c != c' of unit rows, in O(C d):
    (|sum w|^2 - sum |w|^2) / (C (C - 1))."""
    count = len(rows)
    if count < 2:
        return float("nan")
    rows64 = rows.astype(np.float64)
    total = rows64.sum(axis=0)
    return float((total @ total - (rows64 * rows64).sum()) / (count * (count - 1)))
