"""A model plug-in: an MLP with residual blocks.

A model factory takes the input shape and the number of classes (positionally) and its options
as keyword-only parameters with annotations (checked when the config is read); it returns a
torch module. raysim seeds torch before calling it, so the initial weights depend only on the
run seed. Named in a config as `model: {name: residual_mlp:residual_mlp, width: 64}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

import raysim


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + nn.functional.relu(self.linear(x))


@raysim.plugin("model")
def residual_mlp(
    input_shape: Sequence[int], num_classes: int, *, width: int = 64, blocks: int = 2
) -> nn.Module:
    if width < 1 or blocks < 0:
        raise ValueError(f"width must be >= 1 and blocks >= 0, got {width}, {blocks}")
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(math.prod(input_shape), width),
        nn.ReLU(),
        *[_Block(width) for _ in range(blocks)],
        nn.Linear(width, num_classes),
    )
