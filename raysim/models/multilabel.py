"""Models for the multi-label (FLAG) experiments on feature vectors."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from raysim.models.classic import layer_widths


def mlp_bn(
    input_shape: Sequence[int], num_classes: int, *, hidden: Sequence[int] = (128,)
) -> nn.Module:
    """Linear -> BatchNorm1d -> ReLU blocks, then a linear classifier (one logit per label).

    The BatchNorm layers are what 'personal_bn' keeps per client (FedBN-style); the last
    Linear is what 'personal_classifier' keeps.
    """
    width = 1
    for size in input_shape:
        width *= int(size)
    layers: list[nn.Module] = [nn.Flatten()]
    for size in layer_widths(hidden):
        layers += [nn.Linear(width, int(size)), nn.BatchNorm1d(int(size)), nn.ReLU()]
        width = int(size)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
