"""Models as flat float32 vectors: building (seeded), caching per process, (un)flattening.

The server state, payloads and updates are flat vectors, so aggregators are plain functions of
arrays and checkpoints are plain .npz files. The vector holds all parameters followed by the
floating-point buffers (e.g. BatchNorm running statistics), in `state_dict` order.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from raysim import registry
from raysim.seeds import model_init_seed

_MODEL_CACHE: dict[str, nn.Module] = {}


# The most parameters a model may have: 2^32 float32 values are 16 GiB, before gradients and
# optimizer state. A config asking for more (say `model.hidden: [1000000000000]`) is a typo,
# and building it would end in an allocation traceback instead of a line naming the key.
MAX_MODEL_PARAMETERS = 2**32
# And at most this share of the machine's memory (physical, or the cgroup's limit) in float32:
# the process holds the model, its gradients, optimizer state and updates at once, so a model
# of more would end in an allocation traceback (mlp hidden [60000, 60000]: 3.6e9 parameters,
# 14 GB) rather than a line naming the options.
MAX_MODEL_MEMORY_SHARE = 0.25


def max_model_parameters() -> int:
    """The parameter bound on this machine: MAX_MODEL_PARAMETERS, or fewer where a quarter of
    its memory holds fewer float32 values."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            memory = min(memory, int(limit))
    except OSError:
        pass
    return min(MAX_MODEL_PARAMETERS, int(memory * MAX_MODEL_MEMORY_SHARE) // 4)


def _build(ctx) -> nn.Module:
    model_config = ctx.config.model
    try:
        if ctx.num_features is not None:  # sparse bag-of-words input: the vocabulary size
            return registry.models.build(
                model_config.name,
                ctx.input_shape,
                ctx.num_classes,
                ctx.num_features,
                **model_config.options,
            )
        return registry.models.build(
            model_config.name, ctx.input_shape, ctx.num_classes, **model_config.options
        )
    except ValueError as error:
        from raysim.errors import ConfigError

        subject = f"model '{model_config.name}'"
        text = str(error)  # a model's own message may already name it: not twice
        raise ConfigError(text if text.startswith(subject) else f"{subject}: {text}") from None


def _check_size(ctx) -> None:
    """Count the model's parameters on the meta device (no memory, no random draws) and refuse
    a model beyond MAX_MODEL_PARAMETERS. A model plug-in that cannot be built there (it
    computes on its tensors while building) is not counted; it is built as usual."""
    from raysim.errors import ConfigError

    try:
        with torch.device("meta"):
            model = _build(ctx)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - not buildable on meta: the real build decides
        return
    count = sum(parameter.numel() for parameter in model.parameters())
    bound = max_model_parameters()
    if count > bound:
        options = ", ".join(f"{k}={v!r}" for k, v in ctx.config.model.options.items())
        raise ConfigError(
            f"model '{ctx.config.model.name}' ({options or 'defaults'}) would have {count:,} "
            f"parameters, more than {bound:,} ({bound * 4 / 2**30:.1f} GiB of float32: at most "
            f"2^32, and a quarter of this machine's memory); check model.hidden and the other "
            "model options"
        )


def build_model(ctx) -> nn.Module:  # ctx: raysim.core.algorithm.RunContext
    """A freshly initialised model; the init depends only on the run seed."""
    _check_size(ctx)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(model_init_seed(ctx.seed))
        return _build(ctx)


def cached_model(ctx, device: torch.device | None = None) -> nn.Module:
    """One model object per (architecture, shapes, device) per worker process, reused across
    clients.

    Clients overwrite all of its values before use, so reuse cannot leak state between clients;
    it only saves rebuilding the module for every client. `device`: where it lives (None: CPU).
    """
    key = ctx.model_key()
    if device is not None and device.type != "cpu":
        key = f"{key}@{device}"
    model = _MODEL_CACHE.get(key)
    if model is None:
        model = build_model(ctx)
        if device is not None and device.type != "cpu":
            model = model.to(device)
        _MODEL_CACHE[key] = model
    return model


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [t for t in model.state_dict(keep_vars=True).values() if t.is_floating_point()]


def get_vector(model: nn.Module) -> np.ndarray:
    with torch.no_grad():
        return (
            torch.cat([t.detach().reshape(-1) for t in _tensors(model)])
            .cpu()  # no-op on the CPU; from a GPU model, one copy of the whole vector
            .numpy()
            # torch.cat wrote new memory that nothing else holds: no second copy is needed
            .astype(np.float32, copy=False)
        )


def vector_size(model: nn.Module) -> int:
    return sum(t.numel() for t in _tensors(model))


def model_layout(ctx):  # -> raysim.core.codecs.VectorLayout
    """The layout of the run's model vector: float32, one segment per tensor (the update
    layout of every method whose clients send a model delta)."""
    from raysim.models.layout import VectorLayout

    sizes = tuple(int(t.numel()) for t in _tensors(cached_model(ctx)))
    return VectorLayout(sum(sizes), np.dtype(np.float32), sizes)


def set_vector(model: nn.Module, vector: np.ndarray) -> None:
    """Copy `vector` into the model (the vector may be a read-only object-store view; the
    model may live on a GPU: copy_ moves each slice there)."""
    array = np.asarray(vector, dtype=np.float32)
    if array.flags.writeable:
        source = torch.from_numpy(array)
    else:  # torch warns that it cannot protect a read-only array; it is only read here
        with warnings.catch_warnings():  # (~5 us, so only when needed)
            warnings.simplefilter("ignore", UserWarning)
            source = torch.from_numpy(array)
    tensors = _tensors(model)
    needed = sum(t.numel() for t in tensors)
    if source.numel() != needed:
        raise ValueError(f"vector has {source.numel()} values, model needs {needed}")
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            count = tensor.numel()
            tensor.copy_(source[offset : offset + count].view_as(tensor))
            offset += count
