"""FedAwS: Federated Averaging with Spreadout (Yu, Rawat, Menon, Kumar; ICML 2020).

Every client holds the data of ONE class and so can only learn from positives. The model is
f(x) = W g_theta(x) with L2-normalised instance embeddings g_theta(x) and class embeddings w_c.

Round t (DESIGN.md §4.3):
  down   theta to every sampled client, and to client i only its own class row w_i;
  client E epochs of SGD on the positive-only squared hinge
         l_pos = max(0, 0.9 - g(x)^T w_y)^2 over (theta, w_i);
  up     the theta delta (embedding-bag rows: only the rows of features the client saw) and
         its new row;
  server theta <- theta + server optimizer(weighted mean of the deltas); rows <- the returned
         rows (never averaged across classes); then one spreadout step on W,
         W <- W - lambda * eta * grad reg(W), with reg the full Eq. 7 (small C) or Eq. 8 with
         negative mining: the k nearest classes of each updated class, found by the sharded
         nearest-class index (raysim.index), margin nu_c = distance to the (k+1)-th.

Baselines, same code: Baseline-1 `spreadout: none` (positive loss only; the class rows
collapse), Baseline-2 `train_class_embeddings: false` (W frozen at its random init), and the
Softmax oracle `fedaws_softmax` (every client sees all of W and trains a full softmax; W is
averaged like theta).

Scale (Amazon-670K: theta 288 MB, W 1.37 GB, 4,000 clients a round): a client never copies the
whole model. Embedding-bag rows are trained in a small local table of the rows the client
touched, so resetting a worker's model between clients costs only the dense layers; a task sums
its clients' contributions before returning, in integer fixed point (2^-32 resolution, far below
float32's resolution of the weights it updates), which makes the sum exact: any packing of
clients into tasks, any number of workers and either backend give the same model bit for bit.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import local_training
from raysim.errors import ConfigError
from raysim.models.vector import build_model, cached_model, get_vector, set_vector

# Fixed-point scale of the exact in-task sums (see module docstring).
FIXED_POINT_BITS = 32
_FIXED_SCALE = float(2**FIXED_POINT_BITS)
# |value * weight| * 2^32 must stay below 2^52 (exact in float64; 2^11 such terms fit int64).
_FIXED_LIMIT = float(2**52)
SPREADOUT_MODES = ("topk", "full", "none")
DISTANCES = ("cosine", "euclidean")


@dataclass(frozen=True)
class Broadcast:
    """The round's common payload: theta, plus (softmax oracle) all class rows.

    `token` identifies this payload on a worker so the worker loads the 288 MB theta into its
    model once per round instead of once per client; it is bookkeeping, not sent data.
    """

    theta: np.ndarray
    token: int
    classes: np.ndarray | None = None

    def __wire_nbytes__(self) -> int:
        return int(self.theta.nbytes) + (0 if self.classes is None else int(self.classes.nbytes))


def to_fixed(values: np.ndarray, weight: int, client_id: int) -> np.ndarray:
    """round(values * weight * 2^32) as int64, exactly (float32 x integer fits float64)."""
    scaled = values.astype(np.float64) * (float(weight) * _FIXED_SCALE)
    if scaled.size:
        peak = float(np.max(np.abs(scaled)))
        if not math.isfinite(peak) or peak >= _FIXED_LIMIT:
            raise ValueError(
                f"client {client_id}: update too large or not finite for exact aggregation "
                f"(max |value x samples| = {peak / _FIXED_SCALE:.3g}; limit 2^20): did local "
                f"training diverge? lower clients.lr"
            )
    return np.rint(scaled).astype(np.int64)


def _float_array_problem(name: str, value, shape: tuple[int, ...]) -> str | None:
    if not isinstance(value, np.ndarray) or value.dtype != np.float32:
        return f"'{name}' must be a float32 array, got {type(value).__name__}"
    if value.shape != shape:
        return f"'{name}' has shape {value.shape}, expected {shape}"
    if not np.isfinite(value).all():
        return f"'{name}' holds NaN or Inf"
    return None


def check_message(message, num_samples, layout: _ModelLayout, num_classes: int, dim: int):
    """Why a FedAwS/softmax client message is malformed, or None (checked in the task)."""
    if not isinstance(message, dict):
        return f"message must be a dict, got {type(message).__name__}"
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        return f"num_samples must be a positive integer, got {num_samples!r}"
    dense_size = layout.size if layout.bag is None else len(layout.dense_index)
    problem = _float_array_problem("dense", message.get("dense"), (dense_size,))
    if problem:
        return problem
    if layout.bag is not None:
        ids = message.get("bag_ids")
        if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
            return "'bag_ids' must be a 1-D integer array"
        if len(ids) and (ids.min() < 0 or ids.max() >= layout.bag_rows - 1):
            return f"'bag_ids' out of range [0, {layout.bag_rows - 1})"
        if len(ids) > 1 and not (np.diff(ids.astype(np.int64)) > 0).all():
            return "'bag_ids' must be strictly increasing"
        problem = _float_array_problem(
            "bag_rows", message.get("bag_rows"), (len(ids), layout.bag_width)
        )
        if problem:
            return problem
    if "row" in message:
        problem = _float_array_problem("row", message["row"], (dim,))
        if problem:
            return problem
        cls = message.get("class")
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < num_classes:
            return f"'class' must be a class id in [0, {num_classes}), got {cls!r}"
    if "classes" in message:
        problem = _float_array_problem("classes", message["classes"], (num_classes, dim))
        if problem:
            return problem
    for key in ("dense", "bag_rows", "row", "classes"):
        value = message.get(key)
        weight = 1 if key == "row" else num_samples  # rows are averaged per class, unweighted
        if isinstance(value, np.ndarray) and value.size:
            if float(np.max(np.abs(value))) * weight * _FIXED_SCALE >= _FIXED_LIMIT:
                return f"'{key}' too large for exact aggregation (did local training diverge?)"
    return None


def _reduce_rows(ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sum int64 rows that share an id (exact, so the order of `ids` does not matter)."""
    if not len(ids):
        return ids.astype(np.int64), rows
    unique, inverse = np.unique(ids, return_inverse=True)
    total = np.zeros((len(unique), *rows.shape[1:]), dtype=np.int64)
    np.add.at(total, inverse, rows)
    return unique, total


def _concat(parts: list[np.ndarray], shape_tail: tuple[int, ...], dtype) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros((0, *shape_tail), dtype=dtype)


class _ModelLayout:
    """Where the embedding-bag table sits in the flat theta vector (if the model has one)."""

    def __init__(self, model: nn.Module) -> None:
        self.bag: nn.EmbeddingBag | None = getattr(model, "bag", None)
        self.embedding_dim = int(getattr(model, "embedding_dim", 0))
        self.dense: list[tuple[torch.Tensor, int, int]] = []  # (tensor, offset, numel)
        self.bag_offset = -1
        offset = 0
        for tensor in model.state_dict(keep_vars=True).values():
            if not tensor.is_floating_point():
                continue
            if self.bag is not None and tensor is self.bag.weight:
                self.bag_offset = offset
            else:
                self.dense.append((tensor, offset, tensor.numel()))
            offset += tensor.numel()
        self.size = offset
        if self.bag is not None:
            self.bag_rows, self.bag_width = self.bag.weight.shape
            self.padding_id = self.bag.padding_idx
            self.dense_index = np.concatenate(
                [np.arange(o, o + n) for _, o, n in self.dense]
            ).astype(np.int64)

    def dense_vector(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1) for t, _, _ in self.dense]).numpy().copy()

    def load_dense(self, theta: np.ndarray) -> None:
        source = torch.from_numpy(np.asarray(theta, dtype=np.float32))
        with torch.no_grad():
            for tensor, offset, count in self.dense:
                tensor.copy_(source[offset : offset + count].view_as(tensor))

    def theta_dense(self, theta: np.ndarray) -> np.ndarray:
        return theta if self.bag is None else theta[self.dense_index]

    def bag_row_slice(self, theta: np.ndarray, ids: np.ndarray) -> np.ndarray:
        table = theta[self.bag_offset : self.bag_offset + self.bag_rows * self.bag_width]
        return table.reshape(self.bag_rows, self.bag_width)[ids]


def _layout_of(model: nn.Module) -> _ModelLayout:
    """The layout of a (cached, per-process) model, computed once."""
    layout = getattr(model, "_fedaws_layout", None)
    if layout is None:
        layout = model._fedaws_layout = _ModelLayout(model)
    return layout


def _normalize_rows(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows.astype(np.float64), axis=-1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


def precision_at_k(scores_top: np.ndarray, label_sets: np.ndarray, ks=(1, 3, 5)) -> dict:
    """P@k = |top-k predictions that are true labels| / k, averaged over points.

    `scores_top`: (n, >= max k) predicted class ids, best first; `label_sets`: (n, L) true
    labels padded with -1 (or (n,) single labels)."""
    if label_sets.ndim == 1:
        label_sets = label_sets[:, None]
    out = {}
    for k in ks:
        top = scores_top[:, :k]
        hits = (top[:, :, None] == label_sets[:, None, :]) & (label_sets[:, None, :] >= 0)
        out[f"p@{k}"] = float(hits.any(axis=2).sum(axis=1).mean() / k) if len(top) else 0.0
    return out


def positive_loss(embeddings: torch.Tensor, row: torch.Tensor, margin: float) -> torch.Tensor:
    """FedAwS's client loss, positives only: mean over the batch of
    max(0, margin - g(x)^T w / |w|)^2 (the row is used as a unit vector)."""
    unit_row = row / row.norm().clamp_min(1e-12)
    return torch.relu(margin - embeddings @ unit_row).pow(2).mean()


class _ClassEmbeddingMethod:
    """What FedAwS and the softmax oracle share: model layout, exact reduction, evaluation."""

    default_aggregator = "weighted_mean"  # unused: these methods reduce their own updates

    def __init__(self, *, class_lr: float | None, eval_max_points: int) -> None:
        if class_lr is not None and not class_lr > 0:
            raise ConfigError(f"'algorithm.class_lr' must be > 0, got {class_lr}")
        if eval_max_points < 1:
            raise ConfigError(f"'algorithm.eval_max_points' must be >= 1, got {eval_max_points}")
        self.class_lr = class_lr
        self.eval_max_points = int(eval_max_points)
        self.server_times: dict[str, float] = {}
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
        rng = np.random.default_rng([ctx.seed, 0xC1A55])
        classes = _normalize_rows(rng.standard_normal((ctx.num_classes, dim)).astype(np.float32))
        stepped = np.concatenate([params, classes.ravel()]) if optimize_classes else params
        slots = server_optimizers.from_config(ctx.config).init(stepped)
        arrays = {"params": params, "class_embeddings": classes}
        return ServerState(0, {**arrays, **server_optimizers.slot_arrays(slots)})

    def _worker_model(self, ctx: RunContext, broadcast: Broadcast):
        """This worker's model holding theta; loaded in full once per payload, after that
        only the dense layers are reset (the bag table is never modified in place)."""
        model = cached_model(ctx)
        layout = _layout_of(model)
        if getattr(model, "_fedaws_token", None) != broadcast.token:
            set_vector(model, broadcast.theta)
            model._fedaws_token = broadcast.token
        else:
            layout.load_dense(broadcast.theta)
        return model, layout

    def _local_table(self, model, layout: _ModelLayout, x: torch.Tensor, theta: np.ndarray):
        """The rows of the bag table this client touches, as a small trainable table, and x
        re-indexed into it: training then never touches (or resets) the full table."""
        touched = model.touched_feature_rows(x)
        table = torch.from_numpy(layout.bag_row_slice(theta, touched).copy())
        return touched, table.requires_grad_(True), model.remap(x, touched)

    @staticmethod
    def _embed(model, layout, x, local_x, table) -> torch.Tensor:
        if layout.bag is None:
            return model(x)
        return model.forward_rows(local_x, table)

    def _train_locally(
        self, model, layout, x, y, local_x, table, generator, optimizer, ctx, batch_loss
    ) -> float:
        """E epochs of minibatches in the client's own shuffled order (raysim.core.training);
        `batch_loss(embedding, batch indices)` is the method's loss. Returns the mean loss."""
        clients = ctx.config.clients

        def loss_fn(batch: torch.Tensor) -> torch.Tensor:
            local_batch = None if local_x is None else local_x[batch]
            return batch_loss(self._embed(model, layout, x[batch], local_batch, table), batch)

        return local_training(
            len(y),
            generator,
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            loss_fn=loss_fn,
            optimizer=optimizer,
        )

    def _theta_message(self, model, layout, broadcast, touched, table) -> dict:
        """The theta part of a client's message: dense delta (+ touched bag rows' delta)."""
        theta = broadcast.theta
        message = {"dense": layout.dense_vector() - layout.theta_dense(theta)}
        if layout.bag is not None:
            with torch.no_grad():
                rows = table.numpy() - layout.bag_row_slice(theta, touched)
            message["bag_ids"] = touched.astype(np.int32)
            message["bag_rows"] = rows.astype(np.float32)
        return message

    # --- exact reduction --------------------------------------------------------------------------
    def task_reducer(self, ctx: RunContext) -> _Reducer:
        model = cached_model(ctx)
        return _Reducer(_layout_of(model), ctx.num_classes, self._check_model(ctx, model))

    def merge_reduced(self, accumulated: dict | None, message: dict, ctx: RunContext) -> dict:
        if accumulated is None:
            return message
        out = {"weight": accumulated["weight"] + message["weight"]}
        out["dense"] = accumulated["dense"] + message["dense"]
        for ids_key, rows_key in (("bag_ids", "bag_rows"), ("class_ids", "class_rows")):
            ids = np.concatenate([accumulated[ids_key], message[ids_key]])
            rows = np.concatenate([accumulated[rows_key], message[rows_key]])
            out[ids_key], out[rows_key] = _reduce_rows(ids, rows)
        if "class_counts" in accumulated:
            ids = np.concatenate([accumulated["class_ids_c"], message["class_ids_c"]])
            counts = np.concatenate([accumulated["class_counts"], message["class_counts"]])
            out["class_ids_c"], out["class_counts"] = _reduce_rows(ids, counts)
        if accumulated.get("classes_dense") is not None:
            out["classes_dense"] = accumulated["classes_dense"] + message["classes_dense"]
        else:
            out["classes_dense"] = None
        return out

    def finish_reduced(self, accumulated: dict, ctx: RunContext) -> dict:
        return accumulated

    def _theta_step(
        self, state: ServerState, aggregate: dict, ctx: RunContext, extra=None
    ) -> tuple[np.ndarray, dict]:
        """theta + server optimizer(weighted mean delta); returns (params, optimizer slots).

        `extra` = (values, mean delta): more parameters (the oracle's W) stepped by the same
        server optimizer, appended after theta; then params holds both."""
        theta = state.arrays["params"]
        total = float(aggregate["weight"]) * _FIXED_SCALE
        layout = _layout_of(cached_model(ctx))
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
        """P@1/3/5 against all true labels (XML; y padded with -1) or accuracy (one label),
        on the first `eval_max_points` test points; plus the mean pairwise cosine of W."""
        model = cached_model(ctx)
        set_vector(model, state.arrays["params"])
        model._fedaws_token = None  # the worker cache no longer holds a payload's theta
        classes = torch.from_numpy(state.arrays["class_embeddings"])
        count = min(len(x), self.eval_max_points)
        tops = []
        model.eval()
        with torch.no_grad():
            for start in range(0, count, 512):
                embedding = model(torch.from_numpy(np.array(x[start : min(count, start + 512)])))
                scores = embedding @ classes.T
                tops.append(torch.topk(scores, min(5, scores.shape[1]), dim=1).indices.numpy())
        model.train()
        top = np.concatenate(tops) if tops else np.zeros((0, 5), dtype=np.int64)
        result = precision_at_k(top, np.asarray(y[:count]))
        if np.asarray(y).ndim == 1:
            result = {"accuracy": result["p@1"], **result}
        result["class_cosine_mean"] = mean_pairwise_cosine(state.arrays["class_embeddings"])
        return result


def mean_pairwise_cosine(rows: np.ndarray) -> float:
    """Mean of w_c . w_c' over pairs c != c' of unit rows, in O(C d):
    (|sum w|^2 - sum |w|^2) / (C (C - 1))."""
    count = len(rows)
    if count < 2:
        return float("nan")
    rows64 = rows.astype(np.float64)
    total = rows64.sum(axis=0)
    return float((total @ total - (rows64 * rows64).sum()) / (count * (count - 1)))


class _Reducer:
    """Sums one task's client messages exactly (integer fixed point)."""

    def __init__(self, layout: _ModelLayout, num_classes: int, dim: int) -> None:
        self.layout, self.num_classes, self.dim_expected = layout, num_classes, dim
        self.weight = 0
        self.dense: np.ndarray | None = None
        self.bag_ids: list[np.ndarray] = []
        self.bag_rows: list[np.ndarray] = []
        self.class_ids: list[int] = []
        self.class_rows: list[np.ndarray] = []
        self.classes_dense: np.ndarray | None = None
        self.bag_width = 0
        self.dim = 0

    def add(self, update: ClientUpdate) -> str | None:
        """Fold one client's message in; returns why it was refused instead (None: folded)."""
        problem = check_message(
            update.message, update.num_samples, self.layout, self.num_classes, self.dim_expected
        )
        if problem is not None:
            return problem
        message, weight, client = update.message, int(update.num_samples), update.client_id
        self.weight += weight
        dense = to_fixed(message["dense"], weight, client)
        self.dense = dense if self.dense is None else self.dense + dense
        if "bag_ids" in message:
            self.bag_width = message["bag_rows"].shape[1]
            self.bag_ids.append(message["bag_ids"].astype(np.int64))
            self.bag_rows.append(to_fixed(message["bag_rows"], weight, client))
        if message.get("row") is not None:
            self.dim = len(message["row"])
            self.class_ids.append(int(message["class"]))
            self.class_rows.append(to_fixed(message["row"][None, :], 1, client))
        if message.get("classes") is not None:
            classes = to_fixed(message["classes"], weight, client)
            self.classes_dense = (
                classes if self.classes_dense is None else self.classes_dense + classes
            )
        return None

    def result(self) -> dict:
        bag_ids, bag_rows = _reduce_rows(
            _concat(self.bag_ids, (), np.int64),
            _concat(self.bag_rows, (self.bag_width,), np.int64),
        )
        class_ids = np.asarray(self.class_ids, dtype=np.int64)
        class_ids_c, counts = _reduce_rows(class_ids, np.ones(len(class_ids), dtype=np.int64))
        class_ids, class_rows = _reduce_rows(
            class_ids, _concat(self.class_rows, (self.dim,), np.int64)
        )
        return {
            "weight": self.weight,
            "dense": self.dense,
            "bag_ids": bag_ids,
            "bag_rows": bag_rows,
            "class_ids": class_ids,
            "class_rows": class_rows,
            "class_ids_c": class_ids_c,
            "class_counts": counts,
            "classes_dense": self.classes_dense,
        }


class FedAwS(_ClassEmbeddingMethod):
    """FedAwS (and its Baseline-1 / Baseline-2 via options); see the module docstring."""

    def __init__(
        self,
        *,
        spreadout: str = "topk",
        lambda_: float = 10.0,
        k: int = 100,
        nu: float = 1.0,
        distance: str = "cosine",
        spreadout_lr: float | None = None,
        positive_margin: float = 0.9,
        train_class_embeddings: bool = True,
        class_lr: float | None = None,
        eval_max_points: int = 5000,
    ) -> None:
        super().__init__(class_lr=class_lr, eval_max_points=eval_max_points)
        if spreadout not in SPREADOUT_MODES:
            raise ConfigError(
                f"'algorithm.spreadout' must be one of {', '.join(SPREADOUT_MODES)}, "
                f"got {spreadout!r}"
            )
        if distance not in DISTANCES:
            raise ConfigError(
                f"'algorithm.distance' must be one of {', '.join(DISTANCES)}, got {distance!r}"
            )
        if not (lambda_ >= 0 and math.isfinite(lambda_)):
            raise ConfigError(f"'algorithm.lambda' must be a finite number >= 0, got {lambda_}")
        if k < 1:
            raise ConfigError(f"'algorithm.k' must be >= 1, got {k}")
        if not (nu > 0 and math.isfinite(nu)):
            raise ConfigError(f"'algorithm.nu' must be a finite number > 0, got {nu}")
        if spreadout_lr is not None and not spreadout_lr > 0:
            raise ConfigError(f"'algorithm.spreadout_lr' must be > 0, got {spreadout_lr}")
        if not 0 < positive_margin <= 2:
            raise ConfigError(
                f"'algorithm.positive_margin' must be in (0, 2], got {positive_margin}"
            )
        self.spreadout = spreadout if train_class_embeddings else "none"
        self.lambda_ = float(lambda_)
        self.k = int(k)
        self.nu = float(nu)
        self.distance = distance
        self.spreadout_lr = spreadout_lr
        self.positive_margin = float(positive_margin)
        self.train_class_embeddings = bool(train_class_embeddings)
        self._index = None
        self._index_round = -1

    # --- server -----------------------------------------------------------------------------------
    def init_server(self, ctx: RunContext) -> ServerState:
        model = build_model(ctx)
        dim = self._check_model(ctx, model)
        if self.spreadout == "topk" and self.k >= ctx.num_classes - 1:
            raise ConfigError(
                f"'algorithm.k' must be < num_classes - 1 = {ctx.num_classes - 1} (the "
                f"(k+1)-th nearest class sets the margin), got {self.k}"
            )
        return self._initial_state(ctx, model, dim, optimize_classes=False)

    def server_payload(self, state: ServerState) -> Broadcast:
        return Broadcast(state.arrays["params"], uuid.uuid4().int & ((1 << 63) - 1))

    def client_payload(self, state: ServerState, client_ids: np.ndarray, client_classes):
        """Only each client's own class row goes down (DESIGN §4.3)."""
        if len(client_classes) and client_classes.min() < 0:
            bad = int(client_ids[np.flatnonzero(client_classes < 0)[0]])
            raise ConfigError(
                f"FedAwS needs one class per client (partition.name: one_class); client {bad} "
                f"holds several classes or no data"
            )
        rows = state.arrays["class_embeddings"][client_classes]
        return list(rows)

    # --- client -----------------------------------------------------------------------------------
    def client_update(
        self, payload, x: torch.Tensor, y: torch.Tensor, client_id, generator, ctx
    ) -> ClientUpdate:
        broadcast, own_row = payload
        clients = ctx.config.clients
        model, layout = self._worker_model(ctx, broadcast)
        touched = table = local_x = None
        params = [p for p in model.parameters() if layout.bag is None or p is not layout.bag.weight]
        if layout.bag is not None:
            touched, table, local_x = self._local_table(model, layout, x, broadcast.theta)
            params.append(table)
        row = torch.tensor(np.asarray(own_row, dtype=np.float32), requires_grad=True)
        groups = [{"params": params}]
        if self.train_class_embeddings:
            groups.append({"params": [row], "lr": self.class_lr or clients.lr})
        optimizer = torch.optim.SGD(
            groups, lr=clients.lr, momentum=clients.momentum, weight_decay=clients.weight_decay
        )
        mean_loss = self._train_locally(
            model,
            layout,
            x,
            y,
            local_x,
            table,
            generator,
            optimizer,
            ctx,
            lambda embedding, batch: positive_loss(embedding, row, self.positive_margin),
        )
        message = self._theta_message(model, layout, broadcast, touched, table)
        if self.train_class_embeddings:
            message["class"] = int(y[0]) if len(y) else -1
            message["row"] = _normalize_rows(row.detach().numpy()[None, :])[0]
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            message=message,
            metrics={"loss": mean_loss},
        )

    # --- server update ----------------------------------------------------------------------------
    def server_update(self, state: ServerState, aggregate: dict, ctx: RunContext) -> ServerState:
        params, slots = self._theta_step(state, aggregate, ctx)
        classes = state.arrays["class_embeddings"]
        if self.train_class_embeddings and len(aggregate["class_ids"]):
            classes = classes.copy()
            ids = aggregate["class_ids"]
            counts = aggregate["class_counts"].astype(np.float64)[:, None]
            # Rows are written back, never averaged across classes (clients sharing a class
            # have their returned rows averaged).
            classes[ids] = _normalize_rows(aggregate["class_rows"] / (_FIXED_SCALE * counts))
            classes = self._spreadout_step(classes, ids, state.round, ctx)
        return ServerState(
            state.round + 1,
            {
                "params": params,
                "class_embeddings": classes,
                **server_optimizers.slot_arrays(slots),
            },
        )

    def _spreadout_step(
        self, classes: np.ndarray, updated: np.ndarray, round_index: int, ctx: RunContext
    ) -> np.ndarray:
        from raysim.algorithms import spreadout as reg

        if self.spreadout == "none" or self.lambda_ == 0:
            return classes
        step = self.lambda_ * (self.spreadout_lr or ctx.config.clients.lr)
        if self.spreadout == "full":
            started = time.perf_counter()
            _, grad = reg.spreadout_full(classes, self.nu, self.distance)
            classes = _normalize_rows(classes - step * np.asarray(grad, dtype=np.float32))
            self.server_times["spreadout_s"] = time.perf_counter() - started
            return classes
        started = time.perf_counter()
        index = self._synced_index(classes, updated, round_index, ctx)
        neighbor_ids, neighbor_nu = reg.mine_negatives(
            index, classes, updated, self.k, self.distance
        )
        self.server_times["index_s"] = time.perf_counter() - started
        started = time.perf_counter()
        _, grad_rows, grad_ids = reg.spreadout_topk(
            classes, updated, neighbor_ids, neighbor_nu, self.distance
        )
        classes[grad_ids] = _normalize_rows(
            classes[grad_ids] - step * np.asarray(grad_rows, dtype=np.float32)
        )
        self.server_times["spreadout_s"] = time.perf_counter() - started
        started = time.perf_counter()
        index.update(grad_ids, classes[grad_ids])  # keep the index equal to W
        self.server_times["index_s"] += time.perf_counter() - started
        return classes

    def _synced_index(self, classes, updated, round_index: int, ctx: RunContext):
        """The nearest-class index, holding exactly `classes` (rebuilt when new or stale).

        Trained indexes retrain themselves (faiss IVF: every `index.retrain_every` updates)."""
        settings = ctx.config.index
        if self._index is None:
            import ray

            from raysim.index import build_index

            options = dict(settings.options)
            if settings.backend == "faiss_ivf":
                options.setdefault("retrain_every", settings.retrain_every)
            # One shard lives inside the server; several are Ray actors (on the Ray backend).
            self._index = build_index(
                settings.backend,
                len(classes),
                classes.shape[1],
                shards=settings.shards,
                use_ray=settings.shards > 1
                and ray.is_initialized()
                and ctx.config.runtime.backend == "ray",
                num_cpus=settings.num_cpus,
                num_gpus=settings.num_gpus,
                **options,
            )
        if self._index_round != round_index:  # new, or the state was restored
            self._index.reset(classes)
        else:
            self._index.update(updated, classes[updated])
        self._index_round = round_index + 1
        return self._index

    def state_restored(self, state: ServerState, ctx: RunContext) -> None:
        self._index_round = -1  # rebuilt from the restored W at the next round

    def shutdown(self) -> None:
        if self._index is not None and hasattr(self._index, "close"):
            self._index.close()
        self._index = None


class FedAwSSoftmax(_ClassEmbeddingMethod):
    """The Softmax oracle: every client gets theta AND all of W and minimises the full softmax
    cross-entropy over all classes (logits = scale * g(x)^T w_c, unit vectors); theta and W are
    both averaged (FedAvg). Not possible in the real one-class setting, which is the point."""

    def __init__(
        self, *, scale: float = 16.0, class_lr: float | None = None, eval_max_points: int = 5000
    ) -> None:
        super().__init__(class_lr=class_lr, eval_max_points=eval_max_points)
        if not (scale > 0 and math.isfinite(scale)):
            raise ConfigError(f"'algorithm.scale' must be a finite number > 0, got {scale}")
        self.scale = float(scale)

    def init_server(self, ctx: RunContext) -> ServerState:
        model = build_model(ctx)
        # One server optimizer over theta and W (its slots cover both, theta first).
        return self._initial_state(ctx, model, self._check_model(ctx, model), True)

    def server_payload(self, state: ServerState) -> Broadcast:
        return Broadcast(
            state.arrays["params"],
            uuid.uuid4().int & ((1 << 63) - 1),
            state.arrays["class_embeddings"],
        )

    def client_update(
        self, payload: Broadcast, x: torch.Tensor, y: torch.Tensor, client_id, generator, ctx
    ) -> ClientUpdate:
        clients = ctx.config.clients
        model, layout = self._worker_model(ctx, payload)
        touched = table = local_x = None
        params = [p for p in model.parameters() if layout.bag is None or p is not layout.bag.weight]
        if layout.bag is not None:
            touched, table, local_x = self._local_table(model, layout, x, payload.theta)
            params.append(table)
        start_classes = np.asarray(payload.classes, dtype=np.float32)
        classes = torch.tensor(start_classes, requires_grad=True)
        optimizer = torch.optim.SGD(
            [{"params": params}, {"params": [classes], "lr": self.class_lr or clients.lr}],
            lr=clients.lr,
            momentum=clients.momentum,
            weight_decay=clients.weight_decay,
        )

        def softmax_loss(embedding: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
            unit = classes / classes.norm(dim=1, keepdim=True).clamp_min(1e-12)
            return nn.functional.cross_entropy(self.scale * embedding @ unit.T, y[batch])

        mean_loss = self._train_locally(
            model, layout, x, y, local_x, table, generator, optimizer, ctx, softmax_loss
        )
        message = self._theta_message(model, layout, payload, touched, table)
        message["classes"] = classes.detach().numpy() - start_classes
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            message=message,
            metrics={"loss": mean_loss},
        )

    def server_update(self, state: ServerState, aggregate: dict, ctx: RunContext) -> ServerState:
        classes = state.arrays["class_embeddings"]
        total = float(aggregate["weight"]) * _FIXED_SCALE
        mean_delta = (aggregate["classes_dense"] / total).astype(np.float32)
        both, slots = self._theta_step(state, aggregate, ctx, extra=(classes, mean_delta))
        params = both[: len(state.arrays["params"])]
        classes = both[len(params) :].reshape(classes.shape)
        return ServerState(
            state.round + 1,
            {
                "params": params,
                "class_embeddings": _normalize_rows(classes),
                **server_optimizers.slot_arrays(slots),
            },
        )
