"""The local-training loop every method's clients run: epochs of minibatches in the client's own
shuffled order.

Determinism contract: at the start of each epoch the batch order is drawn on the CPU with
`torch.randperm(num_samples, generator=generator)` from the client's generator (seeded from
(seed, round, client id)), and nothing else in the loop draws from it; so a client's result
depends on its data and that generator only, never on the worker or device that ran it.

A method supplies only what is its own: the loss of a step's batch (`loss_fn`), the optimizer,
and where needed a learning-rate scheduler, a per-step hook (e.g. a learning rate set before
every step), a proximal term, a gradient rule other than `loss.backward()`, or steps that take
several consecutive batches (Per-FedAvg's inner / outer batch pairs).

This module imports nothing from raysim.algorithms.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

_SGD_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def fresh_sgd(
    model: torch.nn.Module, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
) -> torch.optim.SGD:
    """An SGD optimizer over all of `model`'s parameters in the state of a new one.

    Built once per model object and reset for every client: constructing torch's SGD costs
    ~25 us (a tenth of a small client's training); a reset one is exactly a new one, since
    SGD's only state is the momentum buffer (cleared) and its hyperparameters (set again).
    Clients reuse one cached model per worker (raysim.models.vector.cached_model), so this
    is one optimizer per worker."""
    parameters = list(model.parameters())
    optimizer = _SGD_CACHE.get(model)
    if optimizer is None or not _same_tensors(optimizer.param_groups[0]["params"], parameters):
        optimizer = torch.optim.SGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
        _SGD_CACHE[model] = optimizer
        return optimizer
    optimizer.state.clear()
    group = optimizer.param_groups[0]
    group.update(lr=lr, momentum=momentum, weight_decay=weight_decay)
    return optimizer


def _same_tensors(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to `lr` (for a `before_step` hook)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


def local_training(
    num_samples: int,
    generator: torch.Generator,
    *,
    batch_size: int,
    epochs: int,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler=None,
    proximal_mu: float = 0.0,
    before_step: Callable[[int], None] | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
    batches_per_step: int = 1,
    device: torch.device | None = None,
    loss_without_steps: float = 0.0,
) -> float:
    """`epochs` epochs of minibatch steps over `num_samples` examples; returns the mean loss.

    Every epoch draws the batch order `torch.randperm(num_samples, generator=generator)` and
    cuts it into batches of `batch_size` index tensors (the last one may be shorter; moved to
    `device` when given). Each step takes `batches_per_step` consecutive batches (an incomplete
    group at the end of an epoch is skipped) and does, in this order:

        before_step(step)                    step = 0, 1, ... over the whole training
        loss = loss_fn(*batches)             the method's loss on the step's batch(es)
        loss += 0.5 * proximal_mu * sum ||p - p_0||^2   (FedProx; p: the optimizer's
                                             parameters, p_0 their values before training)
        backward(loss)                       default: optimizer.zero_grad(set_to_none=True);
                                             loss.backward()
        optimizer.step(); scheduler.step()   (scheduler when given)

    The mean loss is the float sum of the steps' losses divided by max(1, steps);
    `loss_without_steps` when no step ran.
    """
    if batches_per_step < 1:
        raise ValueError(f"batches_per_step must be >= 1, got {batches_per_step}")
    anchors = None
    if proximal_mu:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        anchors = [(p, p.detach().clone()) for p in params]
    loss_sum, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(num_samples, generator=generator)
        batches = [order[start : start + batch_size] for start in range(0, num_samples, batch_size)]
        if device is not None:
            batches = [batch.to(device) for batch in batches]
        groups = zip(*(batches[i::batches_per_step] for i in range(batches_per_step)), strict=False)
        for group in groups:
            if before_step is not None:
                before_step(steps)
            loss = loss_fn(*group)
            if anchors is not None:
                proximal = sum(((p - a) ** 2).sum() for p, a in anchors)
                loss = loss + 0.5 * proximal_mu * proximal
            if backward is None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            else:
                backward(loss)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            loss_sum += float(loss.detach())
            steps += 1
    return loss_sum / max(1, steps) if steps else loss_without_steps
