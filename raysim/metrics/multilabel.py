"""Multi-label metrics (FLAG): mAP per client and its AmAP / WmAP / GmAP.

mAP  = mean over the labels with at least one positive of the average precision (AP) of that
       label's scores; AP is scikit-learn's step-wise definition (no interpolation):
       AP = sum_n (R_n - R_{n-1}) P_n over the distinct score thresholds.
AmAP = mean over clients of the client's own model's mAP on the client's validation split.
WmAP = the worst client's mAP (of the same client models).
GmAP = mean over clients of the global model's mAP on each client's validation split.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


def average_precision(scores: np.ndarray, targets: np.ndarray) -> float:
    """AP of one label: scores (n,), binary targets (n,). NaN when there is no positive."""
    targets = np.asarray(targets).astype(bool)
    positives = int(targets.sum())
    if positives == 0:
        return float("nan")
    scores = np.asarray(scores, dtype=np.float64)
    order = np.argsort(-scores, kind="mergesort")
    sorted_scores, sorted_targets = scores[order], targets[order]
    true_positives = np.cumsum(sorted_targets)
    # One threshold per distinct score (ties count together), as scikit-learn does.
    last_of_run = np.r_[np.flatnonzero(np.diff(sorted_scores)), len(sorted_scores) - 1]
    tps = true_positives[last_of_run]
    precision = tps / (last_of_run + 1)
    recall = tps / positives
    return float(np.sum(np.diff(recall, prepend=0.0) * precision))


def mean_average_precision(scores: np.ndarray, targets: np.ndarray) -> float:
    """mAP over labels with >= 1 positive; scores and multi-hot targets are (n, L)."""
    scores, targets = np.asarray(scores), np.asarray(targets)
    if scores.shape != targets.shape or scores.ndim != 2:
        raise ValueError(f"scores {scores.shape} and targets {targets.shape} must be equal (n, L)")
    values = [
        average_precision(scores[:, label], targets[:, label])
        for label in range(targets.shape[1])
        if targets[:, label].any()
    ]
    return float(np.mean(values)) if values else float("nan")


def predict_scores(model: nn.Module, x: np.ndarray, batch_size: int = 1024) -> np.ndarray:
    """Logits of `model` on x (n, ...) as float32 (n, L); eval mode, no gradients; computed
    on the model's device."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            batch = torch.from_numpy(np.asarray(x[start : start + batch_size], dtype=np.float32))
            outputs.append(model(batch.to(device)).cpu().numpy())
    model.train(was_training)
    if not outputs:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(outputs).astype(np.float32, copy=False)


def per_client_map(
    scores: np.ndarray, targets: np.ndarray, indices: np.ndarray, offsets: np.ndarray
) -> np.ndarray:
    """mAP of `scores` on each client's rows (CSR: client c owns indices[offsets[c]:...])."""
    result = np.full(len(offsets) - 1, np.nan)
    for client in range(len(offsets) - 1):
        rows = indices[offsets[client] : offsets[client + 1]]
        if len(rows):
            result[client] = mean_average_precision(scores[rows], targets[rows])
    return result


def summarise_clients(client_maps: np.ndarray) -> tuple[float, float]:
    """(mean, worst) over the clients that have a defined mAP: AmAP/WmAP or GmAP/worst."""
    defined = client_maps[~np.isnan(client_maps)]
    if not len(defined):
        return float("nan"), float("nan")
    return float(defined.mean()), float(defined.min())


def rounds_to_target(values: Sequence[float], target: float) -> int | None:
    """1-based index of the first value >= target (e.g. rounds to 80% of centralized GmAP)."""
    for index, value in enumerate(values):
        if value is not None and np.isfinite(value) and value >= target:
            return index + 1
    return None
