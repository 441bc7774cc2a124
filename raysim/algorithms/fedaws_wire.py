"""What goes over the wire between the server and the clients of FedAwS and its Softmax oracle.

Down: `Broadcast`, the round's common payload (theta; all of W for the oracle), and
`ClassRow`, a FedAwS client's own payload (the row of the one class it holds).
Up: a dict message (raysim.algorithms.class_embedding's `client_messages`): the theta delta
(the dense part, read lazily through `DenseDelta`, plus the embedding-bag rows the client
touched), to which FedAwS adds `class` and `row` (its new class row) and the oracle `classes`
(its delta of W).
`check_message` / `message_problem` say why a message is malformed; the task's reducer
(raysim.algorithms.fedaws_reduce) refuses such a message before folding it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.mixins import NDArrayOperatorsMixin

from raysim.core.fixed_point import FIXED_LIMIT, FIXED_SCALE, MAX_FIXED_WEIGHT, ChunkedValues
from raysim.core.payload import WireSized
from raysim.models.layout import ModelLayout


@dataclass(frozen=True)
class Broadcast(WireSized):
    """The round's common payload: theta, plus (softmax oracle) all class rows."""

    theta: np.ndarray
    classes: np.ndarray | None = None

    def wire_nbytes(self) -> int:
        return int(self.theta.nbytes) + (0 if self.classes is None else int(self.classes.nbytes))


class PerPayload:
    """One value derived from the latest payload, made again for another payload object or
    another key. Keyed by the payload object, not its arrays: FedAwS's server steps theta in
    place (raysim.algorithms.fedaws_fast), so the next round's theta is the same array with new
    values, while every round's payload is a new object (held weakly: the cache never keeps a
    round's payload alive)."""

    def __init__(self) -> None:
        self._payload: weakref.ref | None = None
        self._key = None
        self._value = None

    def get(self, payload, key, make):
        """The value for `payload` and `key` (compared with ==), `make()` when it is not held."""
        if self._payload is None or self._payload() is not payload or self._key != key:
            self._value = make()
            self._payload, self._key = weakref.ref(payload), key
        return self._value


@dataclass(frozen=True)
class ClassRow(WireSized):
    """What the server sends one FedAwS client: the row of the one class it holds. The class
    id is known to both sides (the client holds that class's data), so only the row counts as
    sent; the task's reducer refuses a message that writes any other class's row.

    Array-like (np.asarray gives the row), so code that handles the row alone still works."""

    class_id: int
    row: np.ndarray

    def wire_nbytes(self) -> int:
        return int(self.row.nbytes)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.row, dtype=dtype)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.row.shape


class DenseDelta(NDArrayOperatorsMixin, ChunkedValues, WireSized):
    """The dense part of a FedAwS/softmax client's message, read where it lies: the client's
    trained dense values minus theta's dense part, float32.

    A task's reducer folds it a cache-sized chunk at a time (`read_chunk`: the subtraction,
    the check and the fixed-point conversion of a chunk while it is in cache) instead of
    materialising the 8 MB difference and reading it again. The trained values and the base
    may instead be float32 torch tensors on one device (a GPU client's row, `tensors`): the
    reducer then folds them there (raysim.core.fixed_point.add_fixed_where_they_lie). Anything
    else that touches it (np.asarray, indexing, item assignment, arithmetic, numpy functions,
    any ndarray attribute, pickling) first makes it an array of its own on the host, after
    which it is that array."""

    def __init__(self, trained, base) -> None:
        if tuple(trained.shape) != tuple(base.shape):
            raise ValueError(
                f"trained values {tuple(trained.shape)} against a base of {tuple(base.shape)}"
            )
        on_device = isinstance(trained, torch.Tensor)
        if on_device != isinstance(base, torch.Tensor) or (
            on_device and trained.device != base.device
        ):
            raise ValueError("trained values and their base must both be arrays or both tensors")
        self._trained, self._base = trained, base
        self._owned: np.ndarray | None = None  # the materialised difference, once made
        self.shape = (len(base),)
        self.dtype = np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(trained values, base) when they are tensors not yet materialised, else None."""
        if self._owned is None and isinstance(self._trained, torch.Tensor):
            return self._trained, self._base
        return None

    def _array(self) -> np.ndarray:
        if self._owned is None:
            if isinstance(self._trained, torch.Tensor):
                difference = torch.sub(self._trained, self._base)  # float32, as numpy's
                self._owned = difference.cpu().numpy()
            else:
                self._owned = np.subtract(self._trained, self._base, dtype=np.float32)
        return self._owned

    def read_chunk(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        """The difference's entries [start, stop), float32 (written into `out`, at least
        stop - start long, unless already materialised)."""
        if self._owned is not None or isinstance(self._trained, torch.Tensor):
            return self._array()[start:stop]
        part = out[: stop - start]
        np.subtract(self._trained[start:stop], self._base[start:stop], out=part)
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

    def wire_nbytes(self) -> int:
        return 4 * len(self)


def materialised(message):
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
        return not_finite(name)
    return None


def not_finite(name: str) -> str:
    return f"'{name}' holds NaN or Inf"


def check_message(message, num_samples, layout: ModelLayout, num_classes: int, dim: int):
    """Why a FedAwS/softmax client message is malformed, or None (checked in the task)."""
    return message_problem(materialised(message), num_samples, layout, num_classes, dim, {})


def message_problem(
    message, num_samples, layout, num_classes: int, dim: int, peaks: dict, deferred=()
):
    """`check_message`, filling `peaks` with each float array's largest magnitude (one pass
    over each array for every check, and none more for its fixed-point conversion). The
    values of the arrays named in `deferred` are left to the caller to check (finite, in
    range; refused with `not_finite` / `too_large`'s words)."""
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
            return too_large(key)
    return None


def too_large(key: str) -> str:
    return f"'{key}' too large for exact aggregation (did local training diverge?)"
