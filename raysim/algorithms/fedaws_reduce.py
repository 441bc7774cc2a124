"""How the updates of many FedAwS / Softmax-oracle clients are folded into one aggregate.

A task sums its clients' messages (raysim.algorithms.fedaws_wire) before returning, in
integer fixed point (raysim.core.fixed_point: 2^-32 resolution, far below float32's
resolution of the weights it updates), which makes the sum exact: any packing of clients into
tasks, any number of workers and either backend give the same model bit for bit.
`TaskReducer` folds one task's clients; `merge_reduced` adds two tasks' sums on the server.

The aggregate: `weight` (total samples), `dense` and `bag_ids` / `bag_rows` (theta's
weighted delta sums), `class_ids` / `class_rows` / `class_counts` (FedAwS: each class's
returned rows, summed unweighted, and how many clients returned one), `classes_dense` (the
oracle's weighted delta sum of W) and `bounds` (each int64 sum's magnitude bound).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from raysim.algorithms.fedaws_wire import (
    ClassRow,
    DenseDelta,
    materialised,
    message_problem,
    not_finite,
    too_large,
)
from raysim.core.fixed_point import (
    EXACT_FLOAT64,
    FIXED_LIMIT,
    FIXED_SCALE,
    add_fixed_in_place,
    add_fixed_where_they_lie,
    checked_add,
    concat_rows,
    fixed_bound,
    fold_scratch,
    sum_rows_by_id,
    to_fixed_known_peak,
)
from raysim.core.state import ClientUpdate
from raysim.models.layout import ModelLayout

_FLOAT64 = (np.float64, torch.float64)  # the dense sum's dtype while it is float64 (host or device)


class TaskReducer:
    """Sums one task's client messages exactly (integer fixed point).

    Each sum carries an upper bound of its largest magnitude, the sum of its terms' bounds (a
    Python int; raysim.core.fixed_point): while it fits int64 the sums are plain numpy adds,
    beyond it they are checked exactly and SumOverflowError is raised rather than letting
    int64 wrap around. The bounds travel with the result to `merge_reduced` (below).

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
        fold_dense = (self.dense is None or self.dense.dtype in _FLOAT64) and (
            self.bounds["dense"] + FIXED_LIMIT <= EXACT_FLOAT64
        )
        if not fold_dense and isinstance(self.dense, torch.Tensor):
            self.dense = self.dense.cpu().numpy()  # (int64 from here on, on the host: exact)
        peaks: dict[str, float] = {}
        message = update.vector if fold_dense else materialised(update.vector)
        problem = message_problem(
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
            peak = self._fold_dense(values, weight)
            if not math.isfinite(peak):  # (add_fixed_in_place left the sum as it was)
                return not_finite("dense")
            if peak * weight * FIXED_SCALE >= FIXED_LIMIT:
                return too_large("dense")
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

    def _fold_dense(self, values, weight: int) -> float:
        """`values` (the dense delta) added to the float64 sum in fixed point; its peak, or
        the peak that refuses it (the sum then left as it was). Values that are tensors on a
        device (a GPU client's trained row, DenseDelta.tensors) are folded there, into a sum
        kept on that device until `result`; anything else on the host. The same integers
        either way (raysim.core.fixed_point.add_fixed_where_they_lie)."""
        tensors = values.tensors if isinstance(values, DenseDelta) else None
        if tensors is not None and (
            self.dense is None
            or (isinstance(self.dense, torch.Tensor) and self.dense.device == tensors[0].device)
        ):
            if self.dense is None:
                self.dense = torch.zeros(len(values), dtype=torch.float64, device=tensors[0].device)
            return add_fixed_where_they_lie(self.dense, *tensors, weight)
        if isinstance(self.dense, torch.Tensor):  # (a host delta after device ones)
            self.dense = self.dense.cpu().numpy()
        if self.dense is None:
            self.dense = np.zeros(len(values), dtype=np.float64)
        return add_fixed_in_place(self.dense, values, weight, self._scratch)

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
        if isinstance(dense, torch.Tensor):  # summed on a device: only the sum comes over
            dense = dense.cpu().numpy()
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


def merge_reduced(accumulated: dict | None, message: dict) -> dict:
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
