"""What every worker of the peer benchmark shares: the exported workload, the model, the clock.

Workers import this file and never raysim: a peer runs in its own virtual environment and sees
only the .npz that run.py exported from raysim's generators (data, client split, per-round
client schedule, each client's batch order, initial weights, hyperparameters).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


@dataclass
class Workload:
    """One exported workload (see run.py's export_workload for how each array is made)."""

    meta: dict[str, Any]
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    offsets: np.ndarray  # client c's rows: indices[offsets[c]:offsets[c + 1]]
    indices: np.ndarray
    schedule: np.ndarray  # [rounds, per_round] client ids, ascending within a round
    order_offsets: np.ndarray  # batch order k = (round * per_round + slot) * epochs + epoch
    order_flat: np.ndarray
    init_params: np.ndarray  # flat float32, floating tensors in state_dict order

    @property
    def rounds(self) -> int:
        return int(self.schedule.shape[0])

    @property
    def per_round(self) -> int:
        return int(self.schedule.shape[1])

    @property
    def epochs(self) -> int:
        return int(self.meta["local_epochs"])

    @property
    def batch_size(self) -> int:
        return int(self.meta["batch_size"])

    @property
    def lr(self) -> float:
        return float(self.meta["lr"])

    def rows(self, client_id: int) -> np.ndarray:
        return self.indices[self.offsets[client_id] : self.offsets[client_id + 1]]

    def client_data(self, client_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.rows(client_id)
        return torch.from_numpy(self.train_x[rows]), torch.from_numpy(self.train_y[rows])

    def slot(self, round_index: int, client_id: int) -> int:
        """Where `client_id` sits in round `round_index`'s schedule."""
        ids = self.schedule[round_index]
        position = int(np.searchsorted(ids, client_id))
        if position >= len(ids) or ids[position] != client_id:
            raise KeyError(f"client {client_id} is not scheduled in round {round_index}")
        return position

    def orders(self, round_index: int, slot: int) -> list[torch.Tensor]:
        """The batch order of each local epoch of the client in (round, slot): raysim's
        torch.randperm draws from that client's generator, one per epoch."""
        first = (round_index * self.per_round + slot) * self.epochs
        return [
            torch.from_numpy(self.order_flat[self.order_offsets[k] : self.order_offsets[k + 1]])
            for k in range(first, first + self.epochs)
        ]


def load_workload(path: str | Path) -> Workload:
    with np.load(path, allow_pickle=False) as data:
        arrays = {key: data[key] for key in data.files}
    meta = json.loads(str(arrays.pop("meta")))
    return Workload(meta=meta, **arrays)


# --- the model: raysim's `mlp` and `lenet`, layer for layer (raysim/models/classic.py) ----------


def _mlp(input_shape: Sequence[int], num_classes: int, hidden: Sequence[int]) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = int(np.prod(input_shape))
    for size in hidden:
        layers += [nn.Linear(width, int(size)), nn.ReLU()]
        width = int(size)
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _lenet(input_shape: Sequence[int], num_classes: int) -> nn.Module:
    features = nn.Sequential(
        nn.Conv2d(int(input_shape[0]), 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
    )
    with torch.no_grad():
        flat = int(features(torch.zeros(1, *input_shape)).numel())
    return nn.Sequential(features, nn.Linear(flat, 128), nn.ReLU(), nn.Linear(128, num_classes))


def build_model(workload: Workload) -> nn.Module:
    """The workload's model with raysim's initial weights (checked tensor by tensor against the
    layout raysim exported, so a drift between the two definitions stops the run)."""
    meta = workload.meta
    shape, classes = meta["input_shape"], int(meta["num_classes"])
    if meta["model"] == "mlp":
        model = _mlp(shape, classes, meta["model_options"].get("hidden", [128]))
    elif meta["model"] == "lenet":
        model = _lenet(shape, classes)
    else:
        raise SystemExit(f"peer benchmark: no peer definition of model {meta['model']!r}")
    layout = [(name, list(t.shape)) for name, t in _tensors(model)]
    expected = [(name, list(shape)) for name, shape in meta["tensors"]]
    if layout != expected:
        raise SystemExit(f"peer model layout {layout} differs from raysim's {expected}")
    set_vector(model, workload.init_params)
    return model


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(k, t) for k, t in model.state_dict(keep_vars=True).items() if t.is_floating_point()]


def set_vector(model: nn.Module, vector: np.ndarray) -> None:
    flat = torch.from_numpy(np.asarray(vector, dtype=np.float32))
    start = 0
    with torch.no_grad():
        for _, tensor in _tensors(model):
            tensor.copy_(flat[start : start + tensor.numel()].view_as(tensor))
            start += tensor.numel()
    if start != flat.numel():
        raise ValueError(f"vector of {flat.numel()} values for a model of {start}")


def get_vector(model: nn.Module) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([t.detach().reshape(-1) for _, t in _tensors(model)]).numpy().copy()


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    orders: list[torch.Tensor],
    lr: float,
    batch_size: int,
) -> float:
    """raysim's local training for FedAvg: plain SGD (no momentum, no weight decay) on the
    mean cross-entropy of each batch, batches cut from each epoch's order; the mean loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    loss_sum, steps = 0.0, 0
    for order in orders:
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach())
            steps += 1
    return loss_sum / max(1, steps)


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy on the test split (raysim.metrics.evaluate_classifier's)."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), 1024):
            logits = model(torch.from_numpy(x[start : start + 1024]))
            labels = torch.from_numpy(y[start : start + 1024])
            correct += int((logits.argmax(dim=1) == labels).sum())
    model.train()
    return correct / max(1, len(y))


class RoundClock:
    """Marks the start of every round and the end of the last; round t's time is
    mark[t + 1] - mark[t] (so a round runs from its start to the start of the next)."""

    def __init__(self) -> None:
        self.marks: list[float] = []

    def mark(self) -> None:
        self.marks.append(time.perf_counter())

    def round_times(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Whatever a framework prints goes to stderr, so the worker's stdout is its JSON line."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def emit(
    system: str,
    round_times: list[float],
    accuracy_value: float,
    params: np.ndarray,
    rounds: int,
    versions: dict[str, str],
    **extra: Any,
) -> None:
    """The worker's one line of stdout; `params`: the final weights as one flat vector (their
    L2 norm goes in the record, a cheap check that the systems ended at the same model)."""
    if len(round_times) != rounds:
        raise SystemExit(f"{system}: measured {len(round_times)} rounds, expected {rounds}")
    record = {
        "system": system,
        "round_s": [round(t, 6) for t in round_times],
        "accuracy": accuracy_value,
        "params_l2": float(np.linalg.norm(np.asarray(params, dtype=np.float64))),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "numpy": np.__version__,
            **versions,
        },
        "torch_threads": torch.get_num_threads(),
        **extra,
    }
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def worker_args(argv: Sequence[str] | None = None, **extra: Any):
    """--workload FILE plus the worker's own options (name=(type, default))."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", required=True, help="the .npz run.py exported")
    for name, (kind, default) in extra.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default)
    return parser.parse_args(argv)
