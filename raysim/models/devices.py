"""Where client training runs: the task's GPU when it reserved one, else the CPU (with a notice).

`clients.num_gpus` (fractions allowed: 0.25 = four client tasks share one GPU) becomes the Ray
option of every client task; Ray then sets CUDA_VISIBLE_DEVICES for the task, and algorithms that
support devices put the model and the client's batches on `client_device(ctx)`. A request that
cannot be met falls back to the CPU with one clear notice instead of hanging (Ray would keep a
task that asks for a GPU the cluster lacks pending forever) or failing deep inside torch.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np
import torch

_NOTICES: set[str] = set()


def notice_once(message: str) -> None:
    """Print a notice to stderr once per process."""
    if message not in _NOTICES:
        _NOTICES.add(message)
        print(f"raysim: notice: {message}", file=sys.stderr, flush=True)


def task_num_gpus(
    requested: float,
    cluster_gpus: float,
    notice: bool = True,
    key: str = "clients.num_gpus",
    fallback: str = "client tasks train on the CPU",
) -> float:
    """The GPUs a task (or actor) asks Ray for: `requested`, or 0 when the cluster has no GPU."""
    if requested > 0 and cluster_gpus <= 0:
        if notice:
            notice_once(f"{key}={requested:g} but the Ray cluster has no GPUs; {fallback}")
        return 0.0
    return requested


def _device(requested: float, key: str, who: str) -> torch.device:
    if requested > 0:
        if torch.cuda.is_available():
            return torch.device("cuda")
        notice_once(
            f"{key}={requested:g} but no GPU is visible here "
            f"(torch.cuda.is_available() is False); {who} on the CPU"
        )
    return torch.device("cpu")


def client_device(ctx) -> torch.device:  # ctx: raysim.core.algorithm.RunContext
    """cuda when clients.num_gpus > 0 and this process sees a GPU, else cpu (with a notice)."""
    return _device(ctx.config.clients.num_gpus, "clients.num_gpus", "clients train")


def server_device(ctx) -> torch.device:  # ctx: raysim.core.algorithm.RunContext
    """Where the server's tensor work and evaluation run: cuda when server.num_gpus > 0 and
    this process sees a GPU, else cpu (with a notice). The same functions run on either."""
    return _device(ctx.config.server.num_gpus, "server.num_gpus", "the server runs")


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's values as numpy, from any device (no copy for a CPU tensor)."""
    return tensor.detach().cpu().numpy()


def autocast(device: torch.device, enabled: bool):
    """bfloat16 autocast on `device` when `enabled` (an algorithm's `mixed_precision`).

    bfloat16 keeps float32's exponent range, so no loss scaling is needed; parameters, the
    optimizer and the deltas sent to the server stay float32.
    """
    if not enabled:  # entered for every step: a disabled torch.autocast still costs ~3 us
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
