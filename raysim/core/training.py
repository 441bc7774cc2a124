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

import math
import weakref
from collections.abc import Callable

import torch

_SGD_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class LeanSGD:
    """torch.optim.SGD's CPU step (torch's single-tensor `_single_tensor_sgd`, dampening 0,
    no Nesterov, not maximizing) without the machinery around it.

    torch's `step` and `zero_grad` cost ~60 us a call in profiling hooks, parameter-group
    bookkeeping and decorators: a third of a small client's training step. This does the same
    tensor operations in the same order on the same tensors, so the parameters come out bit
    for bit equal (tests/test_fast_paths.py checks it against torch.optim.SGD). Parameters
    without a gradient are skipped, as torch skips them. It offers what raysim's local
    training uses of an optimizer: `step()`, `zero_grad()`, `param_groups` and `state`.

    `params` is a list of tensors or, as torch takes them, of parameter groups
    (`{"params": [...], "lr": ...}`): a group's own `lr` overrides the common one (FedAwS's
    class row trains at its own rate beside theta)."""

    def __init__(self, params: list, *, lr: float, momentum: float,
                 weight_decay: float) -> None:  # fmt: skip
        params = list(params)
        if params and isinstance(params[0], dict):
            self.param_groups = [{**group, "params": list(group["params"])} for group in params]
        else:
            self.param_groups = [{"params": params}]
        self._own_lr = [group.get("lr") for group in self.param_groups]
        self.state: dict[tuple[int, int], torch.Tensor] = {}  # momentum buffers by position
        self.reset(lr=lr, momentum=momentum, weight_decay=weight_decay)

    def reset(self, *, lr: float, momentum: float, weight_decay: float) -> None:
        """The state of a new optimizer with these hyperparameters."""
        for group, own_lr in zip(self.param_groups, self._own_lr, strict=True):
            group.update(
                lr=lr if own_lr is None else own_lr, momentum=momentum, weight_decay=weight_decay
            )
        self.state.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.detach_().zero_()

    def step(self) -> None:
        with torch.no_grad():
            for index, group in enumerate(self.param_groups):
                lr, momentum = group["lr"], group["momentum"]
                weight_decay = group["weight_decay"]
                for position, param in enumerate(group["params"]):
                    grad = param.grad
                    if grad is None:
                        continue
                    if weight_decay != 0:
                        grad = grad.add(param, alpha=weight_decay)
                    if momentum != 0:
                        buffer = self.state.get((index, position))
                        if buffer is None:
                            buffer = self.state[index, position] = grad.detach().clone()
                        else:
                            buffer.mul_(momentum).add_(grad, alpha=1)
                        grad = buffer
                    param.add_(grad, alpha=-lr)

    @staticmethod
    def takes(tensors) -> bool:
        """Whether LeanSGD's step is torch's for `tensors` (dense CPU tensors: torch steps
        them one tensor at a time; elsewhere torch's own SGD, whose foreach kernels are the
        fast path)."""
        return all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors)


def fresh_sgd(
    model: torch.nn.Module, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0
) -> torch.optim.Optimizer | LeanSGD:
    """An SGD optimizer over all of `model`'s parameters in the state of a new one.

    Built once per model object and reset for every client: constructing torch's SGD costs
    ~25 us (a tenth of a small client's training); a reset one is exactly a new one, since
    SGD's only state is the momentum buffer (cleared) and its hyperparameters (set again).
    Clients reuse one cached model per worker (raysim.models.vector.cached_model), so this
    is one optimizer per worker. On the CPU it is a LeanSGD (same arithmetic, less
    overhead); on a GPU torch's own SGD (whose foreach kernels are the fast path there)."""
    parameters = list(model.parameters())
    optimizer = _SGD_CACHE.get(model)
    if optimizer is None or not _same_tensors(optimizer.param_groups[0]["params"], parameters):
        if LeanSGD.takes(parameters):
            optimizer = LeanSGD(parameters, lr=lr, momentum=momentum, weight_decay=weight_decay)
        else:
            optimizer = torch.optim.SGD(
                parameters, lr=lr, momentum=momentum, weight_decay=weight_decay
            )
        _SGD_CACHE[model] = optimizer
        return optimizer
    if isinstance(optimizer, LeanSGD):
        optimizer.reset(lr=lr, momentum=momentum, weight_decay=weight_decay)
    else:
        optimizer.state.clear()
        optimizer.param_groups[0].update(lr=lr, momentum=momentum, weight_decay=weight_decay)
    return optimizer


def _same_tensors(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return len(first) == len(second) and all(a is b for a, b in zip(first, second, strict=True))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate to `lr` (for a `before_step` hook)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


LR_SCHEDULES = ("constant", "cosine_steps", "cosine_epochs")


def check_lr_options(lr_decay: float, lr_schedule: str) -> None:
    """The `algorithm.lr_decay` / `algorithm.lr_schedule` options of a method: one line each."""
    from raysim.errors import ConfigError

    if not 0 < lr_decay <= 1:
        raise ConfigError(f"'algorithm.lr_decay' must be in (0, 1], got {lr_decay}")
    if lr_schedule not in LR_SCHEDULES:
        raise ConfigError(
            f"'algorithm.lr_schedule' must be one of {', '.join(LR_SCHEDULES)}, got {lr_schedule!r}"
        )


def scheduled_lr(
    schedule: str, base_lr: float, step: int, *, steps_per_epoch: int, epochs: int
) -> float:
    """The learning rate of local step `step` (0-based, counted over the whole round).

    - `constant`: `base_lr` at every step.
    - `cosine_steps`: cosine annealing over the round's steps, base_lr at step 0 towards 0
      at the last (FRL's default here).
    - `cosine_epochs`: torch's CosineAnnealingLR(T_max=epochs) stepped once per epoch, as the
      FRL reference code does: epoch e trains at base_lr * (1 + cos(pi * e / epochs)) / 2
      (E = 2: base_lr, then base_lr / 2).
    """
    if schedule == "constant":
        return base_lr
    if schedule == "cosine_steps":
        total_steps = max(1, steps_per_epoch * epochs)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
    if schedule == "cosine_epochs":
        epoch = step // max(1, steps_per_epoch)
        return base_lr * 0.5 * (1.0 + math.cos(math.pi * epoch / max(1, epochs)))
    raise ValueError(f"unknown lr schedule {schedule!r}; choices: {', '.join(LR_SCHEDULES)}")


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
