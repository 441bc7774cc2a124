"""FedAwS's server phases at Amazon-670K scale (theta 288 MB, W 1.37 GB): the reference
computations' numbers (raysim.algorithms.fedaws, raysim.algorithms.class_embedding) bit for
bit, with less memory and time.

- `InPlaceServerUpdate`: FedAwS's server step written into the state's own arrays (theta, its
  optimizer slots and W's changed rows), block by block on every CPU the process may use,
  when the new state is certainly finite; the reference (copying) update runs otherwise;
- `evaluate_class_embeddings`: the evaluation's numbers without its full-size intermediates.

Every operation here is per element or per row, so blocks and threads change nothing.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from raysim.algorithms.class_embedding import (
    ClassEmbeddingMethod,
    evaluate_embeddings,
    next_state,
    normalize_rows,
    returned_class_rows,
)
from raysim.algorithms.spreadout_fast import in_threads
from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.state import ServerState
from raysim.index.base import server_threads
from raysim.metrics.xml_scale import mean_pairwise_cosine, top_k_classes
from raysim.models.devices import server_device
from raysim.models.layout import layout_of
from raysim.models.vector import cached_model

_ROW_BLOCK = 4096  # class rows re-normalised (float64 inside) or copied at a time


def _row_blocks(count: int, threads: int, body) -> None:
    """body(rows) for blocks of at most _ROW_BLOCK rows of [0, count), on `threads` threads.
    Blocks touch disjoint rows and each row's arithmetic is its own (per-row operations), so
    the result is the same for any blocks and threads."""
    blocks = [slice(lo, min(count, lo + _ROW_BLOCK)) for lo in range(0, count, _ROW_BLOCK)]
    in_threads(body, blocks, threads)  # numpy releases the GIL


def step_rows_in_place(
    classes: np.ndarray, ids: np.ndarray, grad_rows: np.ndarray, step: float, threads: int
) -> bool:
    """grad_rows <- normalize_rows(classes[ids] - step * grad_rows), block by block (the same
    float32 / float64 operations on every element as on the whole arrays, without their
    full-size float64 copies); returns whether every new row is finite."""
    finite = []

    def body(block: slice) -> None:
        rows = classes[ids[block]]
        rows -= step * grad_rows[block]
        grad_rows[block] = normalize_rows(rows)
        finite.append(bool(np.isfinite(grad_rows[block]).all()))

    _row_blocks(len(ids), threads, body)
    return all(finite)


def write_rows(classes: np.ndarray, ids: np.ndarray, rows: np.ndarray, threads: int) -> None:
    """classes[ids] = rows for distinct ids, block by block."""

    def body(block: slice) -> None:
        classes[ids[block]] = rows[block]

    _row_blocks(len(ids), threads, body)


class InPlaceServerUpdate:
    """FedAwS's `_copying_update` (the reference server step) written into the state's own
    arrays. Mixed into raysim.algorithms.fedaws.FedAwS, whose `spreadout`,
    `train_class_embeddings`, `_spreadout_step_size`, `_mined_gradient` and `_sync_index_rows`
    it uses; it keeps theta's delta buffer and the bounds its last step left."""

    _delta: np.ndarray | None = None  # theta's delta, reused every round
    _peaks: tuple[list, dict] | None = None  # bounds of theta and its slots

    def _in_place_update(self, state: ServerState, aggregate: dict, ctx: RunContext):
        """`_copying_update`'s result written into the state's own arrays, or None (nothing
        changed) when that is not certain to give a finite state."""
        if self.spreadout == "full":  # small C: the dense gradient makes a new W anyway
            return None
        theta = state.arrays["params"]
        slots = server_optimizers.slots_of(state.arrays)
        classes = state.arrays["class_embeddings"]
        optimizer = server_optimizers.from_config(ctx.config)
        threads = torch.get_num_threads()
        delta, delta_peak = self._theta_delta(theta, aggregate, ctx)
        peaks = self._known_peaks(theta, slots)
        if peaks is None:
            peaks = server_optimizers.peaks_of(theta, slots)
        after = server_optimizers.in_place_peaks(optimizer, theta, delta, slots, peaks, delta_peak)
        if after is None:
            return None
        times: dict[str, float] = {}
        ids = aggregate["class_ids"]
        if self.train_class_embeddings and len(ids):
            if not (
                classes.flags.writeable
                and classes.flags.c_contiguous
                and classes.dtype == np.float32
            ):
                classes = np.array(classes, dtype=np.float32)  # ours from now on
            rows = returned_class_rows(aggregate)
            if not np.isfinite(rows).all():
                return None
            previous = classes[ids]
            classes[ids] = rows
            if not self._spreadout_in_place(classes, ids, state.round, ctx, times, threads):
                classes[ids] = previous  # W as it was; the copying update decides
                self._index_round = -1  # the index saw rows of this step: rebuild it
                return None
        optimizer.step_in_place(theta, delta, slots, threads)
        self._peaks = ([weakref.ref(a) for a in (theta, *slots.values())], after)
        return next_state(state, theta, classes, slots), times

    def _known_peaks(self, theta: np.ndarray, slots: dict) -> dict | None:
        """The bounds the last in-place step left, if these are the arrays it stepped."""
        if self._peaks is None:
            return None
        refs, peaks = self._peaks
        arrays = (theta, *slots.values())
        if len(refs) != len(arrays) or any(r() is not a for r, a in zip(refs, arrays)):  # noqa: B905
            return None
        return peaks

    def _theta_delta(self, theta: np.ndarray, aggregate: dict, ctx: RunContext):
        """`ClassEmbeddingMethod._theta_step`'s delta (the weighted mean theta delta), in a
        buffer reused every round, and its largest magnitude."""
        total = float(aggregate["weight"]) * FIXED_SCALE
        layout = layout_of(cached_model(ctx))
        if self._delta is None or self._delta.shape != theta.shape:
            self._delta = np.zeros_like(theta, dtype=np.float32)
        else:
            self._delta.fill(0.0)
        delta = self._delta
        dense = (aggregate["dense"] / total).astype(np.float32)
        peak = float(np.max(np.abs(dense))) if dense.size else 0.0
        if layout.bag is None:
            delta[:] = dense
            return delta, peak
        delta[layout.dense_index] = dense
        table = delta[layout.bag_offset : layout.bag_offset + layout.bag_rows * layout.bag_width]
        table = table.reshape(layout.bag_rows, layout.bag_width)
        ids = aggregate["bag_ids"].astype(np.int64)
        bag_rows = aggregate["bag_rows"]
        peaks = []

        def body(block: slice) -> None:
            rows = (bag_rows[block] / total).astype(np.float32)
            table[ids[block]] = rows
            if rows.size:
                peaks.append(float(np.max(np.abs(rows))))

        _row_blocks(len(ids), torch.get_num_threads(), body)
        return delta, max([peak, *peaks])

    def _spreadout_in_place(
        self,
        classes: np.ndarray,
        updated: np.ndarray,
        round_index: int,
        ctx: RunContext,
        times: dict[str, float],
        threads: int,
    ) -> bool:
        """`_spreadout_step` (top-k mining) written into `classes` block by block; False
        (classes untouched) when a new row would not be finite."""
        step = self._spreadout_step_size(ctx)
        if step is None:
            return True
        index, grad_rows, grad_ids, started = self._mined_gradient(
            classes, updated, round_index, ctx, times
        )
        rows = np.asarray(grad_rows, dtype=np.float32)  # becomes the new rows, block by block
        if not rows.flags.writeable:
            rows = rows.copy()
        if not step_rows_in_place(classes, grad_ids, rows, step, threads):
            return False
        write_rows(classes, grad_ids, rows, threads)
        self._sync_index_rows(index, grad_ids, rows, started, times)
        return True


def evaluate_class_embeddings(method, state: ServerState, x, y, ctx: RunContext) -> dict:
    """ClassEmbeddingMethod.evaluate's numbers (P@1/3/5 or accuracy, and the mean pairwise
    cosine of W), bit for bit, on every CPU the process may use and without its full-size
    intermediates: the scores of each batch of 512 points against all classes are taken a
    block of classes at a time (raysim.metrics.xml_scale.top_k_classes; ties are broken
    exactly as before), and the cosine's float64 sums run over blocks of W instead of a
    float64 copy (raysim.metrics.xml_scale.mean_pairwise_cosine). On a GPU it is the direct
    computation."""
    device = server_device(ctx)
    if device.type != "cpu":
        return ClassEmbeddingMethod.evaluate(method, state, x, y, ctx)
    with server_threads():
        return evaluate_embeddings(
            method, state, x, y, ctx, device, top_k_classes, mean_pairwise_cosine
        )
