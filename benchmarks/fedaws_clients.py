"""The clients phase of a FedAwS round, for benchmarks/fedaws_phases.py: raysim's client task
body against a plain torch loop, each over the same clients on the same worker processes.

A round's sampled clients are split into one contiguous half per worker process (one torch
thread each: both cores busy, as Ray's client workers keep them). Per repetition each worker
runs its half twice, once per system, in an order that alternates:

  raysim  `raysim.core.clients.train_clients`, the body of a Ray client task: per client the
          dense layers reset from theta, the touched bag rows gathered, local SGD, the message
          (dense delta, bag rows, class row) checked and folded into the task's exact
          fixed-point sum; the parent then adds the workers' sums (`merge_reduced`), as the
          server does with tasks' results.
  floor   the same per-client work written directly: reset from theta's dense part, gather,
          the same model, loss and torch SGD, then `acc += w * (params - theta)` in float32
          and the bag and class rows appended; the parent adds the workers' float sums.

Both hand their result back through the pool (pickled, as a task's result crosses Ray), and
the phase is timed in the parent from sending the work to holding the summed result. The mean
dense delta of the two is compared, so a floor that skipped work would show.

The workers are spawned (not forked: the parent has run torch's thread pool) and build the run
themselves from the configuration: the dataset, the split and the seeded model (theta).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from raysim.algorithms.fedaws import positive_loss
from raysim.assembly import plan_run
from raysim.core.algorithm import RunContext
from raysim.core.clients import train_clients
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.server import build_algorithm
from raysim.data.datasets import load_dataset
from raysim.models.layout import layout_of
from raysim.models.vector import build_model, cached_model, get_vector
from raysim.seeds import client_generator

_WORKER: dict = {}


def start_worker(config_dict: dict) -> None:
    """Pool initializer: build the run (dataset, split, context, algorithm, theta) once."""
    from raysim import config as config_module

    torch.set_num_threads(1)
    config = config_module.from_dict(config_dict)
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    split, ctx = plan.split, plan.ctx
    algorithm = build_algorithm(ctx)
    model = cached_model(ctx)
    _WORKER.update(
        config=config,
        dataset=dataset,
        split=split,
        ctx=ctx,
        algorithm=algorithm,
        theta=get_vector(model),
        floor=PlainClients(ctx, algorithm),
    )


def theta_checksum(_: int = 0) -> float:
    """A checksum of the worker's theta (the parent compares it with its server's)."""
    return float(np.asarray(_WORKER["theta"], dtype=np.float64).sum())


def run_half(system: str, round_index: int, token: int, client_ids, rows) -> tuple:
    """One worker's half of a round's clients through `system`; (result, seconds)."""
    from raysim.algorithms.fedaws_wire import Broadcast, ClassRow

    worker = _WORKER
    dataset, split, ctx = worker["dataset"], worker["split"], worker["ctx"]
    started = time.perf_counter()
    if system == "raysim":
        personal = [ClassRow(int(c), row) for c, row in rows]
        (reduced,) = train_clients(
            ctx,
            worker["algorithm"],
            Broadcast(worker["theta"]),
            dataset.train_x,
            dataset.train_y,
            split.indices,
            split.offsets,
            round_index,
            client_ids,
            personal,
        )
        result = reduced.message
    else:
        result = worker["floor"].run(
            worker["theta"], token, dataset, split, round_index, client_ids, rows
        )
    return result, time.perf_counter() - started


class PlainClients:
    """The floor: FedAwS's client work written as a plain torch loop (see the module)."""

    def __init__(self, ctx: RunContext, algorithm) -> None:
        # Its own instance of the run's network (the model is the workload, not the system).
        self.model = build_model(ctx)
        self.dense = [p for p in self.model.parameters() if p is not self.model.bag.weight]
        self.sizes = [p.numel() for p in self.dense]
        self.clients = ctx.config.clients
        self.class_lr = algorithm.class_lr or self.clients.lr
        self.margin = algorithm.positive_margin
        self.seed = ctx.seed
        self.token = None

    def _load(self, theta: np.ndarray, token: int) -> None:
        """Once per round: theta's dense part (one contiguous copy) and a view of its table."""
        if token == self.token:
            return
        layout = layout_of(self.model)
        self.base = torch.from_numpy(np.ascontiguousarray(theta[layout.dense_index]))
        table = theta[layout.bag_offset : layout.bag_offset + layout.bag_rows * layout.bag_width]
        self.table = torch.from_numpy(table.reshape(layout.bag_rows, layout.bag_width))
        self.bases = list(self.base.split(self.sizes))
        self.token = token

    def run(self, theta, token, dataset, split, round_index, client_ids, rows) -> dict:
        self._load(theta, token)
        model, clients = self.model, self.clients
        total = torch.zeros(len(self.base), dtype=torch.float32)
        totals = list(total.split(self.sizes))
        bag_ids, bag_rows, class_ids, class_rows, weight = [], [], [], [], 0
        for client_id, (class_id, sent_row) in zip(client_ids, rows, strict=True):
            own = split.indices[split.offsets[client_id] : split.offsets[client_id + 1]]
            x = torch.from_numpy(dataset.train_x[own])
            with torch.no_grad():
                for parameter, base in zip(self.dense, self.bases, strict=True):
                    parameter.copy_(base.view_as(parameter))
            touched = model.touched_feature_rows(x)
            table = self.table[torch.from_numpy(touched)].clone().requires_grad_(True)
            local_x = model.remap(x, touched)
            row = torch.tensor(sent_row, requires_grad=True)
            optimizer = torch.optim.SGD(
                [{"params": [*self.dense, table]}, {"params": [row], "lr": self.class_lr}],
                lr=clients.lr,
                momentum=clients.momentum,
                weight_decay=clients.weight_decay,
            )
            generator = client_generator(self.seed, round_index, int(client_id))
            for _ in range(clients.local_epochs):
                order = torch.randperm(len(own), generator=generator)
                for batch in order.split(clients.batch_size):
                    optimizer.zero_grad(set_to_none=True)
                    loss = positive_loss(
                        model.forward_rows(local_x[batch], table), row, self.margin
                    )
                    loss.backward()
                    optimizer.step()
            samples = len(own)
            with torch.no_grad():
                for parameter, base, part in zip(self.dense, self.bases, totals, strict=True):
                    part.add_(parameter.reshape(-1) - base, alpha=samples)
                bag_ids.append(touched)
                bag_rows.append((table - self.table[torch.from_numpy(touched)]) * samples)
                class_ids.append(class_id)
                class_rows.append(row / row.norm())
            weight += samples
        return {
            "weight": weight,
            "dense": total.numpy(),
            "bag_ids": np.concatenate(bag_ids),
            "bag_rows": torch.cat(bag_rows).numpy(),
            "class_ids": np.asarray(class_ids),
            "class_rows": torch.stack(class_rows).numpy(),
        }


def mean_dense_delta(system: str, result: dict) -> np.ndarray:
    """The weighted mean dense delta of a round's summed result (either system's)."""
    scale = float(result["weight"]) * (FIXED_SCALE if system == "raysim" else 1.0)
    return np.asarray(result["dense"], dtype=np.float64) / scale


def merge_floor(parts: list[dict]) -> dict:
    """The parent's sum of the workers' float results (the floor's server side)."""
    merged = dict(parts[0])
    for part in parts[1:]:
        merged["weight"] += part["weight"]
        merged["dense"] = merged["dense"] + part["dense"]
        for key in ("bag_ids", "bag_rows", "class_ids", "class_rows"):
            merged[key] = np.concatenate([merged[key], part[key]])
    return merged
