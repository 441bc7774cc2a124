"""`cross_entropy_rows` (raysim/losses.py), the vmapped driver's one-call row loss: each row
equals `cross_entropy` of a batch of that row alone, value and gradient bit for bit, inside
the driver's vmap over clients as it runs there."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raysim.losses import cross_entropy_rows


def _per_row(logits, targets):
    """The driver's fallback: the mean loss of a batch of one row, vmapped over the rows."""
    return torch.func.vmap(lambda o, t: nn.functional.cross_entropy(o[None].float(), t[None]))(
        logits, targets
    )


@pytest.mark.parametrize(
    ("clients", "rows", "classes", "dtype"),
    [
        (1, 1, 2, torch.float32),
        (3, 7, 10, torch.float32),
        (5, 33, 101, torch.float32),
        (4, 16, 10, torch.bfloat16),
    ],
)
def test_each_row_equals_cross_entropy_of_that_row_alone(clients, rows, classes, dtype):
    generator = torch.Generator().manual_seed(classes)
    weights = torch.randn(clients, 6, classes, generator=generator)
    inputs = torch.randn(clients, rows, 6, generator=generator)
    targets = torch.randint(0, classes, (clients, rows), generator=generator)
    mask = (torch.rand(clients, rows, generator=generator) > 0.2).float()

    def client_loss(row_loss):
        def loss(w, x, t, m):
            logits = (x @ w).to(dtype)
            return (row_loss(logits, t) * m).sum() / m.sum().clamp(min=1.0)

        return torch.func.vmap(torch.func.grad_and_value(loss))

    grads, losses = client_loss(cross_entropy_rows)(weights, inputs, targets, mask)
    want_grads, want_losses = client_loss(_per_row)(weights, inputs, targets, mask)
    assert torch.equal(losses, want_losses)
    assert torch.equal(grads, want_grads)
    values = cross_entropy_rows((inputs[0] @ weights[0]).to(dtype), targets[0])
    assert values.shape == (rows,) and values.dtype == torch.float32
    assert torch.equal(values, _per_row((inputs[0] @ weights[0]).to(dtype), targets[0]))
