"""Many clients' local training in one vmapped step: the vmapped driver of a client description
(raysim.core.client_step; its sequential driver runs raysim.core.training.local_training).

With `clients.batched: true`, a task's clients are trained `clients.batch_chunk` at a time
with torch.func: their parameters stacked along a leading clients axis, one
`vmap(grad_and_value(loss))` per local step for the whole chunk, then one SGD step on the
stacked tensors. Each client still sees exactly what the sequential loop
(`raysim.core.training.local_training`) gives it:

- its own batch order: at the start of every epoch `torch.randperm(n, generator=its
  generator)` on the CPU, cut into batches of `batch_size` (the last one shorter);
- its own number of steps, `epochs * ceil(n / batch_size)`: a client whose steps are done is
  masked (`torch.where` keeps its parameters and momentum as they were; nothing it computes
  afterwards reaches them), and a client without samples never steps;
- its own learning rate at every step (the round's base rate through `lr_schedule`, whose
  steps per epoch are the client's own), weight decay, momentum and proximal term.

Every batch is padded to the same number of rows, `ClientBatch.rows` (a function of the split:
min(batch_size, the largest client's size), never of which clients share a chunk); padded
rows carry weight 0 in the client's mean loss. On a GPU every vmapped call also holds exactly
`ClientBatch.slots` clients (empty clients fill a short chunk): the shapes a kernel sees are
then the same whatever the packing, so its choice of algorithm is too.

Determinism: within the batched mode a client's result depends on its own inputs only, never
on which clients share its chunk or its place in it (tests/test_batched_clients.py trains the
same clients in chunks of 1, 2 and 3, in tasks of every packing, and compares with ==). The
elementwise SGD arithmetic uses only correctly rounded single operations (no fused
multiply-add, whose use by torch's vector kernels depends on where an element falls in a
tensor, hence on the chunk's size). Against the sequential path the results agree to float
rounding, not bit for bit: the masked mean, the batched matrix products and the unfused
`p - lr * buf` round differently (docs/BATCHED.md gives the measured tolerance).

This module imports nothing from raysim.algorithms.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raysim.core.client_step import StartParts
from raysim.core.training import scheduled_lr

_PROBLEMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ClientBatch:
    """One chunk of a task's clients, as the engine hands it to an algorithm's
    `batched_client_updates` (plain data: the clients' rows and generators, in client order).

    `rows`: the rows every padded batch holds (min(batch_size, the split's largest client)).
    `slots`: the number of clients every vmapped call holds on a GPU (None: as many as the
    chunk has, on the CPU, where kernels do not change with the count).
    `personal`: each client's personal payload (the algorithm's `client_payload`; FedAwS: its
    own class row), None when the algorithm sends none."""

    client_ids: tuple[int, ...]
    xs: tuple[torch.Tensor, ...]
    ys: tuple[torch.Tensor, ...]
    generators: tuple[torch.Generator, ...]
    rows: int
    slots: int | None = None
    personal: tuple | None = None

    def __len__(self) -> int:
        return len(self.client_ids)


def model_problem(model: nn.Module, input_shape: Sequence[int]) -> str | None:
    """Why `model` cannot be trained under vmap (one line), or None; probed once per model.

    Buffers (BatchNorm's running statistics) are written in place during training, frozen or
    shared parameters would need the optimizer's skipping rules, and a random layer (dropout)
    draws from torch's global generator, which a vmapped call cannot split per client; on a
    CPU, convolutions are refused as slower batched than sequential. The probe runs one vmapped
    forward/backward of two clients on one zero row of `input_shape`."""
    known = _PROBLEMS.get(model, False)
    if known is not False:
        return known
    problem = _probe(model, tuple(int(s) for s in input_shape))
    _PROBLEMS[model] = problem
    return problem


def _probe(model: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    if any(True for _ in model.buffers()):
        return "the model has buffers (e.g. BatchNorm running statistics)"
    names = _parameter_names(model)
    if names is None:
        return "the model shares a tensor between two parameters"
    params = dict(model.named_parameters())
    if not all(params[name].requires_grad for name in names):
        return "the model has frozen parameters"
    if model.training is False:
        return "the model is in eval mode"
    device = next(iter(params.values())).device if params else torch.device("cpu")
    convolutions = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    if device.type == "cpu" and convolutions:
        # vmap turns a convolution with per-client weights into a grouped one, whose CPU
        # kernels (backward above all) are slower than the clients one by one: LeNet, 10
        # clients x 64 samples, 4 steps: 4.2 s batched vs 2.4-3.0 s sequential.
        return "convolutions are slower batched than one client at a time on a CPU"
    stacked = {n: params[n].detach().unsqueeze(0).expand(2, *params[n].shape) for n in names}
    x = torch.zeros((2, 1, *input_shape), device=device)

    def total(p, row):
        return torch.func.functional_call(model, p, (row,)).float().sum()

    try:
        torch.func.vmap(torch.func.grad(total), randomness="error")(stacked, x)
    except Exception as error:  # noqa: BLE001 - any failure means: train it sequentially
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"the model does not run under torch.func.vmap ({first[:160]})"
    return None


def _parameter_names(model: nn.Module) -> list[str] | None:
    """The parameters in the model vector's order (state_dict order, raysim.models.vector),
    or None when two names share one tensor."""
    state = model.state_dict(keep_vars=True)
    floating = [(name, t) for name, t in state.items() if t.is_floating_point()]
    if len({id(t) for _, t in floating}) != len(floating):
        return None
    return [name for name, _ in floating]


def padded_rows(batch_size: int, client_sizes: np.ndarray) -> int:
    """Rows of every padded batch: min(batch_size, the largest client), at least 1. A function
    of the split, so the same for every chunk and packing of a run."""
    largest = int(client_sizes.max()) if len(client_sizes) else 0
    return max(1, min(int(batch_size), largest))


@dataclass(frozen=True)
class _Plan:
    """Every step's rows of the chunk, drawn up front from the clients' generators."""

    index: torch.Tensor  # int64 [steps, slots, rows]: rows of the chunk's concatenated data
    weight: torch.Tensor  # float32 [steps, slots, rows]: 1 for a real row, 0 for padding
    count: torch.Tensor  # float32 [steps, slots]: real rows (1 where none: no division by 0)
    active: torch.Tensor  # bool [steps, slots]: the client takes this step
    lr: torch.Tensor  # float32 [steps, slots]: the client's learning rate at this step
    steps: list[int]  # each real client's number of steps


def _plan(
    sizes: Sequence[int],
    generators: Sequence[torch.Generator],
    slots: int,
    *,
    rows: int,
    batch_size: int,
    epochs: int,
    base_lrs: Sequence[float],
    lr_schedule: str,
) -> _Plan:
    sizes_array = np.asarray(sizes, dtype=np.int64)
    per_epoch = -(-sizes_array // batch_size)
    steps_array = epochs * per_epoch
    steps = [int(k) for k in steps_array]
    total = max(steps, default=0)
    taken = np.zeros(slots, dtype=np.int64)
    taken[: len(sizes)] = steps_array
    active = np.arange(total)[:, None] < taken[None, :]  # [steps, slots]
    starts = np.zeros(slots, dtype=np.int64)
    starts[: len(sizes)] = np.cumsum(sizes_array) - sizes_array
    # Assembled in numpy, whole arrays at once (torch's per-call overhead is several times
    # numpy's; a loop over clients cost ~10 numpy calls a client). A client's rows during its
    # steps are its first row until filled in; rows of steps it does not take stay 0.
    index = np.where(active, starts[None, :], 0)[:, :, None].repeat(rows, axis=2)
    weight = np.zeros((total, slots, rows), dtype=np.float32)
    # The sequential loop's draws, in its order: each client's epochs, one permutation each.
    drawn = [
        torch.randperm(n, generator=generator).numpy()
        for n, generator in zip(sizes, generators, strict=True)
        if n
        for _ in range(epochs)
    ]
    if drawn:
        # Every drawn position p of client c in epoch e lies in batch p // batch_size of that
        # epoch, step e * per_epoch[c] + p // batch_size, at row p % batch_size (only the
        # first `rows` of a batch can be real: rows < batch_size means every client is
        # smaller than a batch).
        segment_slot = np.repeat(np.flatnonzero(sizes_array), epochs)
        segment_epoch = np.arange(len(segment_slot)) % epochs  # 0..epochs-1 per client
        lengths = sizes_array[segment_slot]
        slot_of = np.repeat(segment_slot, lengths)
        epoch_of = np.repeat(segment_epoch, lengths)
        position = np.arange(len(slot_of)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        row_of = position % batch_size
        step_of = epoch_of * per_epoch[slot_of] + position // batch_size
        real = row_of < rows
        slot_of, step_of, row_of = slot_of[real], step_of[real], row_of[real]
        index[step_of, slot_of, row_of] = np.concatenate(drawn)[real] + starts[slot_of]
        weight[step_of, slot_of, row_of] = 1.0
    if lr_schedule == "constant":
        base = np.zeros(slots, dtype=np.float32)
        base[: len(sizes)] = base_lrs
        lr = np.where(active, base[None, :], np.float32(0.0))
    else:
        lr = np.zeros((total, slots), dtype=np.float32)
        for slot in range(len(sizes)):
            lr[: steps[slot], slot] = [
                scheduled_lr(
                    lr_schedule,
                    base_lrs[slot],
                    step,
                    steps_per_epoch=int(per_epoch[slot]),
                    epochs=epochs,
                )
                for step in range(steps[slot])
            ]
    count = torch.from_numpy(np.maximum(weight.sum(axis=2), np.float32(1.0)))  # 0/1 sums: exact
    return _Plan(
        torch.from_numpy(index),
        torch.from_numpy(weight),
        count,
        torch.from_numpy(active),
        torch.from_numpy(lr),
        steps,
    )


def train_batched(
    step, starts: Sequence, batch: ClientBatch
) -> tuple[np.ndarray | torch.Tensor, list[float]]:
    """The vmapped driver of a client description (raysim.core.client_step.ClientStep):
    `batch`'s clients trained together from `starts` (one flat row each: the step's trained
    tensors in order, then its extra values); returns the trained rows (float32, one per
    client, in order; a tensor on the step's device with `step.as_tensor`) and each client's
    mean loss.

    What `train_one` does for one client, for all at once: every step's loss is the client's
    mean of `step.loss` taken on each real row of its batch (a batch of one row, so the very
    function the sequential driver runs), plus 0.5 * proximal_mu * sum ||p - p_0||^2; then
    weight decay, momentum (the first step's buffer is the gradient) and p <- p - lr * buf,
    the extra values at `step.extra_lr`. A client's mean loss is the float sum of its steps'
    losses over its steps, NaN for a client without samples. `step.lr`: one for all or one
    per client. The step's model gives the architecture (and the shared, untrained tensors);
    the values of its trained tensors are not read or changed; the step's `vmapped_model`,
    when it has one, is the network run."""
    model = step.model
    names, tensors = _trained_tensors(model, step.trainable)
    device = step.device
    count = len(batch)
    slots = max(count, batch.slots or 0)
    sizes = [y.shape[0] for y in batch.ys]  # (shape, not len: a Python call per tensor)
    base_lrs = _per_client(step.lr, count)
    if len(starts) != count or len(base_lrs) != count:
        raise ValueError(f"{len(starts)} starts and {len(base_lrs)} rates for {count} clients")
    if any(n != x.shape[0] for n, x in zip(sizes, batch.xs, strict=True)):
        raise ValueError("every client needs as many labels as rows")
    if max(sizes, default=0) and batch.rows < min(step.batch_size, max(sizes)):
        raise ValueError(f"rows={batch.rows} is fewer than a batch of this chunk holds")
    stacked = _stacked_starts(starts, slots, device)
    if not sum(sizes):
        if step.as_tensor:
            return stacked[:count], [float("nan")] * count
        return stacked[:count].cpu().numpy(), [float("nan")] * count
    shapes = {name: tensor.shape for name, tensor in tensors.items()}  # (read now: a bag
    # client's table is resized per chunk, the same tensor object with a new shape)
    width = sum(shape.numel() for shape in shapes.values())
    extra_width = stacked.shape[1] - width
    if extra_width < 0 or (extra_width > 0) != (step.extra_lr is not None):
        raise ValueError(
            f"start rows of {stacked.shape[1]} values for a model of {width} trained values"
            f"{' and extra values' if step.extra_lr is not None else ''}"
        )
    extra_lrs = None
    if extra_width:
        if step.lr_schedule != "constant":
            raise ValueError("extra values need a constant lr_schedule")
        extra_lrs = torch.zeros(slots, dtype=torch.float32)
        extra_lrs[:count] = torch.tensor(_per_client(step.extra_lr, count), dtype=torch.float32)
    plan = _plan(
        sizes,
        batch.generators,
        slots,
        rows=batch.rows,
        batch_size=step.batch_size,
        epochs=step.epochs,
        base_lrs=base_lrs,
        lr_schedule=step.lr_schedule,
    )
    data_x = torch.cat([x for x, n in zip(batch.xs, sizes, strict=True) if n]).to(device)
    data_y = torch.cat([y for y, n in zip(batch.ys, sizes, strict=True) if n]).to(device)
    params, offset = {}, 0
    for name in names:
        size = shapes[name].numel()
        params[name] = stacked[:, offset : offset + size].reshape(slots, *shapes[name])
        offset += size
    if extra_width:
        params[EXTRA] = stacked[:, offset:]
        extra_lrs = extra_lrs.to(device)
    anchors = {name: value.clone() for name, value in params.items()} if step.proximal_mu else None
    network = model if step.vmapped_model is None else step.vmapped_model
    step_fn = _cached_step_function(network, names, step.loss, step.proximal_mu, step.row_loss)
    buffers: dict[str, torch.Tensor] | None = None
    losses = torch.zeros((len(plan.active), slots), dtype=torch.float32)
    on_device = [t.to(device) for t in (plan.index, plan.weight, plan.count, plan.active, plan.lr)]
    index, weight, counts, active, rates = on_device
    for position in range(len(plan.active)):
        rows_of_step = index[position]
        x = data_x[rows_of_step]
        y = data_y[rows_of_step]
        given = {} if step.step_inputs is None else step.step_inputs(params)
        if anchors is None:
            grads, loss = step_fn(params, given, x, y, weight[position], counts[position])
        else:
            grads, loss = step_fn(params, given, anchors, x, y, weight[position], counts[position])
        losses[position] = loss.detach().float().cpu()
        params, buffers = _sgd_step(
            params,
            grads,
            buffers,
            active[position],
            rates[position],
            step.momentum,
            step.weight_decay,
            extra_lrs,
        )
    trained = torch.cat([params[name].reshape(slots, -1) for name in params], dim=1)
    trained = trained[:count].detach()
    if not step.as_tensor:
        trained = trained.cpu().numpy().astype(np.float32, copy=False)
    step_losses = losses.double().numpy()
    means = []
    for slot, steps in enumerate(plan.steps):
        # The sequential loop's float(loss) summed in step order, over the client's own steps.
        total = 0.0
        for value in step_losses[:steps, slot]:
            total += float(value)
        means.append(total / steps if steps else float("nan"))
    return trained, means


EXTRA = "\0extra"  # the key of the extra parameters among the stacked ones (no module's name)

# model -> (its parameters, {trainable: (names, {name: tensor})}): what a step reads of its
# model, found once per worker model instead of twice a chunk through state_dict (~0.1 ms of a
# small round's few milliseconds)
_TRAINED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _trained_tensors(model: nn.Module, trainable) -> tuple[list[str], dict]:
    """(the trained tensors' names in the stacked row's order, each name's tensor) for
    `trainable` (None: every floating tensor, _parameter_names). Looked up again whenever the
    model's parameters are no longer the same objects; the caller reads shapes from the
    tensors at each call (a bag client's table is resized in place)."""
    parameters = tuple(model.parameters())
    held = _TRAINED.get(model)
    if (
        held is None
        or len(held[0]) != len(parameters)
        or any(a is not b for a, b in zip(held[0], parameters, strict=True))
    ):
        held = _TRAINED[model] = (parameters, {})
    key = None if trainable is None else tuple(trainable)
    found = held[1].get(key)
    if found is None:
        names = _parameter_names(model) if key is None else list(key)
        if names is None:
            raise ValueError("the model shares a tensor between two parameters")
        state = model.state_dict(keep_vars=True)
        found = held[1][key] = (names, {name: state[name] for name in names})
    return found


# network -> ((names, loss, proximal_mu, row_loss), its vmapped step): the last step made for
# each network, reused while a chunk asks for the same one (one entry: a method that makes a
# new loss object every round replaces it instead of growing the cache)
_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cached_step_function(network, names, batch_loss, proximal_mu, row_loss):
    key = (tuple(names), batch_loss, float(proximal_mu), row_loss)
    held = _STEPS.get(network)
    if held is None or held[0] != key:
        held = _STEPS[network] = (
            key,
            _step_function(network, names, batch_loss, proximal_mu, row_loss),
        )
    return held[1]


def _stacked_starts(starts: Sequence, slots: int, device: torch.device) -> torch.Tensor:
    """The start rows stacked into [slots, width] float32 on `device`, padding slots zero.

    Every value is written once. A start, or a piece of a `StartParts`, that every client
    shares (FedAvg's global model; theta's dense part beside FedAwS's bag clients' own rows) is
    broadcast into the rows, on a GPU after one copy to it; only what differs between clients
    is stacked on the host. Stacking a shared part on the host and copying the stack would
    move clients x parameters values twice in host memory and once more to a GPU (4,000
    flagship clients a round: 2.1M dense values each, 33 GB). On the CPU the rows are written
    with numpy (a broadcast copy is ~4x faster there than torch's on one thread)."""
    count = len(starts)
    on_host = _rows_written_on_host(device)
    shape = (slots, len(starts[0]))
    stacked = (
        np.empty(shape, dtype=np.float32)
        if on_host
        else torch.empty(shape, dtype=torch.float32, device=device)
    )
    stacked[count:] = 0.0
    offset = 0
    for pieces in _start_columns(starts):
        length = len(pieces[0])
        rows = stacked[:count, offset : offset + length]
        shared = all(_same_values(piece, pieces[0]) for piece in pieces[1:])
        if on_host:
            if shared:
                rows[:] = _host(pieces[0])  # broadcast into every row
            else:
                for row, piece in enumerate(pieces):
                    rows[row] = _host(piece)
        elif shared:
            rows.copy_(_tensor(pieces[0], device))  # broadcast on the device
        elif isinstance(pieces[0], torch.Tensor):
            rows.copy_(torch.stack([piece.detach().reshape(-1) for piece in pieces]))
        else:
            rows.copy_(torch.from_numpy(np.stack([_host(piece) for piece in pieces])))
        offset += length
    return torch.from_numpy(stacked) if on_host else stacked


def _rows_written_on_host(device: torch.device) -> bool:
    """Whether `_stacked_starts` writes numpy rows (the CPU) or device tensors (tests force
    the device way on the CPU to check that both write the same values)."""
    return device.type == "cpu"


def _start_columns(starts: Sequence) -> list[list]:
    """The starts cut into columns of pieces, one piece per client in each: the parts of
    `StartParts` when every start has parts of the same lengths, else the whole rows."""
    first = starts[0]
    if isinstance(first, StartParts):
        lengths = [len(part) for part in first.parts]
        if all(
            isinstance(start, StartParts) and [len(part) for part in start.parts] == lengths
            for start in starts
        ):
            return [[start.parts[k] for start in starts] for k in range(len(lengths))]
    return [list(starts)]


def _same_values(piece, other) -> bool:
    """Whether two start pieces are the same memory (the same object, or numpy views of one
    buffer with the same layout): a shared start, not merely equal values."""
    if piece is other:
        return True
    if isinstance(piece, torch.Tensor) and isinstance(other, torch.Tensor):
        return (
            piece.device == other.device
            and piece.data_ptr() == other.data_ptr()
            and piece.shape == other.shape
            and piece.stride() == other.stride()
            and piece.dtype == other.dtype
        )
    if isinstance(piece, np.ndarray) and isinstance(other, np.ndarray):
        return (
            piece.__array_interface__["data"][0] == other.__array_interface__["data"][0]
            and piece.shape == other.shape
            and piece.strides == other.strides
            and piece.dtype == other.dtype
        )
    return False


def _host(piece) -> np.ndarray:
    """A start piece as a flat numpy array (a tensor on any device: FRL's scores)."""
    if isinstance(piece, torch.Tensor):
        return piece.detach().reshape(-1).cpu().numpy()
    return np.asarray(piece, dtype=np.float32).reshape(-1)


def _tensor(piece, device: torch.device) -> torch.Tensor:
    """A start piece as a flat float32 tensor on `device` (a copy only where needed: a
    read-only array, Ray's zero-copy payload, which torch.from_numpy would warn about)."""
    if isinstance(piece, torch.Tensor):
        return piece.detach().reshape(-1).to(device=device, dtype=torch.float32)
    array = np.asarray(piece, dtype=np.float32).reshape(-1)
    if not array.flags.writeable:
        array = array.copy()
    return torch.from_numpy(array).to(device)


def _per_client(value: float | Sequence[float], count: int) -> list[float]:
    return [float(value)] * count if isinstance(value, (int, float)) else [float(v) for v in value]


def _step_function(model, names, batch_loss, proximal_mu, row_loss=None):
    """vmap(grad_and_value) of one client's step loss over the clients axis; each row's loss
    is `batch_loss` of a batch of that row alone (its mean over one row is the row's loss),
    or `row_loss` of the whole batch when the step gives one (the same values, one call)."""

    def row_losses(outputs, targets, *extra):
        if row_loss is not None:
            return row_loss(outputs, targets, *extra)
        return torch.func.vmap(lambda o, t: batch_loss(o[None], t[None], *extra))(outputs, targets)

    def loss_of(params, given, *rest):
        if proximal_mu:
            anchors, x, y, weight, count = rest
        else:
            x, y, weight, count = rest
        model_params = {n: params[n] for n in names}
        outputs = torch.func.functional_call(model, {**model_params, **given}, (x,))
        if EXTRA in params:
            samples = row_losses(outputs, y, params[EXTRA])
        else:
            samples = row_losses(outputs, y)
        loss = (samples * weight).sum() / count
        if proximal_mu:
            # The sequential loop's proximal term, tensor by tensor in the same order (the
            # optimizer's parameters: the model's, then the extra ones).
            proximal = sum(((params[n] - anchors[n]) ** 2).sum() for n in params)
            loss = loss + 0.5 * proximal_mu * proximal
        return loss

    # Not a vmapped forward and one backward of the summed losses: ~0.2 ms a step cheaper for
    # a small MLP, but an op without a batching rule (a plug-in's model may have one) runs in
    # vmap's fallback, whose per-client `select` puts a zero gradient the size of the whole
    # stack into the backward for every client: quadratic in the chunk (FedAwS's bag clients,
    # when they still pooled with embedding_bag, trained 3.5x slower).
    return torch.func.vmap(torch.func.grad_and_value(loss_of), randomness="error")


def _sgd_step(params, grads, buffers, active, rates, momentum, weight_decay, extra_rates=None):
    """LeanSGD's step on the stacked clients, then the mask: a client not taking this step
    keeps its parameters and momentum exactly. No alpha= arguments: those run as fused
    multiply-adds in torch's vector kernels but not in their scalar tails, so an element's
    rounding would depend on its position in the stacked tensor, i.e. on the chunk. The extra
    parameters (if any) step at `extra_rates`, the rest at `rates`."""
    new_params, new_buffers = {}, {}
    everyone = bool(active.all())  # most steps: no mask needed (where would pick the new value)
    for name, param in params.items():
        shape = (-1,) + (1,) * (param.dim() - 1)
        keep = active.view(shape)
        grad = grads[name]
        if weight_decay != 0:
            grad = grad + param * weight_decay
        if momentum != 0:
            if buffers is None:  # every client's first step is the chunk's step 0
                buffer = grad
            else:
                buffer = buffers[name] * momentum + grad
                buffer = buffer if everyone else torch.where(keep, buffer, buffers[name])
            new_buffers[name] = buffer
            grad = buffer
        rate = extra_rates if name == EXTRA else rates
        stepped = param - grad * rate.view(shape)
        new_params[name] = stepped if everyone else torch.where(keep, stepped, param)
    return new_params, (new_buffers if momentum != 0 else None)


def chunks(count: int, size: int) -> list[range]:
    """Positions of a task's clients in runs of `size` (the last shorter), in client order."""
    return [range(i, min(count, i + size)) for i in range(0, count, max(1, size))]


def batching_refusal(ctx, hooks) -> str | None:
    """Why `clients.batched` cannot batch this run's clients (one line), or None.

    An algorithm opts in with `batched_client_updates(payload, batch, ctx)` and may refuse
    for one configuration with `batching_problem(ctx) -> reason | None` (resolved once in
    AlgorithmHooks). Personal payloads reach it in `ClientBatch.personal`, and an in-task
    reducer folds the batched updates as it folds sequential ones."""
    name = ctx.config.algorithm.name
    if hooks.batched_client_updates is None:
        return f"algorithm '{name}' has no batched client path"
    problem = hooks.batching_problem(ctx) if hooks.batching_problem is not None else None
    return f"algorithm '{name}': {problem}" if problem else None


def batched_updates(*args, **kwargs) -> list | None:
    """`batched_update_chunks` (the same arguments) all at once: one update per client, in
    order; None when the run cannot batch."""
    chunks_of_updates = batched_update_chunks(*args, **kwargs)
    if chunks_of_updates is None:
        return None
    return [update for updates in chunks_of_updates for update in updates]


def batched_update_chunks(
    ctx,
    hooks,
    payload,
    train_x: np.ndarray,
    train_y: np.ndarray,
    indices: np.ndarray,
    offsets: np.ndarray,
    round_index: int,
    client_ids: Sequence[int],
    personal_payloads: Sequence | None = None,
):
    """The task's clients trained a chunk at a time (raysim.core.batch_chunk) through the
    algorithm's `batched_client_updates`: an iterator of each chunk's updates (a list, in
    client order), the next chunk trained only when it is asked for, so a caller that folds
    each list before asking for the next holds one chunk's updates at a time (a GPU's trained
    rows among them); None (after a one-line notice, once per process) when the run cannot
    batch, and the caller trains them one by one.
    `personal_payloads`: one per client of `client_ids` (ClientBatch.personal), or None."""
    from raysim.models.devices import client_device, notice_once

    refusal = batching_refusal(ctx, hooks)
    if refusal is not None:
        notice_once(f"clients.batched: {refusal}; training clients one at a time (docs/BATCHED.md)")
        return None
    from raysim.core.batch_chunk import chunk_clients, largest_client
    from raysim.models.vector import cached_model

    clients = ctx.config.clients
    rows = padded_rows(clients.batch_size, np.diff(offsets))
    device = client_device(ctx)
    chunk = chunk_clients(
        ctx.config,
        device,
        cached_model(ctx, device),
        ctx.input_shape,
        rows,
        largest_client(offsets),
    )
    # On a GPU every call holds `chunk` clients, so cuBLAS sees one shape whatever the
    # packing; on the CPU the kernels' per-client arithmetic does not change with the count.
    slots = chunk if device.type != "cpu" else None
    return _chunk_updates(
        ctx, hooks, payload, train_x, train_y, indices, offsets, round_index, client_ids,
        personal_payloads, rows, chunk, slots,
    )  # fmt: skip


def _chunk_updates(
    ctx, hooks, payload, train_x, train_y, indices, offsets, round_index, client_ids,
    personal_payloads, rows, chunk, slots,
):  # fmt: skip
    from raysim.seeds import client_generators

    for run in chunks(len(client_ids), chunk):
        ids = tuple(int(client_ids[i]) for i in run)
        # The chunk's rows gathered in one pass, then each client's as a view of them (the
        # same values as gathering each client's own, without a numpy call per client).
        row_sets = [indices[offsets[c] : offsets[c + 1]] for c in ids]
        sizes = [len(rows) for rows in row_sets]
        gathered = np.concatenate(row_sets) if row_sets else np.zeros(0, dtype=np.int64)
        chunk_x = torch.from_numpy(train_x[gathered])
        chunk_y = torch.from_numpy(train_y[gathered].astype(np.int64, copy=False))
        batch = ClientBatch(
            client_ids=ids,
            xs=chunk_x.split(sizes),
            ys=chunk_y.split(sizes),
            generators=tuple(client_generators(ctx.seed, round_index, ids)),
            rows=rows,
            slots=slots,
            personal=(
                None if personal_payloads is None else tuple(personal_payloads[i] for i in run)
            ),
        )
        produced = list(hooks.batched_client_updates(payload, batch, ctx))
        if [int(u.client_id) for u in produced] != list(ids):
            raise RuntimeError(
                f"batched_client_updates returned updates of clients "
                f"{[u.client_id for u in produced][:8]} for clients {list(ids)[:8]}"
            )
        del batch  # (nothing of this chunk is kept here while the caller folds it)
        yield produced
        del produced


__all__ = [
    "ClientBatch",
    "batched_update_chunks",
    "batched_updates",
    "batching_refusal",
    "chunks",
    "model_problem",
    "padded_rows",
    "train_batched",
]
