"""Losses the methods share.

Multi-label: Asymmetric Loss (the FLAG default) and binary cross-entropy. Both take raw logits
(n, L) and multi-hot targets (n, L) and return the mean over samples of the sum over labels, so
the loss scale does not depend on the batch size.

Single-label: `cross_entropy_rows`, cross-entropy row by row (a client step's `row_loss`).
"""

from __future__ import annotations

import torch
from torch import nn

# log() of probabilities is clamped here, as in Ridnik et al.'s reference implementation.
LOG_EPS = 1e-8


def cross_entropy_rows(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of each row of (n, classes) logits (in float32) against its class: row
    i equals `cross_entropy` of a batch of row i alone, value and gradient bit for bit
    (tests/test_losses.py). Written as log-softmax and a gather rather than
    `cross_entropy(reduction="none")`: under torch.func.vmap, nll_loss runs as a Python
    decomposition (~0.15 ms a step more for a small MLP's vmapped clients)."""
    log_probs = torch.log_softmax(logits.float(), dim=1)
    return -log_probs.gather(1, targets.reshape(-1, 1)).reshape(-1)


def asymmetric_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    gamma_neg: float = 4.0,
    gamma_pos: float = 0.0,
    clip: float = 0.05,
) -> torch.Tensor:
    """Asymmetric Loss (Ridnik et al., ICCV 2021), the loss FLAG's paper trains with.

    p = sigmoid(x), p_m = max(p - clip, 0) (probability shifting: easy negatives with p < clip
    cost nothing), and per label
        L = -[ y (1 - p)^gamma_pos log p + (1 - y) p_m^gamma_neg log(1 - p_m) ].
    gamma_neg > gamma_pos down-weights the many easy negatives of multi-label data.
    """
    targets = targets.to(logits.dtype)
    p = torch.sigmoid(logits)
    p_m = (p - clip).clamp(min=0) if clip > 0 else p
    positive = targets * torch.log(p.clamp(min=LOG_EPS))
    negative = (1 - targets) * torch.log((1 - p_m).clamp(min=LOG_EPS))
    if gamma_pos:
        positive = positive * (1 - p) ** gamma_pos
    if gamma_neg:
        negative = negative * p_m**gamma_neg
    return -(positive + negative).sum(dim=1).mean()


def binary_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Plain BCE with logits, summed over labels and averaged over samples."""
    targets = targets.to(logits.dtype)
    return (
        nn.functional.binary_cross_entropy_with_logits(logits, targets, reduction="none")
        .sum(dim=1)
        .mean()
    )


LOSSES = ("asl", "bce")


def multilabel_loss(name: str, gamma_neg: float = 4.0, gamma_pos: float = 0.0, clip: float = 0.05):
    """The loss function called `name` ('asl' or 'bce') as logits, targets -> scalar."""
    if name == "asl":
        return lambda logits, targets: asymmetric_loss(logits, targets, gamma_neg, gamma_pos, clip)
    if name == "bce":
        return binary_cross_entropy
    from raysim.errors import ConfigError

    raise ConfigError(f"'algorithm.loss' must be one of {', '.join(LOSSES)}, got {name!r}")
