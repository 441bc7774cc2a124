"""How many clients one vmapped call holds: `clients.batch_chunk`, or with `auto` (the default)
as many as the device's memory takes, up to a round's clients.

A chunk holds, per client, its parameters a few times over (the stacked start, the gradient,
the momentum buffer, the proximal anchors, the trained copy: 22-40 bytes per parameter,
measured in docs/BATCHED.md) plus the activations of its padded batch. `auto` divides a memory
budget by that estimate:

- on a GPU, DEVICE_SHARE of the device's *total* memory times the task's share of it
  (`clients.num_gpus`, at most 1). Total, not free, memory: on a GPU the chunk is also the
  number of clients every vmapped call holds (cuBLAS picks its kernels by shape), so it must be
  the same in every process of the run, the local backend's and each Ray task's alike, or
  batched Ray would no longer equal batched local bit for bit. Free memory differs between
  processes and moments; the total and the model do not;
- on a CPU, HOST_SHARE of the machine's memory divided among the client slots that can run at
  once. On a CPU the chunk changes no result (kernels do not depend on the count), only speed
  and memory.

and caps it at the clients a round trains (`clients.per_round`), so a round fits one call when
memory allows: a round of 10,000 clients is one vmapped call, not 40 of 256 (on an H200 the fixed
256 made 10,000 clients slower a client than 1,000). The cap is a function of the config only,
never of how a round's clients are packed into tasks.

An embedding table (nn.Embedding / nn.EmbeddingBag: FedAwS's bag) is counted by the rows a
client can touch (its samples x features), not by its full size: a client trains only those.
A bag's pooling counts as activations a gathered row per feature of a padded batch row (the
vmapped driver gathers and sums the rows instead of calling embedding_bag).
"""

from __future__ import annotations

import functools
import math
import os
import weakref

import numpy as np
import torch
from torch import nn

from raysim.core.schedule import clients_per_round

BYTES_PER_PARAMETER = 40  # the largest measured (SGD with momentum and a proximal term)
# Forward outputs kept for the backward pass, their gradients, and one temporary.
ACTIVATION_COPIES = 3
DEVICE_SHARE = 0.5  # of a GPU's memory for one chunk: the rest holds the model, caches, a server
HOST_SHARE = 0.25  # of the machine's memory for the chunks of all client tasks running at once
MIN_AUTO_CHUNK = 1


def chunk_clients(config, device: torch.device, model: nn.Module, input_shape, rows: int, largest):
    """The clients of one vmapped call for this run on `device` (see the module docstring).

    `rows`: the padded batch's rows; `largest`: the split's largest client (samples)."""
    chunk = config.clients.batch_chunk
    if chunk != "auto":
        return int(chunk)
    cap = max(1, clients_per_round(config) + _extra_clients(config))
    per_client = client_bytes(model, tuple(input_shape), rows, int(largest))
    budget = memory_budget(config, device)
    return max(MIN_AUTO_CHUNK, min(cap, budget // max(1, per_client)))


def _extra_clients(config) -> int:
    """Clients a round trains beyond `per_round` (an attack's pool of colluders)."""
    return int(config.attack.pool_size or 0)


def memory_budget(config, device: torch.device) -> int:
    """Bytes one chunk may hold on `device` (see the module docstring)."""
    clients = config.clients
    return _budget(device.type, device.index, float(clients.num_cpus), float(clients.num_gpus))


@functools.lru_cache(maxsize=16)
def _budget(kind: str, index: int | None, num_cpus: float, num_gpus: float) -> int:
    # Once per process and setting: reading the machine's memory (psutil reads /proc) cost
    # 0.6 ms, a fifth of a small round's batched step.
    if kind == "cuda":
        device = torch.device(kind, index) if index is not None else torch.device(kind)
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * DEVICE_SHARE * min(1.0, num_gpus or 1.0))
    import psutil

    slots = max(1, int((os.cpu_count() or 1) // max(num_cpus, 1e-9)))
    return int(psutil.virtual_memory().total * HOST_SHARE / slots)


_CLIENT_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def client_bytes(model: nn.Module, input_shape: tuple[int, ...], rows: int, largest: int) -> int:
    """An upper estimate of one client's bytes in a chunk: its parameters (embedding tables
    by the rows it can touch) and its batch's activations. Computed once per model object
    (a worker's cached model) and shapes."""
    known = _CLIENT_BYTES.setdefault(model, {})
    key = (input_shape, rows, largest)
    if key not in known:
        known[key] = _client_bytes(model, input_shape, rows, largest)
    return known[key]


def _client_bytes(model: nn.Module, input_shape: tuple[int, ...], rows: int, largest: int) -> int:
    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    table_weights = {id(m.weight) for m in tables}
    parameters = sum(
        t.numel()
        for t in model.state_dict(keep_vars=True).values()
        if t.is_floating_point() and id(t) not in table_weights
    )
    features = math.prod(input_shape) if input_shape else 1
    for table in tables:
        touched = min(table.num_embeddings, max(1, largest) * features)
        parameters += touched * table.embedding_dim
    # the vmapped driver pools a bag by gathering a row per feature id and summing them
    # (XMLEmbeddingBag.forward_rows_gathered): features x width values a sample, forward and back
    gathered = sum(features * t.embedding_dim for t in tables if isinstance(t, nn.EmbeddingBag))
    activations = rows * (activation_values(model, input_shape) + features + gathered)
    return BYTES_PER_PARAMETER * parameters + 4 * ACTIVATION_COPIES * activations


_ACTIVATIONS: dict[tuple, int] = {}


def activation_values(model: nn.Module, input_shape: tuple[int, ...]) -> int:
    """Values the leaf modules output for one sample (one forward pass of a zero row on the
    CPU copy's shapes, measured once per architecture)."""
    key = (repr(model), input_shape)  # the architecture: every module and its sizes
    known = _ACTIVATIONS.get(key)
    if known is not None:
        return known
    total = 0

    def count(_module, _inputs, output):
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    hooks = [m.register_forward_hook(count) for m in leaves]
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    dtype = torch.long if _takes_indices(model) else torch.float32
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), dtype=dtype, device=device))
    except Exception:  # noqa: BLE001 - an input it cannot take: count the input alone
        total = 0
    finally:
        for hook in hooks:
            hook.remove()
    _ACTIVATIONS[key] = total
    return total


def _takes_indices(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) for m in model.modules())


def largest_client(offsets: np.ndarray) -> int:
    sizes = np.diff(offsets)
    return int(sizes.max()) if len(sizes) else 0


__all__ = ["chunk_clients", "client_bytes", "memory_budget"]
