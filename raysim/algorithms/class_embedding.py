"""What FedAwS and its Softmax oracle share: models f(x) = W g_theta(x) with L2-normalised
instance embeddings g_theta(x) and unit class embeddings w_c (the rows of W).

`ClassEmbeddingMethod` holds the worker-side model cache, the client's small local table of
the embedding-bag rows it touched, the local training loop, the server's theta step and the
evaluation (P@k, raysim.metrics.xml). What a client sends is in raysim.algorithms.fedaws_wire,
how a task's clients are folded (exactly, in integer fixed point) in
raysim.algorithms.fedaws_reduce; the same numbers with less memory and time (the server's
phases at Amazon-670K scale) in raysim.algorithms.fedaws_fast.

Scale (Amazon-670K: theta 288 MB, W 1.37 GB, 4,000 clients a round): a client never copies the
whole model. Embedding-bag rows are trained in a small local table of the rows the client
touched, so resetting a worker's model between clients costs only the dense layers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from raysim.algorithms.fedaws_bag_batched import bag_batching_problem, train_bag_batched
from raysim.algorithms.fedaws_reduce import TaskReducer, merge_reduced
from raysim.algorithms.fedaws_wire import Broadcast, forget_payload, next_client
from raysim.config import MAX_LEARNING_RATE
from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.batched_training import model_problem, train_batched
from raysim.core.client_step import ClientStep
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import local_training
from raysim.errors import ConfigError
from raysim.metrics.xml import mean_pairwise_cosine, precision_at_k
from raysim.models.devices import client_device, server_device, to_numpy
from raysim.models.layout import ModelLayout, layout_of
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
    """P@1/3/5 against all true labels (XML; y padded with -1) or accuracy (one label), on the
    first `eval_max_points` test points, ranked by `top_classes(embeddings, W, 5)` on
    `device`; plus `pairwise_cosine(W)`, the mean pairwise cosine of the class rows."""
    model = cached_model(ctx, device)
    set_vector(model, state.arrays["params"])
    forget_payload(model)
    weights = state.arrays["class_embeddings"]
    classes = torch.from_numpy(weights).to(device)
    count = min(len(x), method.eval_max_points)
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


class ClassEmbeddingMethod:
    """What FedAwS and the softmax oracle share: model, local training, reduction, evaluation."""

    default_aggregator = "weighted_mean"  # unused: these methods reduce their own updates

    def __init_subclass__(cls, **kwargs) -> None:
        # A subclass writing a client_update of its own (below the method's) trains one client
        # at a time: the batched path runs the method's client (its `client_loss` and messages),
        # not the subclass's. Declared here, once, when the class is made.
        super().__init_subclass__(**kwargs)
        if "client_update" in vars(cls) and "batched_client_updates" not in vars(cls):
            if any("batched_client_updates" in vars(base) for base in cls.__mro__[1:]):
                cls.batched_client_updates = None

    def __init__(self, *, class_lr: float | None, eval_max_points: int) -> None:
        if class_lr is not None and not 0 < class_lr <= MAX_LEARNING_RATE:
            # torch takes it as a float32: 1e308 would crash the first client's step
            raise ConfigError(f"'algorithm.class_lr' must be in (0, 1e4], got {class_lr}")
        if eval_max_points < 1:
            raise ConfigError(f"'algorithm.eval_max_points' must be >= 1, got {eval_max_points}")
        self.class_lr = class_lr
        self.eval_max_points = int(eval_max_points)
        self._worker_token: int | None = None

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

    def _worker_model(self, ctx: RunContext, broadcast: Broadcast, device=None):
        """This worker's model (on `device`; None: the CPU) holding theta; loaded in full once
        per payload, after that only the dense layers are reset (the bag table is never
        modified in place). theta's dense part is kept beside it (`_fedaws_dense`, gathered
        once per payload): each client's reset and delta read it instead of the full theta."""
        model = cached_model(ctx, device)
        layout = layout_of(model)
        if getattr(model, "_fedaws_token", None) != broadcast.token:
            set_vector(model, broadcast.theta)
            dense = torch.from_numpy(np.ascontiguousarray(layout.theta_dense(broadcast.theta)))
            model._fedaws_dense = dense.to(device) if device is not None else dense
            model._fedaws_token = broadcast.token
        else:
            layout.load_dense_from(model._fedaws_dense)
        next_client(model)  # earlier clients' DenseDelta messages are no longer valid
        return model, layout

    def _client_setup(self, ctx: RunContext, broadcast: Broadcast, x: torch.Tensor, y):
        """A client's starting point, on the task's device (its GPU when clients.num_gpus
        reserved one, else the CPU): (device, x, y, model, layout, touched bag rows, their
        trainable table, x re-indexed into it, the parameters to train)."""
        device = client_device(ctx)
        x, y = x.to(device), y.to(device)
        model, layout = self._worker_model(ctx, broadcast, device)
        touched = table = local_x = None
        params = [p for p in model.parameters() if layout.bag is None or p is not layout.bag.weight]
        if layout.bag is not None:
            touched, table, local_x = self._local_table(model, layout, x, broadcast.theta)
            params.append(table)
        return device, x, y, model, layout, touched, table, local_x, params

    def _local_table(self, model, layout: ModelLayout, x: torch.Tensor, theta: np.ndarray):
        """The rows of the bag table this client touches, as a small trainable table, and x
        re-indexed into it: training then never touches (or resets) the full table. Both on
        x's device."""
        touched = model.touched_feature_rows(x)
        table = torch.from_numpy(layout.bag_row_slice(theta, touched).copy()).to(x.device)
        return touched, table.requires_grad_(True), model.remap(x, touched).to(x.device)

    @staticmethod
    def _embed(model, layout, x, local_x, table) -> torch.Tensor:
        if layout.bag is None:
            return model(x)
        return model.forward_rows(local_x, table)

    def _train_locally(
        self, model, layout, x, y, local_x, table, generator, optimizer, ctx, extra
    ) -> float:
        """E epochs of minibatches in the client's own shuffled order (raysim.core.training);
        `extra`: the client's values beside theta, the third argument of the method's
        `client_loss(embeddings, targets, extra)`. Returns the mean loss."""
        clients = ctx.config.clients

        def loss_fn(batch: torch.Tensor) -> torch.Tensor:
            local_batch = None if local_x is None else local_x[batch]
            embeddings = self._embed(model, layout, x[batch], local_batch, table)
            return self.client_loss(embeddings, y[batch], extra)

        return local_training(
            len(y),
            generator,
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            loss_fn=loss_fn,
            optimizer=optimizer,
            device=x.device,
        )

    # --- batched clients (clients.batched; raysim.core.batched_training) --------------------------
    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this run's clients cannot train batched, or None. A method's
        `batched_client_updates` reproduces the `client_update` of the class that defines it;
        a subclass that overrides `client_update` below it trains one client at a time. On a
        model with an embedding bag each client also trains its table of touched rows
        (raysim.algorithms.fedaws_bag_batched, which says when it cannot: on a CPU)."""
        if self.batched_client_updates is None:
            return f"{type(self).__name__} writes a client_update of its own"
        model = cached_model(ctx, client_device(ctx))
        if layout_of(model).bag is not None:
            return bag_batching_problem(model, client_device(ctx))
        return model_problem(model, ctx.input_shape)

    def _train_batched(self, broadcast: Broadcast, batch, ctx: RunContext, extras, extra_lr):
        """Train a chunk of clients from theta plus each one's `extras` (its own values beside
        theta, stepped at `extra_lr`; the method's `client_loss(embeddings, targets, extra)`,
        the loss of a batch its sequential client runs too).
        Returns (theta's dense part; per client, its trained dense part and its trained
        extras (rows of two arrays); the mean losses; each client's bag part of its message,
        `bag_ids` and `bag_rows` as `theta_message` gives them: {} without an embedding
        bag). With an embedding bag, raysim.algorithms.fedaws_bag_batched trains the
        clients' tables of touched rows too."""
        clients = ctx.config.clients
        device = client_device(ctx)
        model = cached_model(ctx, device)
        layout = layout_of(model)
        step = ClientStep.of(
            clients, model=model, loss=self.client_loss, lr=clients.lr, extra_lr=extra_lr
        )
        if layout.bag is not None:
            return train_bag_batched(model, layout, broadcast.theta, batch, extras, step)
        theta = np.asarray(broadcast.theta, dtype=np.float32)
        trained, losses = train_batched(
            step, [np.concatenate([theta, extra.ravel()]) for extra in extras], batch
        )
        width = len(theta)
        return theta, trained[:, :width], trained[:, width:], losses, [{}] * len(batch)

    @staticmethod
    def _batched_update(client_id: int, y, message: dict, loss: float) -> ClientUpdate:
        """A batched client's update. Its dense delta is trained minus theta element by element
        in float32, as `layout.dense_delta` computes it (theta is all dense without a bag)."""
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            vector=message,
            # the sequential loop's loss without steps is 0.0, train_batched's NaN
            metrics={"loss": loss if len(y) else 0.0},
        )

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
