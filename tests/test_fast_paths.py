"""Shortcuts taken for speed give exactly what the plain way gives."""

from __future__ import annotations

import torch
from torch import nn

from raysim.core.training import fresh_sgd


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 6, generator=generator)
    y = torch.randint(0, 3, (32,), generator=generator)
    for start in range(0, 32, 8):
        loss = nn.functional.cross_entropy(model(x[start : start + 8]), y[start : start + 8])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_reused_sgd_optimizer_trains_each_client_exactly_like_a_new_one():
    """fresh_sgd hands the same optimizer object to consecutive clients of one cached model;
    with momentum (state carried between steps) and weight decay, every client's result must
    equal that of an optimizer constructed for it, even when the hyperparameters change."""
    torch.manual_seed(0)
    reused = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    fresh = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    start = [p.detach().clone() for p in reused.parameters()]
    settings = [(0.1, 0.9, 1e-4), (0.05, 0.9, 0.0), (0.2, 0.0, 1e-3), (0.1, 0.9, 1e-4)]
    objects = set()
    for client, (lr, momentum, decay) in enumerate(settings):
        for model in (reused, fresh):
            with torch.no_grad():
                for p, s in zip(model.parameters(), start, strict=True):
                    p.copy_(s)
        optimizer = fresh_sgd(reused, lr=lr, momentum=momentum, weight_decay=decay)
        objects.add(id(optimizer))
        got = _train(reused, optimizer, seed=client)
        want = _train(
            fresh,
            torch.optim.SGD(fresh.parameters(), lr=lr, momentum=momentum, weight_decay=decay),
            seed=client,
        )
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), client
    assert len(objects) == 1  # one optimizer served every client


def test_a_model_whose_parameters_were_replaced_gets_a_new_optimizer():
    model = nn.Linear(4, 2)
    first = fresh_sgd(model, lr=0.1)
    model.weight = nn.Parameter(torch.zeros(2, 4))
    second = fresh_sgd(model, lr=0.1)
    assert second is not first
    assert second.param_groups[0]["params"][0] is model.weight


def test_lean_sgd_skips_parameters_without_a_gradient_as_torch_does():
    """A parameter the loss does not reach has no gradient: neither decayed nor moved."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(6, 3)
            self.unused = nn.Linear(6, 3)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(1)
    lean, reference = TwoHeads(), TwoHeads()
    reference.load_state_dict(lean.state_dict())
    got = _train(lean, fresh_sgd(lean, lr=0.1, momentum=0.9, weight_decay=0.01), seed=3)
    want = _train(
        reference,
        torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
        seed=3,
    )
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(lean.unused.weight, reference.unused.weight)


def test_lean_sgd_with_parameter_groups_steps_each_group_at_its_rate_as_torch_does():
    """The described client's extra values (FedAwS's class row) train in a second group at
    their own rate; LeanSGD's groups give torch.optim.SGD's result bit for bit, with momentum
    and weight decay, and a reset keeps each group's own rate."""
    from raysim.core.training import LeanSGD

    def groups_of(model):
        first, second = list(model.children())[0], list(model.children())[2]
        return [
            {"params": list(first.parameters())},
            {"params": list(second.parameters()), "lr": 0.5},
        ]

    torch.manual_seed(2)
    lean = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    reference = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    reference.load_state_dict(lean.state_dict())
    optimizer = LeanSGD(groups_of(lean), lr=0.1, momentum=0.9, weight_decay=0.01)
    optimizer.reset(lr=0.1, momentum=0.9, weight_decay=0.01)
    assert [group["lr"] for group in optimizer.param_groups] == [0.1, 0.5]
    got = _train(lean, optimizer, seed=4)
    want = _train(
        reference,
        torch.optim.SGD(groups_of(reference), lr=0.1, momentum=0.9, weight_decay=0.01),
        seed=4,
    )
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
