"""One client description, two drivers.

A method states its client once, as three pure-ish pieces (docs/EXTENDING.md):

    client_step(payload, ctx) -> ClientStep      this round's local training: the model, the
                                                  loss of a batch, the SGD and its schedule
    client_start(payload, client_id, ctx)        the values a client starts training from
                                                  (a flat vector: the trained tensors, then
                                                  the extra values, e.g. FedAwS's class row)
    client_messages(payload, trained, ctx)       the updates of trained clients (TrainedClients:
                                                  ids, labels, starts, trained rows, losses)

and, where a client's step depends on its own data, a fourth:

    client_chunk(payload, step, client_ids, xs, personal, ctx) -> ClientChunk
                                                  the step, inputs and starts specialised to
                                                  these clients (FedAwS: the embedding-bag
                                                  rows they touch, a table of their own)

and `DescribedClient` (the method's base) runs it, the pattern of fedjax's `client_step` run by
a sequential or a vmapped driver:

- `client_update`: one client at a time, the model trained in place by the engine's loop
  (`train_one`: raysim.core.training.local_training with the step's loss and optimizer);
- `batched_client_updates` (`clients.batched`): a chunk of clients vmapped
  (raysim.core.batched_training.train_batched, the same loss per row of every padded batch).

Both drivers ask the same `client_chunk` for what to train (one client, or a chunk) and hand
the same `client_messages` their results, so what a client trains and sends is written once.
A method whose client does not fit (Per-FedAvg's inner and outer steps) sets
`client_step = None` and writes its own `client_update`; overriding `client_update` of a
described method is refused when the class is defined (the batched driver would not see it).
Why a configuration cannot be vmapped is the method's one declared capability,
`batching_problem(ctx)`.

This module imports nothing from raysim.algorithms.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from raysim.core.algorithm import AlgorithmHooks
from raysim.core.state import ClientUpdate
from raysim.core.training import LeanSGD, fresh_sgd, local_training, scheduled_lr, set_lr
from raysim.models.devices import autocast


@dataclass(frozen=True)
class ClientStep:
    """One round's local training, the same for every client of the round.

    `loss(outputs, targets)` (or `loss(outputs, targets, extra)` when the clients train extra
    values) is the mean loss of a batch; the vmapped driver takes it row by row (a batch of
    one), so both drivers run the very same function. `row_loss` (optional, same arguments):
    the loss of every row of a batch at once, a vector (raysim.losses.cross_entropy_rows),
    which the vmapped driver calls instead of `loss` under a second vmap over the rows (one
    call: ~0.2 ms less per step on small models); it must give each row what `loss` gives a
    batch of that row alone (tests/test_losses.py holds cross_entropy_rows to that, bit for
    bit; a step made from another with a new `loss` names its `row_loss` too, or None).
    Then SGD: `lr` (the round's base rate; one per client is accepted by the vmapped driver),
    `lr_schedule` within the round (raysim.core.training.scheduled_lr), momentum, weight decay
    and FedProx's `proximal_mu`.

    `trainable`: the names of the model's tensors a client trains (None: every floating
    tensor of its state dict, the model vector's order); the others are shared, not trained
    (FRL's supernet weights). `extra_lr` is not None when each client trains values beside the
    model (the last values of its start), stepped at that rate. `step_inputs(params)`: for the
    vmapped driver, more per-client tensors computed from the stacked values before every
    step (FRL's top-k masks; the sequential model computes them itself).
    `as_tensor`: trained rows come back as a tensor on the step's device (FRL ranks there;
    FedAwS folds its dense deltas there, raysim.algorithms.class_embedding).
    `vmapped_model` (optional): the network the vmapped driver runs instead of `model`: the
    same parameters (names and shapes) and the same function, stated with operations that
    torch.func.vmap batches where `model` uses one it runs client by client (FedAwS's bag
    clients: a gather and a sum instead of embedding_bag); its values agree with `model`'s to
    float rounding, and must not depend on which clients share a chunk.

    Sequential only: `optimizer(params, steps_per_epoch) -> (optimizer, scheduler | None)`, a
    local optimizer other than SGD (FLAG's Adam + OneCycle), and `mixed_precision` (bfloat16
    autocast); `vmap_problem` says so in one line."""

    model: nn.Module
    loss: Callable[..., torch.Tensor]
    lr: float | Sequence[float]
    batch_size: int
    epochs: int
    momentum: float = 0.0
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    proximal_mu: float = 0.0
    trainable: tuple[str, ...] | None = None
    extra_lr: float | None = None
    step_inputs: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    as_tensor: bool = False
    optimizer: Callable | None = None
    mixed_precision: bool = False
    row_loss: Callable[..., torch.Tensor] | None = None
    vmapped_model: nn.Module | None = None

    @classmethod
    def of(cls, clients, **fields) -> ClientStep:
        """A step with the config's `clients` SGD (batch size, epochs, momentum, weight
        decay) and `fields`."""
        return cls(
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            momentum=clients.momentum,
            weight_decay=clients.weight_decay,
            **fields,
        )

    @property
    def device(self) -> torch.device:
        # (a meta tensor only gives a shape)
        devices = (p.device for p in self.model.parameters() if p.device.type != "meta")
        return next(devices, torch.device("cpu"))

    def vmap_problem(self) -> str | None:
        """Why the vmapped driver cannot run this step (one line), or None."""
        if self.optimizer is not None:
            return "its local optimizer is not SGD"
        if self.mixed_precision:
            return "mixed_precision (bfloat16 autocast) is not batched"
        return None


class StartParts:
    """A start row given as consecutive 1-D float32 pieces (FedAwS: theta's dense part, shared
    by every client, then the client's own rows): the sequential driver loads each piece into
    the model where it belongs, without first writing the concatenated row; anything else reads
    it as that row (np.asarray). A piece may be a float32 tensor, kept as it is (theta's dense
    part already on the clients' GPU: copied there once for all of a payload's clients)."""

    def __init__(self, *parts) -> None:
        self.parts = tuple(_flat_piece(part) for part in parts)

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        parts = [
            part.detach().cpu().numpy() if isinstance(part, torch.Tensor) else part
            for part in self.parts
        ]
        row = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return row if dtype is None else row.astype(dtype, copy=False)


def _flat_piece(part):
    """A start piece as a 1-D float32 array, or a 1-D float32 tensor (the same object when it
    is one already: batched_training recognises a piece every client shares by identity)."""
    if isinstance(part, torch.Tensor):
        if part.dtype != torch.float32:
            raise ValueError(f"a start piece must be float32, got {part.dtype}")
        return part if part.dim() == 1 else part.reshape(-1)
    return np.asarray(part, dtype=np.float32).reshape(-1)


@dataclass(frozen=True)
class ClientChunk:
    """What the drivers train for some clients (`client_chunk`): the step specialised to them,
    their inputs as the step's model reads them, their start rows (arrays, tensors or
    StartParts) and, per client, what `client_messages` needs besides (None by default)."""

    step: ClientStep
    xs: tuple[torch.Tensor, ...]
    starts: tuple
    notes: tuple


@dataclass(frozen=True)
class TrainedClients:
    """What a driver hands `client_messages`: the clients in order, their labels (CPU
    tensors), start rows, trained rows (one per client: a float32 array, or a tensor on the
    step's device with `as_tensor`), mean losses (NaN for a client without samples) and the
    notes of their `ClientChunk`."""

    client_ids: tuple[int, ...]
    ys: tuple[torch.Tensor, ...]
    starts: tuple
    trained: np.ndarray | torch.Tensor
    losses: tuple[float, ...]
    notes: tuple = ()

    def __len__(self) -> int:
        return len(self.client_ids)


def trained_tensors(model: nn.Module, trainable: Sequence[str] | None) -> list[torch.Tensor]:
    """The tensors a client trains, in the order of its start row."""
    state = model.state_dict(keep_vars=True)
    if trainable is None:
        return [t for t in state.values() if t.is_floating_point()]
    return [state[name] for name in trainable]


def train_one(
    step: ClientStep, start, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator
) -> tuple[np.ndarray | torch.Tensor, float]:
    """The sequential driver: `step`'s model loaded with `start` and trained in place on one
    client's (x, y) (on the step's device); returns its trained row and mean loss (NaN
    without samples: nothing trains)."""
    model, device = step.model, step.device
    tensors = trained_tensors(model, step.trainable)
    pieces = [_as_tensor(part, device) for part in _parts(start)]
    total = sum(piece.numel() for piece in pieces)
    width = sum(t.numel() for t in tensors)
    if total < width or (step.extra_lr is None and total != width):
        raise ValueError(f"a start of {total} values for {width} trained values")
    reader = _PieceReader(pieces)
    with torch.no_grad():
        for tensor in tensors:
            tensor.copy_(reader.take(tensor.numel()).view_as(tensor))
    extra = None
    if step.extra_lr is not None:
        extra = reader.take(total - width).clone().requires_grad_(True)
    loss = float("nan")
    if len(y):
        x, y = x.to(device), y.to(device)
        if not all(module.training for module in model.modules()):
            model.train()  # (Module.train costs ~20 us a client even when nothing changes)
        loss = _local_sgd(step, model, tensors, extra, x, y, generator)
    with torch.no_grad():
        parts = [t.detach().reshape(-1) for t in tensors]
        if extra is not None:
            parts.append(extra.detach())
        row = torch.cat(parts)
    if step.as_tensor:
        return row, loss
    # torch.cat wrote new memory that nothing else holds: no second copy is needed
    return row.cpu().numpy().astype(np.float32, copy=False), loss


def _parts(start) -> tuple:
    return start.parts if isinstance(start, StartParts) else (start,)


class _PieceReader:
    """Consecutive values of a start given in pieces: `take(n)` the next n (a view when they
    lie in one piece)."""

    def __init__(self, pieces: list[torch.Tensor]) -> None:
        self.pieces, self.piece, self.offset = pieces, 0, 0

    def take(self, count: int) -> torch.Tensor:
        taken = []
        while count:
            piece = self.pieces[self.piece]
            part = piece[self.offset : self.offset + count]
            taken.append(part)
            count -= part.numel()
            self.offset += part.numel()
            if self.offset == piece.numel():
                self.piece, self.offset = self.piece + 1, 0
        if len(taken) == 1:
            return taken[0]
        if not taken:
            return torch.zeros(0, device=self.pieces[0].device if self.pieces else None)
        return torch.cat(taken)


def _as_tensor(start, device: torch.device) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start.reshape(-1).to(device)
    array = np.asarray(start, dtype=np.float32)
    if array.flags.writeable:
        return torch.from_numpy(array).to(device)
    with warnings.catch_warnings():  # a read-only object-store view: it is only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).to(device)


def _local_sgd(step: ClientStep, model, tensors, extra, x, y, generator) -> float:
    """E epochs of the step's optimizer over the client's batches (local_training); `tensors`:
    the model's tensors the client trains (trained_tensors)."""
    steps_per_epoch = -(-len(y) // step.batch_size)
    scheduler = None
    if step.optimizer is not None:
        optimizer, scheduler = step.optimizer(list(model.parameters()), steps_per_epoch)
    elif extra is None:
        optimizer = fresh_sgd(
            model, lr=step.lr, momentum=step.momentum, weight_decay=step.weight_decay
        )
    else:  # the extra values are a second parameter group at their own rate; the first
        # group is what the client trains (not, e.g., the full embedding-bag table that
        # FedAwS's step model holds untrained beside its table of touched rows)
        trained = list(model.parameters()) if step.trainable is None else tensors
        groups = [{"params": trained}, {"params": [extra], "lr": step.extra_lr}]
        sgd = LeanSGD if LeanSGD.takes([*trained, extra]) else torch.optim.SGD
        optimizer = sgd(groups, lr=step.lr, momentum=step.momentum, weight_decay=step.weight_decay)
    if extra is not None and step.lr_schedule != "constant":
        raise ValueError("extra values need a constant lr_schedule")  # as the vmapped driver
    before_step = None
    if step.optimizer is None and extra is None:  # (another optimizer has its own scheduler;
        # extra values keep their own rate, and a constant schedule never changes the model's)

        def before_step(index: int) -> None:
            rate = scheduled_lr(
                step.lr_schedule,
                step.lr,
                index,
                steps_per_epoch=steps_per_epoch,
                epochs=step.epochs,
            )
            set_lr(optimizer, rate)

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with autocast(x.device, step.mixed_precision):
            outputs = model(x[batch])
            if extra is None:
                return step.loss(outputs, y[batch])
            return step.loss(outputs, y[batch], extra)

    return local_training(
        len(y),
        generator,
        batch_size=step.batch_size,
        epochs=step.epochs,
        loss_fn=loss_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        proximal_mu=step.proximal_mu,
        before_step=before_step,
        device=x.device,
    )


@functools.cache
def _takes_own_payload(method: type) -> bool:
    """Whether `method`'s clients each get a payload of their own (`client_payload`):
    asked once per class, not once per client."""
    return AlgorithmHooks.of(method).client_payload is not None


class DescribedClient:
    """The base of a method that states its client once (this module's docstring): its
    `client_update` and `batched_client_updates` are the engine's two drivers."""

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls)
        # the class's client_step as its instances will see it (None: a client of its own)
        described = next(
            (vars(c)["client_step"] for c in cls.__mro__ if "client_step" in vars(c)), None
        )
        if "client_update" in own and described is not None:
            raise TypeError(
                f"{cls.__name__} overrides client_update of a method that describes its client "
                f"(client_step): change client_step / client_start / client_messages instead, "
                f"or set client_step = None for a client of its own (docs/EXTENDING.md)"
            )
        if "batched_client_updates" in own:
            raise TypeError(
                f"{cls.__name__} overrides batched_client_updates: the batched driver runs the "
                f"method's client description (client_step / client_messages)"
            )

    def client_update(self, payload, x, y, client_id, generator, ctx) -> ClientUpdate:
        personal = None
        # a method with `client_payload` (FedAwS: each client's class row) gets (the round's
        # payload, this client's own); its own goes to `client_chunk` as the batched one's do
        if _takes_own_payload(type(self)):
            payload, own = payload
            personal = (own,)
        step = self.client_step(payload, ctx)
        chunk = self.client_chunk(payload, step, (int(client_id),), (x,), personal, ctx)
        trained, loss = train_one(chunk.step, chunk.starts[0], chunk.xs[0], y, generator)
        rows = trained[None] if chunk.step.as_tensor else trained.reshape(1, -1)
        done = TrainedClients((int(client_id),), (y,), chunk.starts, rows, (loss,), chunk.notes)
        return self.client_messages(payload, done, ctx)[0]

    def batched_client_updates(self, payload, batch, ctx) -> list[ClientUpdate]:
        """A chunk of clients (raysim.core.batched_training.ClientBatch) vmapped."""
        from raysim.core.batched_training import train_batched

        step = self.client_step(payload, ctx)
        problem = step.vmap_problem()
        if problem is not None:  # batching_problem should have said so before the round
            raise RuntimeError(f"{type(self).__name__}'s client step cannot be vmapped: {problem}")
        chunk = self.client_chunk(payload, step, batch.client_ids, batch.xs, batch.personal, ctx)
        trained, losses = train_batched(chunk.step, chunk.starts, replace(batch, xs=chunk.xs))
        done = TrainedClients(
            batch.client_ids, batch.ys, chunk.starts, trained, tuple(losses), chunk.notes
        )
        return self.client_messages(payload, done, ctx)

    def client_chunk(self, payload, step, client_ids, xs, personal, ctx) -> ClientChunk:
        """What the drivers train for `client_ids` (`xs` their inputs; `personal` their own
        payloads, or None): by default `step` as it is, the inputs as given and each client's
        `client_start`. A method whose step depends on its clients' data specialises it here
        (FedAwS: a table of the embedding-bag rows the clients touch)."""
        starts = tuple(self.client_start(payload, c, ctx) for c in client_ids)
        return ClientChunk(step, tuple(xs), starts, (None,) * len(starts))

    def batching_problem(self, ctx) -> str | None:
        """Why this instance's clients cannot train vmapped (one line), or None: the method's
        one declared capability. A method refines it (the model delta family asks the model,
        FRL refuses a CPU); this default only refuses a client of its own."""
        if self.client_step is None:
            return f"{type(self).__name__} trains its clients in its own client_update"
        return None


__all__ = [
    "ClientChunk",
    "ClientStep",
    "DescribedClient",
    "StartParts",
    "TrainedClients",
    "train_one",
    "trained_tensors",
]
