"""What FedAwS and its Softmax oracle share: models f(x) = W g_theta(x) with L2-normalised
instance embeddings g_theta(x) and unit class embeddings w_c (the rows of W).

`ClassEmbeddingMethod` holds the client, described once and run by both drivers
(raysim.core.client_step: one client at a time, or a chunk vmapped), the server's theta step
and the evaluation (P@k, raysim.metrics.xml). What a client sends is in
raysim.algorithms.fedaws_wire, how a task's clients are folded (exactly, in integer fixed
point) in raysim.algorithms.fedaws_reduce; the same numbers with less memory and time (the
server's phases at Amazon-670K scale) in raysim.algorithms.fedaws_fast.

Scale (Amazon-670K: theta 288 MB, W 1.37 GB, 4,000 clients a round): a client never copies the
whole model. Embedding-bag rows are trained in a small table of the rows the client touched
(raysim.algorithms.fedaws_bag_batched), so a client's start costs only the dense layers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from torch import nn

from raysim.algorithms.fedaws_bag_batched import bag_batching_problem, bag_chunk
from raysim.algorithms.fedaws_reduce import TaskReducer, merge_reduced
from raysim.algorithms.fedaws_wire import Broadcast, DenseDelta, PerPayload
from raysim.config import MAX_LEARNING_RATE
from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.batched_training import model_problem
from raysim.core.client_step import (
    ClientChunk,
    ClientStep,
    DescribedClient,
    StartParts,
    TrainedClients,
)
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.state import ClientUpdate, ServerState
from raysim.errors import ConfigError
from raysim.metrics.xml import mean_pairwise_cosine, precision_at_k
from raysim.models.devices import client_device, server_device, to_numpy
from raysim.models.layout import layout_of
from raysim.models.vector import cached_model, get_vector, set_vector
from raysim.seeds import class_rows_rng


def normalize_rows(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows.astype(np.float64), axis=-1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


def returned_class_rows(aggregate: dict) -> np.ndarray:
    """The new rows of the aggregate's classes (`class_ids`): the rows their clients returned,
    averaged per class (never across classes) and re-normalised."""
    counts = aggregate["class_counts"].astype(np.float64)[:, None]
    return normalize_rows(aggregate["class_rows"] / (FIXED_SCALE * counts))


def next_state(state: ServerState, params: np.ndarray, classes: np.ndarray, slots) -> ServerState:
    """The state after `state`: theta, W and the server optimizer's slots."""
    arrays = {"params": params, "class_embeddings": classes}
    return ServerState(state.round + 1, {**arrays, **server_optimizers.slot_arrays(slots)})


def direct_top_classes(embeddings: torch.Tensor, classes: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of each embedding's k best-scoring classes, from the full score matrix."""
    scores = embeddings @ classes.T
    return torch.topk(scores, min(k, scores.shape[1]), dim=1).indices


def evaluate_embeddings(method, state, x, y, ctx, device, top_classes, pairwise_cosine) -> dict:
    """P@1/3/5 against all true labels (XML; y padded with -1) or accuracy (one label), on
    every point of (x, y), or only the first `eval_max_points` when the method sets it,
    ranked by `top_classes(embeddings, W, 5)` on `device`; plus `pairwise_cosine(W)`, the
    mean pairwise cosine of the class rows."""
    model = cached_model(ctx, device)
    set_vector(model, state.arrays["params"])
    weights = state.arrays["class_embeddings"]
    classes = torch.from_numpy(weights).to(device)
    limit = method.eval_max_points
    count = len(x) if limit is None else min(len(x), limit)
    tops = []
    model.eval()
    with torch.no_grad():
        for start in range(0, count, 512):
            batch = torch.from_numpy(np.array(x[start : min(count, start + 512)]))
            tops.append(to_numpy(top_classes(model(batch.to(device)), classes, 5)))
    model.train()
    top = np.concatenate(tops) if tops else np.zeros((0, 5), dtype=np.int64)
    result = precision_at_k(top, np.asarray(y[:count]))
    if np.asarray(y).ndim == 1:
        result = {"accuracy": result["p@1"], **result}
    result["class_cosine_mean"] = pairwise_cosine(weights)
    return result


# The CPU keeps trained rows as numpy arrays (the host fold reads them in cache-sized chunks);
# the tests set this to run the device path's code on the CPU.
ROWS_AS_TENSORS_ON_CPU = False


def rows_stay_on(device: torch.device) -> bool:
    """Whether clients trained on `device` hand back their rows as tensors there."""
    return device.type != "cpu" or ROWS_AS_TENSORS_ON_CPU


# theta's dense part of the latest payload, on the clients' device
_DEVICE_COPY = PerPayload()


def _device_copy(payload, values: np.ndarray, device: torch.device) -> torch.Tensor:
    """`values` (theta's dense part, which every client of the payload starts from) as a
    float32 tensor on `device`, copied once per payload (PerPayload: theta changes in place
    between rounds)."""
    key = (values.__array_interface__["data"][0], len(values), device)
    return _DEVICE_COPY.get(
        payload, key, lambda: torch.from_numpy(np.array(values, dtype=np.float32)).to(device)
    )


class ClassEmbeddingMethod(DescribedClient):
    """What FedAwS and the softmax oracle share: model, the client description, reduction,
    evaluation. A method states what its client trains beside theta (`client_extras`, at
    `extra_lr`), its loss of a batch (`client_loss(embeddings, targets, extra)`) and what it
    sends of those values (`extra_message`); the client itself is written once here, and both
    drivers run it (raysim.core.client_step)."""

    default_aggregator = "weighted_mean"  # unused: these methods reduce their own updates

    def __init__(self, *, class_lr: float | None, eval_max_points: int | None) -> None:
        """`eval_max_points`: evaluate (test and validation) on the first this many points
        only; None evaluates every point."""
        if class_lr is not None and not 0 < class_lr <= MAX_LEARNING_RATE:
            # torch takes it as a float32: 1e308 would crash the first client's step
            raise ConfigError(f"'algorithm.class_lr' must be in (0, 1e4], got {class_lr}")
        if eval_max_points is not None and eval_max_points < 1:
            raise ConfigError(f"'algorithm.eval_max_points' must be >= 1, got {eval_max_points}")
        self.class_lr = class_lr
        self.eval_max_points = None if eval_max_points is None else int(eval_max_points)

    # --- shared setup ---------------------------------------------------------------------------
    def _check_model(self, ctx: RunContext, model: nn.Module) -> int:
        dim = getattr(model, "embedding_dim", None)
        if not isinstance(dim, int):
            raise ConfigError(
                f"algorithm '{ctx.config.algorithm.name}' needs an embedding model (one with "
                f"an `embedding_dim`: xml_embedding_bag, resnet8/32/56); got "
                f"model '{ctx.config.model.name}'"
            )
        return dim

    def _initial_state(
        self, ctx: RunContext, model: nn.Module, dim: int, optimize_classes: bool
    ) -> ServerState:
        """theta from the seeded model, random unit class rows, and the server optimizer's
        slots over theta (or over theta and W when the server also steps W)."""
        params = get_vector(model)
        rng = class_rows_rng(ctx.seed)
        classes = normalize_rows(rng.standard_normal((ctx.num_classes, dim)).astype(np.float32))
        stepped = np.concatenate([params, classes.ravel()]) if optimize_classes else params
        slots = server_optimizers.from_config(ctx.config).init(stepped)
        arrays = {"params": params, "class_embeddings": classes}
        return ServerState(0, {**arrays, **server_optimizers.slot_arrays(slots)})

    # --- the client, described once (raysim.core.client_step) ---------------------------------
    def client_step(self, payload: Broadcast, ctx: RunContext) -> ClientStep:
        """E epochs of minibatch SGD on `client_loss` over theta (on the task's GPU when
        clients.num_gpus reserved one, else the CPU) and the client's extra values (at
        `extra_lr`); momentum and weight decay from `clients`."""
        clients = ctx.config.clients
        device = client_device(ctx)
        return ClientStep.of(
            clients,
            model=cached_model(ctx, device),
            loss=self.client_loss,
            lr=clients.lr,
            extra_lr=self.extra_lr(ctx),
            # a GPU's trained rows stay there: their dense deltas are folded on it
            # (TaskReducer), and only the small rest comes to the host (client_messages)
            as_tensor=rows_stay_on(device),
        )

    def client_chunk(self, payload: Broadcast, step, client_ids, xs, personal, ctx) -> ClientChunk:
        """Each client trains theta and its extra values. With an embedding bag, only the
        rows its samples touch, in a table of its own (raysim.algorithms.fedaws_bag_batched);
        otherwise all of theta."""
        extras = self.client_extras(payload, personal, len(client_ids))
        layout = layout_of(step.model)
        if layout.bag is not None:
            chunk = bag_chunk(step, layout, payload, xs, extras)
        else:
            starts = tuple(StartParts(payload.theta, extra) for extra in extras)
            chunk = ClientChunk(step, tuple(xs), starts, (None,) * len(starts))
        if not step.as_tensor:
            return chunk
        # Rows that stay on the device start there too: theta's dense part, which every client
        # starts from (and measures its delta against, client_messages), copied to the device
        # once per payload, not once per client (8.4 MB a client at full scale).
        shared = _device_copy(payload, chunk.starts[0].parts[0], step.device)
        starts = tuple(StartParts(shared, *start.parts[1:]) for start in chunk.starts)
        return replace(chunk, starts=starts)

    def client_messages(self, payload: Broadcast, trained: TrainedClients, ctx) -> list:
        """Each client's theta delta (the dense part read lazily, `DenseDelta`; with an
        embedding bag the touched rows' ids and deltas), then `extra_message`. Trained rows
        that are tensors on a device (`rows_stay_on`) leave their dense parts there, against
        the start's dense part already there (client_chunk); the rest of the chunk's rows
        (tables and extra values) comes to the host in one copy."""
        layout = layout_of(cached_model(ctx, client_device(ctx)))
        theta = payload.theta
        rows = trained.trained
        on_device = isinstance(rows, torch.Tensor)
        dense_size = len(theta) if layout.bag is None else len(layout.dense_index)
        if on_device:
            rests = rows[:, dense_size:].cpu().numpy()
        updates = []
        for i, client_id in enumerate(trained.client_ids):
            row, note, y = rows[i], trained.notes[i], trained.ys[i]
            start = trained.starts[i]
            rest = rests[i] if on_device else row[dense_size:]
            # against theta's dense values the client started from (on the device with its rows)
            message = {"dense": DenseDelta(row[:dense_size], start.parts[0])}
            if note is None:  # all of theta trained, then the extra values
                extra = rest
            else:
                table_rows, extra = note.split_rest(rest, layout.bag_width)
                message["bag_ids"] = note.touched.astype(np.int32)
                message["bag_rows"] = (
                    table_rows - note.start_rows(start, layout.bag_width)
                ).astype(np.float32)
            message.update(self.extra_message(payload, extra, y))
            loss = trained.losses[i] if len(y) else 0.0  # no steps: a mean loss of 0.0
            updates.append(ClientUpdate(client_id, len(y), message, metrics={"loss": loss}))
        return updates

    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this run's clients cannot train batched, or None. On a model with an embedding
        bag each client also trains its table of touched rows
        (raysim.algorithms.fedaws_bag_batched, which says when it cannot: on a CPU)."""
        model = cached_model(ctx, client_device(ctx))
        if layout_of(model).bag is not None:
            return bag_batching_problem(model, client_device(ctx))
        return model_problem(model, ctx.input_shape)

    # --- exact reduction (raysim.algorithms.fedaws_reduce) ----------------------------------------
    def task_reducer(self, ctx: RunContext) -> TaskReducer:
        model = cached_model(ctx)
        return TaskReducer(layout_of(model), ctx.num_classes, self._check_model(ctx, model))

    def merge_reduced(self, accumulated: dict | None, message: dict, ctx: RunContext) -> dict:
        return merge_reduced(accumulated, message)

    def finish_reduced(self, accumulated: dict, ctx: RunContext) -> dict:
        return accumulated

    # --- server -----------------------------------------------------------------------------------
    def _theta_step(
        self, state: ServerState, aggregate: dict, ctx: RunContext, extra=None
    ) -> tuple[np.ndarray, dict]:
        """theta + server optimizer(weighted mean delta); returns (params, optimizer slots).

        `extra` = (values, mean delta): more parameters (the oracle's W) stepped by the same
        server optimizer, appended after theta; then params holds both."""
        theta = state.arrays["params"]
        total = float(aggregate["weight"]) * FIXED_SCALE
        layout = layout_of(cached_model(ctx))
        delta = np.zeros_like(theta)
        dense = (aggregate["dense"] / total).astype(np.float32)
        if layout.bag is None:
            delta[:] = dense
        else:
            delta[layout.dense_index] = dense
            ids = aggregate["bag_ids"].astype(np.int64)
            table = delta[
                layout.bag_offset : layout.bag_offset + layout.bag_rows * layout.bag_width
            ]
            table.reshape(layout.bag_rows, layout.bag_width)[ids] = (
                aggregate["bag_rows"] / total
            ).astype(np.float32)
        slots = server_optimizers.slots_of(state.arrays)
        if extra is not None:
            theta = np.concatenate([theta, extra[0].ravel()])
            delta = np.concatenate([delta, extra[1].ravel()])
        return server_optimizers.from_config(ctx.config).step(theta, delta, slots)

    # --- evaluation -------------------------------------------------------------------------------
    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        """`evaluate_embeddings` the direct way, on the server's GPU when it has one."""
        device = server_device(ctx)
        return evaluate_embeddings(
            self, state, x, y, ctx, device, direct_top_classes, mean_pairwise_cosine
        )
