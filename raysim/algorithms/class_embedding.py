"""What FedAwS and its Softmax oracle share: models f(x) = W g_theta(x) with L2-normalised
instance embeddings g_theta(x) and unit class embeddings w_c (the rows of W).

- `Broadcast`: the round's common payload (theta, plus all of W for the oracle);
- `ClassRow`: a FedAwS client's own payload, the row of the one class it holds (and that
  class's id, which the task's reducer holds the client's message to);
- `check_message`: why a client message is malformed (checked in the task);
- `ClassEmbeddingMethod`: the worker-side model cache, the client's small local table of the
  embedding-bag rows it touched, the local training loop, the theta part of the message, the
  exact in-task reduction (integer fixed point, raysim.core.fixed_point), the server's theta
  step and the evaluation (P@k, raysim.metrics_xml).

Scale (Amazon-670K: theta 288 MB, W 1.37 GB, 4,000 clients a round): a client never copies the
whole model. Embedding-bag rows are trained in a small local table of the rows the client
touched, so resetting a worker's model between clients costs only the dense layers; a task sums
its clients' contributions before returning, in integer fixed point (2^-32 resolution, far below
float32's resolution of the weights it updates), which makes the sum exact: any packing of
clients into tasks, any number of workers and either backend give the same model bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.mixins import NDArrayOperatorsMixin
from torch import nn

from raysim.config import MAX_LEARNING_RATE
from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.fixed_point import (
    EXACT_FLOAT64,
    FIXED_LIMIT,
    FIXED_SCALE,
    MAX_FIXED_WEIGHT,
    add_fixed_in_place,
    checked_add,
    concat_rows,
    fixed_bound,
    fold_scratch,
    sum_rows_by_id,
    to_fixed_known_peak,
)
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import local_training
from raysim.errors import ConfigError
from raysim.metrics_xml import mean_pairwise_cosine, precision_at_k
from raysim.models.layout import ModelLayout, layout_of
from raysim.models.vector import cached_model, get_vector, set_vector
from raysim.runtime.devices import client_device, server_device, to_numpy


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


@dataclass(frozen=True)
class ClassRow:
    """What the server sends one FedAwS client: the row of the one class it holds. The class
    id is known to both sides (the client holds that class's data), so only the row counts as
    sent; the task's reducer refuses a message that writes any other class's row.

    Array-like (np.asarray gives the row), so code that handles the row alone still works."""

    class_id: int
    row: np.ndarray

    def __wire_nbytes__(self) -> int:
        return int(self.row.nbytes)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.row, dtype=dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.row.shape


class DenseDelta(NDArrayOperatorsMixin):
    """The dense part of a FedAwS/softmax client's message, read where it lies: the worker
    model's dense parameters minus theta's dense part, float32.

    A task's reducer folds it a cache-sized chunk at a time (`read_chunk`: the subtraction,
    the check and the fixed-point conversion of a chunk while it is in cache) instead of
    materialising the 8 MB difference and reading it again. Anything else that touches it
    (np.asarray, indexing, item assignment, arithmetic, numpy functions, any ndarray
    attribute, pickling) first makes it an array of its own, after which it is that array.
    Unmaterialised it is valid while the worker's model still holds this client's parameters,
    i.e. until the next client of the task starts (the task body folds each message before
    that); read later it raises instead of giving another client's values."""

    def __init__(self, model, layout: ModelLayout, base: torch.Tensor) -> None:
        self._model, self._layout, self._base = model, layout, base
        self._client = model._fedaws_client  # which client's parameters these are
        self._arrays = layout.dense_arrays()  # numpy views: no torch call per chunk
        self._base_array = base.numpy()
        self._owned: np.ndarray | None = None  # the materialised difference, once made
        self.shape = (len(base),)
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    def _check_current(self) -> None:
        if self._model._fedaws_client != self._client:
            raise RuntimeError(
                "a client's dense delta was read after the worker model moved on to another "
                "client (fold or copy a message before the next client trains)"
            )

    def _array(self) -> np.ndarray:
        if self._owned is None:
            self._check_current()
            self._owned = self._layout.dense_delta(self._base)
        return self._owned

    def read_chunk(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """The difference's entries [start, stop), float32 (written into `out`, at least
        stop - start long, unless already materialised)."""
        if self._owned is not None:
            return self._owned[start:stop]
        self._check_current()
        part = out[: stop - start]
        base = self._base_array
        for position, count, flat in self._arrays:
            low, high = max(start, position), min(stop, position + count)
            if low < high:
                np.subtract(
                    flat[low - position : high - position],
                    base[low:high],
                    out=part[low - start : high - start],
                )
        return part

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self._array(), dtype=dtype)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        def plain(value):
            return value._array() if isinstance(value, DenseDelta) else value

        if "out" in kwargs:
            kwargs["out"] = tuple(plain(value) for value in kwargs["out"])
        return getattr(ufunc, method)(*(plain(value) for value in inputs), **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        def plain(value):
            if isinstance(value, DenseDelta):
                return value._array()
            if isinstance(value, list | tuple):
                return type(value)(plain(item) for item in value)
            return value

        return func(*plain(args), **{key: plain(value) for key, value in kwargs.items()})

    def __getitem__(self, key):
        return self._array()[key]

    def __setitem__(self, key, value) -> None:
        self._array()[key] = value

    def __getattr__(self, name: str):  # size, nbytes, copy(), astype(), ... of the array
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._array(), name)

    def __reduce__(self):
        return (np.array, (self._array(),))

    def __wire_nbytes__(self) -> int:
        return 4 * len(self)


def forget_payload(model) -> None:
    """`model` (a worker's cached model) was overwritten with other values: it no longer holds
    a payload's theta, nor a client's parameters that a DenseDelta may still read."""
    model._fedaws_token = None
    _next_client(model)


def _next_client(model) -> None:
    """The model's parameters now belong to someone else (`DenseDelta` checks this count)."""
    model._fedaws_client = getattr(model, "_fedaws_client", 0) + 1


def _materialised(message):
    """`message` with a DenseDelta replaced by its array (for checks that read it whole)."""
    if isinstance(message, dict) and isinstance(message.get("dense"), DenseDelta):
        return {**message, "dense": np.asarray(message["dense"])}
    return message


def peak_magnitude(value: np.ndarray) -> float:
    """max |value| of a float array (NaN when it holds a NaN, inf an Inf; 0 when empty), from
    its max and min: no temporary array of |value|."""
    if not value.size:
        return 0.0
    high, low = float(value.max()), float(value.min())
    if math.isnan(high) or math.isnan(low):
        return math.nan
    return max(high, -low)


def _float_array_problem(
    name: str, value, shape: tuple[int, ...], peaks: dict, deferred=()
) -> str | None:
    """Why `value` is not a finite float32 array of `shape`, or None; its peak magnitude goes
    into `peaks[name]` (the range check and the fixed-point conversion reuse it). A name in
    `deferred` is checked for dtype and shape only: its caller checks the values later."""
    readable = isinstance(value, np.ndarray) or (name in deferred and isinstance(value, DenseDelta))
    if not readable or value.dtype != np.float32:
        return f"'{name}' must be a float32 array, got {type(value).__name__}"
    if value.shape != shape:
        return f"'{name}' has shape {value.shape}, expected {shape}"
    if name in deferred:
        return None
    peaks[name] = peak_magnitude(value)
    if not math.isfinite(peaks[name]):
        return _not_finite(name)
    return None


def _not_finite(name: str) -> str:
    return f"'{name}' holds NaN or Inf"


def check_message(message, num_samples, layout: ModelLayout, num_classes: int, dim: int):
    """Why a FedAwS/softmax client message is malformed, or None (checked in the task)."""
    return _message_problem(_materialised(message), num_samples, layout, num_classes, dim, {})


def _message_problem(
    message, num_samples, layout, num_classes: int, dim: int, peaks: dict, deferred=()
):
    """`check_message`, filling `peaks` with each float array's largest magnitude (one pass
    over each array for every check, and none more for its fixed-point conversion). The
    values of the arrays named in `deferred` are left to the caller to check (finite, in
    range; refused with `_not_finite` / `_too_large`'s words)."""
    if not isinstance(message, dict):
        return f"message must be a dict, got {type(message).__name__}"
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        return f"num_samples must be a positive integer, got {num_samples!r}"
    if num_samples >= MAX_FIXED_WEIGHT:  # value x samples would no longer be exact
        shown = f"{num_samples}" if num_samples < 10**15 else f"{len(str(num_samples))} digits"
        return f"num_samples must be below 2^29 = {MAX_FIXED_WEIGHT:,}, got {shown}"
    dense_size = layout.size if layout.bag is None else len(layout.dense_index)
    problem = _float_array_problem("dense", message.get("dense"), (dense_size,), peaks, deferred)
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
            "bag_rows", message.get("bag_rows"), (len(ids), layout.bag_width), peaks
        )
        if problem:
            return problem
    if "row" in message:
        problem = _float_array_problem("row", message["row"], (dim,), peaks)
        if problem:
            return problem
        cls = message.get("class")
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < num_classes:
            return f"'class' must be a class id in [0, {num_classes}), got {cls!r}"
    if "classes" in message:
        problem = _float_array_problem("classes", message["classes"], (num_classes, dim), peaks)
        if problem:
            return problem
    for key in ("dense", "bag_rows", "row", "classes"):
        weight = 1 if key == "row" else num_samples  # rows are averaged per class, unweighted
        if key in peaks and peaks[key] * weight * FIXED_SCALE >= FIXED_LIMIT:
            return _too_large(key)
    return None


def _too_large(key: str) -> str:
    return f"'{key}' too large for exact aggregation (did local training diverge?)"


def normalize_rows(rows: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(rows.astype(np.float64), axis=-1, keepdims=True)
    return (rows / np.maximum(norms, 1e-12)).astype(np.float32)


class ClassEmbeddingMethod:
    """What FedAwS and the softmax oracle share: model layout, exact reduction, evaluation."""

    default_aggregator = "weighted_mean"  # unused: these methods reduce their own updates

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
        rng = np.random.default_rng([ctx.seed, 0xC1A55])
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
        _next_client(model)  # earlier clients' DenseDelta messages are no longer valid
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
            device=x.device,
        )

    def _theta_message(self, model, layout, broadcast, touched, table) -> dict:
        """The theta part of a client's message: dense delta (+ touched bag rows' delta)."""
        theta = broadcast.theta
        base = model._fedaws_dense
        if base.device.type == "cpu":  # read by the task's reducer in chunks (DenseDelta)
            message = {"dense": DenseDelta(model, layout, base)}
        else:  # one copy from the GPU
            message = {"dense": layout.dense_delta(base)}
        if layout.bag is not None:
            with torch.no_grad():
                rows = to_numpy(table) - layout.bag_row_slice(theta, touched)
            message["bag_ids"] = touched.astype(np.int32)
            message["bag_rows"] = rows.astype(np.float32)
        return message

    # --- exact reduction --------------------------------------------------------------------------
    def task_reducer(self, ctx: RunContext) -> _Reducer:
        model = cached_model(ctx)
        return _Reducer(layout_of(model), ctx.num_classes, self._check_model(ctx, model))

    def merge_reduced(self, accumulated: dict | None, message: dict, ctx: RunContext) -> dict:
        """Two tasks' exact sums added; every int64 sum is checked against wrap-around through
        the magnitude bounds the messages carry (raysim.core.fixed_point)."""
        if accumulated is None:
            return message
        bounds_a, bounds_m = accumulated["bounds"], message["bounds"]
        out = {"weight": accumulated["weight"] + message["weight"]}
        bounds = {}
        out["dense"], bounds["dense"] = checked_add(
            accumulated["dense"], bounds_a["dense"], message["dense"], bounds_m["dense"], "'dense'"
        )
        for ids_key, rows_key in (("bag_ids", "bag_rows"), ("class_ids", "class_rows")):
            ids = np.concatenate([accumulated[ids_key], message[ids_key]])
            rows = np.concatenate([accumulated[rows_key], message[rows_key]])
            out[ids_key], out[rows_key], bounds[rows_key] = sum_rows_by_id(
                ids, rows, bounds_a[rows_key] + bounds_m[rows_key], f"'{rows_key}'"
            )
        if "class_counts" in accumulated:
            ids = np.concatenate([accumulated["class_ids_c"], message["class_ids_c"]])
            counts = np.concatenate([accumulated["class_counts"], message["class_counts"]])
            out["class_ids_c"], out["class_counts"], _ = sum_rows_by_id(
                ids, counts, None, "'class_counts'"
            )
        if accumulated.get("classes_dense") is not None:
            out["classes_dense"], bounds["classes_dense"] = checked_add(
                accumulated["classes_dense"],
                bounds_a["classes_dense"],
                message["classes_dense"],
                bounds_m["classes_dense"],
                "'classes'",
            )
        else:
            out["classes_dense"], bounds["classes_dense"] = None, 0
        out["bounds"] = bounds
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
        """P@1/3/5 against all true labels (XML; y padded with -1) or accuracy (one label),
        on the first `eval_max_points` test points; plus the mean pairwise cosine of W."""
        device = server_device(ctx)  # the server's GPU when it has one
        model = cached_model(ctx, device)
        set_vector(model, state.arrays["params"])
        forget_payload(model)
        classes = torch.from_numpy(state.arrays["class_embeddings"]).to(device)
        count = min(len(x), self.eval_max_points)
        tops = []
        model.eval()
        with torch.no_grad():
            for start in range(0, count, 512):
                batch = torch.from_numpy(np.array(x[start : min(count, start + 512)]))
                scores = model(batch.to(device)) @ classes.T
                tops.append(to_numpy(torch.topk(scores, min(5, scores.shape[1]), dim=1).indices))
        model.train()
        top = np.concatenate(tops) if tops else np.zeros((0, 5), dtype=np.int64)
        result = precision_at_k(top, np.asarray(y[:count]))
        if np.asarray(y).ndim == 1:
            result = {"accuracy": result["p@1"], **result}
        result["class_cosine_mean"] = mean_pairwise_cosine(state.arrays["class_embeddings"])
        return result


class _Reducer:
    """Sums one task's client messages exactly (integer fixed point).

    Each sum carries an upper bound of its largest magnitude, the sum of its terms' bounds (a
    Python int; raysim.core.fixed_point): while it fits int64 the sums are plain numpy adds,
    beyond it they are checked exactly and SumOverflowError is raised rather than letting
    int64 wrap around. The bounds travel with the result to `merge_reduced`.

    The dense sum (the one full-size array a FedAwS client sends) is kept in float64 while its
    bound is at most 2^53: every term is an integer (round(value x weight x 2^32)) and every
    partial sum an integer below 2^53, so float64 adds them exactly, in place, without an
    int64 conversion per client; beyond 2^53 it moves to int64 once. Bit for bit the int64
    sum either way."""

    def __init__(self, layout: ModelLayout, num_classes: int, dim: int) -> None:
        self.layout, self.num_classes, self.dim_expected = layout, num_classes, dim
        self.weight = 0
        self.dense: np.ndarray | None = None  # float64 (exact, see above) or int64
        self.bag_ids: list[np.ndarray] = []
        self.bag_rows: list[np.ndarray] = []
        self.class_ids: list[int] = []
        self.class_rows: list[np.ndarray] = []
        self.classes_dense: np.ndarray | None = None
        self.bag_width = 0
        self.dim = 0
        self._scratch = fold_scratch()
        self.bounds = {"dense": 0, "bag_rows": 0, "class_rows": 0, "classes_dense": 0}

    def add(self, update: ClientUpdate, sent=None) -> str | None:
        """Fold one client's message in; returns why it was refused instead (None: folded).

        `sent`: what the server sent this client (its personal payload, which the task body
        passes along; None: none). A FedAwS client was sent its own class's row (`ClassRow`)
        and may write back only that row: the class id is the server's, never the client's."""
        # The dense sum stays float64 (see the class) while even a term at the limit keeps it
        # exact; then the dense values are checked as they are folded in (one pass over them).
        fold_dense = (self.dense is None or self.dense.dtype == np.float64) and (
            self.bounds["dense"] + FIXED_LIMIT <= EXACT_FLOAT64
        )
        peaks: dict[str, float] = {}
        message = update.message if fold_dense else _materialised(update.message)
        problem = _message_problem(
            message,
            update.num_samples,
            self.layout,
            self.num_classes,
            self.dim_expected,
            peaks,
            ("dense",) if fold_dense else (),
        )
        if problem is not None:
            return problem
        weight = int(update.num_samples)
        if "row" in message and isinstance(sent, ClassRow) and message["class"] != sent.class_id:
            return (
                f"'class' is {message['class']}, but this client holds class {sent.class_id} "
                f"(a client may only send its own class's row)"
            )
        # Every fixed-point term and every sum that can fail first, then the reducer's state:
        # a message whose sum overflows (SumOverflowError) leaves nothing half-folded.
        bounds = dict(self.bounds)
        values = message["dense"]
        dense = None  # the int64 sum, when the float64 one is no longer exact
        if not fold_dense:  # int64 from here on (a float64 sum is exact, hence converted exactly)
            dense, bounds["dense"] = checked_add(
                self.dense.astype(np.int64, copy=False),
                bounds["dense"],
                *to_fixed_known_peak(values, weight, peaks["dense"]),
                "'dense'",
            )
        bag = row = classes = None
        if "bag_ids" in message:
            bag, bag_bound = to_fixed_known_peak(message["bag_rows"], weight, peaks["bag_rows"])
            bounds["bag_rows"] += bag_bound
        if message.get("row") is not None:
            row, row_bound = to_fixed_known_peak(message["row"][None, :], 1, peaks["row"])
            bounds["class_rows"] += row_bound
        if message.get("classes") is not None:
            classes, classes_bound = to_fixed_known_peak(
                message["classes"], weight, peaks["classes"]
            )
            if self.classes_dense is not None:
                classes, classes_bound = checked_add(
                    self.classes_dense, bounds["classes_dense"], classes, classes_bound, "'classes'"
                )
            bounds["classes_dense"] = classes_bound
        if dense is None:  # the exact float64 sum (see the class), which checks the values
            if self.dense is None:
                self.dense = np.zeros(len(values), dtype=np.float64)
            peak = add_fixed_in_place(self.dense, values, weight, self._scratch)
            if not math.isfinite(peak):  # (add_fixed_in_place left the sum as it was)
                return _not_finite("dense")
            if peak * weight * FIXED_SCALE >= FIXED_LIMIT:
                return _too_large("dense")
            bounds["dense"] += fixed_bound(peak, weight)
        else:
            self.dense = dense
        self.weight += weight
        self.bounds = bounds
        if bag is not None:
            self.bag_width = message["bag_rows"].shape[1]
            self.bag_ids.append(message["bag_ids"].astype(np.int64))
            self.bag_rows.append(bag)
        if row is not None:
            self.dim = len(message["row"])
            self.class_ids.append(int(message["class"]))
            self.class_rows.append(row)
        if classes is not None:
            self.classes_dense = classes
        return None

    def result(self) -> dict:
        bounds = dict(self.bounds)
        bag_ids, bag_rows, bounds["bag_rows"] = sum_rows_by_id(
            concat_rows(self.bag_ids, (), np.int64),
            concat_rows(self.bag_rows, (self.bag_width,), np.int64),
            bounds["bag_rows"],
            "'bag_rows'",
        )
        class_ids = np.asarray(self.class_ids, dtype=np.int64)
        class_ids_c, counts, _ = sum_rows_by_id(
            class_ids, np.ones(len(class_ids), dtype=np.int64), len(class_ids), "'class_counts'"
        )
        class_ids, class_rows, bounds["class_rows"] = sum_rows_by_id(
            class_ids,
            concat_rows(self.class_rows, (self.dim,), np.int64),
            bounds["class_rows"],
            "'class_rows'",
        )
        dense = self.dense
        if dense is not None and dense.dtype != np.int64:
            dense = dense.astype(np.int64)  # integers below 2^53: exact
        return {
            "weight": self.weight,
            "dense": dense,
            "bag_ids": bag_ids,
            "bag_rows": bag_rows,
            "class_ids": class_ids,
            "class_rows": class_rows,
            "class_ids_c": class_ids_c,
            "class_counts": counts,
            "classes_dense": self.classes_dense,
            "bounds": bounds,
        }
