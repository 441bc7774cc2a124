"""Evaluation metrics computed on the server: single-label classification (top-1 accuracy,
cross-entropy). raysim.metrics.xml: extreme multi-label (P@k, the spread of class embeddings),
raysim.metrics.xml_scale: the same at Amazon-670K scale; raysim.metrics.multilabel: FLAG's mAP."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


def evaluate_classifier(
    model: nn.Module, x: np.ndarray, y: np.ndarray, batch_size: int = 1024
) -> dict[str, float]:
    """Top-1 accuracy and mean cross-entropy of `model` on (x, y), on the model's device."""
    device = next(model.parameters()).device
    model.eval()
    correct = 0
    loss_sum = 0.0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            xb = torch.from_numpy(np.array(x[start : start + batch_size], dtype=np.float32))
            yb = torch.from_numpy(np.array(y[start : start + batch_size], dtype=np.int64))
            xb, yb = xb.to(device), yb.to(device)  # no-ops on the CPU
            logits = model(xb)
            loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
            correct += int((logits.argmax(dim=1) == yb).sum())
    model.train()
    count = max(1, len(y))
    return {"accuracy": correct / count, "loss": loss_sum / count}
