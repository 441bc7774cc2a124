"""A batched chunk's updates as one message (WireChunk): built in the client task, checked and
folded by the server with whole-array operations.

A batched task trains thousands of clients in a few vmapped calls; sent one `WireUpdate` each,
their updates then cost more in Python than the training itself (measured on a 10,000-client
FedAvg round on the CPU: ~30 us a client, in building, checking and folding one small message
at a time, docs/BATCHED.md). A batched chunk's vectors are rows of one array (its deltas, FRL's
rank positions), so the chunk's messages are encoded at once (`Codec.encode_rows`): under the
dense codec they are that array's rows, uncopied; under FRL's ranks, each layer's positions of
every row packed in one pass (~4x faster than client by client). One object for Ray to move,
one pass of the server's checks and decoding.

Nothing changes in what the server accepts or computes. `TaskMessages` stacks only updates of
the built-in dense or ranks codec whose vectors lie one after another in one C-contiguous array
of the codec's kind (float for dense, integer for ranks), with integer ids and sample counts
(anything else goes alone, where the per-client checks name what is wrong). `rows_pass` runs the
server's checks on the whole chunk; when any row fails one, the server takes the chunk's updates
one by one (`WireChunk.updates()`), so a refused row gets the same line as it would alone. Each
float row's norm is computed as `np.linalg.norm` computes a 1-D vector's (the square root of its
dot with itself), so the round's sums are the same bits; integer rows (rank positions) have no
norm, as one by one.
"""

from __future__ import annotations

import math

import numpy as np

from raysim.core.codecs import Dense, Ranks
from raysim.core.state import ClientUpdate, WireChunk, WireUpdate
from raysim.core.validation import metrics_problem, stats_problem

STACKING_CODECS = (Dense, Ranks)

INT64_LIMIT = 2**63


def stacks(codec) -> bool:
    """Whether `codec`'s messages may travel stacked: only the built-in dense and ranks
    codecs, whose rows interface (`encode_rows`, `decode_rows`, `rows_pass_decoded`) gives
    what their per-client methods give (a subclass may encode or check differently)."""
    return type(codec) in STACKING_CODECS


class TaskMessages:
    """What a task sends, built as its clients finish: each run of updates whose vectors lie
    one after another in one C-contiguous array (a batched chunk's deltas or positions: its
    rows) as one WireChunk of those rows encoded at once; any other update encoded alone."""

    def __init__(self, codec, layout) -> None:
        self.codec, self.layout = codec, layout
        self.kinds = codec.row_kinds if stacks(codec) else ""  # the vectors' dtype kinds
        self.sent: list[WireChunk | WireUpdate] = []
        self.run: list[ClientUpdate] = []  # the current run of stacked rows
        self.base: np.ndarray | None = None  # the array holding them
        self.start = 0  # the run's first entry in `base` (flat)
        self.next_at = 0  # the address where the run's next row would start

    def add(self, update: ClientUpdate) -> None:
        vector = update.vector
        if (  # the next row of the current run: the common case, checked first and cheaply
            self.run
            and type(vector) is np.ndarray
            and vector.base is self.base
            and vector.__array_interface__["data"][0] == self.next_at
            and vector.shape == self.run[0].vector.shape
            and vector.strides == (vector.itemsize,)
            and _is_int64(update.client_id)
            and _is_int64(update.num_samples)
        ):
            self.run.append(update)
            self.next_at += vector.nbytes
            return
        self._close_run()
        place = self._place_of(update)
        if place is None:
            self.sent.append(update.encoded(self.codec, self.layout))
            return
        self.base, self.start, self.next_at = place
        self.run.append(update)

    def result(self) -> list[WireChunk | WireUpdate]:
        self._close_run()
        return self.sent

    def _place_of(self, update: ClientUpdate) -> tuple[np.ndarray, int, int] | None:
        """(array, flat entry, address after it) of `update`'s vector in the C-contiguous
        array it is a contiguous piece of, when it may travel stacked; else None."""
        vector = update.vector
        if not (
            self.kinds
            and isinstance(vector, np.ndarray)
            and vector.ndim == 1
            and vector.dtype.kind in self.kinds
            and vector.strides == (vector.itemsize,)
        ):
            return None
        base = vector.base
        if not (
            isinstance(base, np.ndarray)
            and base.dtype == vector.dtype
            and base.flags.c_contiguous
            and _is_int64(update.client_id)
            and _is_int64(update.num_samples)
        ):
            return None
        address = vector.__array_interface__["data"][0]
        start, rest = divmod(address - base.__array_interface__["data"][0], vector.itemsize)
        if rest or not 0 <= start <= base.size - len(vector):
            return None
        return base, start, address + vector.nbytes

    def _close_run(self) -> None:
        run = self.run
        if len(run) == 1:
            self.sent.append(run[0].encoded(self.codec, self.layout))
        elif run:
            size = len(run[0].vector)
            flat = self.base.reshape(-1)  # a view: the base is C-contiguous
            self.sent.append(
                WireChunk(
                    np.array([u.client_id for u in run], dtype=np.int64),
                    np.array([u.num_samples for u in run], dtype=np.int64),
                    self.codec.encode_rows(
                        flat[self.start : self.start + len(run) * size].reshape(len(run), size),
                        self.layout,
                    ),
                    tuple(u.metrics for u in run),
                    tuple(u.stats for u in run),
                )
            )
        self.run, self.base = [], None


def _is_int64(value) -> bool:
    """An integer (not a bool) that int64 holds: the server checks its value."""
    if type(value) is int:
        return -INT64_LIMIT <= value < INT64_LIMIT
    return isinstance(value, np.integer) and -INT64_LIMIT <= value < INT64_LIMIT


def chunk_problem(chunk: WireChunk) -> str | None:
    """Why `chunk` is not a well-formed WireChunk (a backend's bug: the task builds it), or
    None."""
    count = len(chunk.client_ids) if isinstance(chunk.client_ids, np.ndarray) else -1
    for name, values in (("client_ids", chunk.client_ids), ("num_samples", chunk.num_samples)):
        if not (
            isinstance(values, np.ndarray) and values.dtype == np.int64 and values.shape == (count,)
        ):
            return f"WireChunk.{name} is not a 1-D int64 array of {count} entries"
    messages = chunk.messages
    arrays = messages if isinstance(messages, tuple) and messages else (messages,)
    if not all(isinstance(a, np.ndarray) and a.ndim == 2 and len(a) == count for a in arrays):
        return f"WireChunk.messages is not a 2-D array of {count} rows, nor a tuple of them"
    for name, values in (("metrics", chunk.metrics), ("stats", chunk.stats)):
        if not isinstance(values, tuple) or len(values) != count:
            return f"WireChunk.{name} is not a tuple of {count} entries"
    return None


def rows_pass(
    chunk: WireChunk,
    codec,
    layout,
    sampled: set[int],
    heard_from: set[int],
    client_sizes: np.ndarray | None,
    bound: float | None,
) -> tuple[np.ndarray, list[float]] | None:
    """(the decoded rows, their update norms: NaN for integer rows) when every client of
    `chunk` passes the server's checks of an update (sampled this round, heard from once, a
    sample count it can hold, finite numeric metrics and stats, a message the codec accepts,
    decoding to the layout's size and the codec's dtype, finite, a float row's norm within
    `bound`, the codec's own checks of the decoded rows); None when any fails one, or a row's
    norm overflows. Changes nothing. `codec` is one that `stacks`."""
    ids = chunk.client_ids.tolist()
    unique = set(ids)
    if len(unique) != len(ids) or not unique <= sampled or not unique.isdisjoint(heard_from):
        return None
    samples = chunk.num_samples
    if len(samples) and samples.min() < 0:
        return None
    if client_sizes is not None and (samples > client_sizes[chunk.client_ids]).any():
        return None
    for metrics, stats in zip(chunk.metrics, chunk.stats, strict=True):
        if stats_problem(stats) or metrics_problem(metrics):
            return None
    if not ids:
        return None
    # The rows share their arrays' dtype and widths: the first row's message checks them all.
    if codec.check(chunk.first_message(), layout) is not None:
        return None
    try:
        rows = codec.decode_rows(chunk.messages, layout)
    except Exception:  # noqa: BLE001 - a message the codec cannot read: judged one by one
        return None
    expected = codec.decoded_dtype(layout)
    if rows.ndim != 2 or len(rows) != len(ids) or rows.dtype.kind not in "fiu":
        return None
    if (expected is not None and rows.dtype != expected) or (
        layout.size is not None and rows.shape[1] != layout.size
    ):
        return None
    if rows.dtype.kind != "f":
        return (rows, [math.nan] * len(ids)) if codec.rows_pass_decoded(rows, layout) else None
    # A row's sum of squares is finite exactly when its entries are and it does not overflow,
    # so a non-finite norm sends the chunk one by one, where the row's own checks decide.
    with np.errstate(over="ignore", invalid="ignore"):
        norms = [float(np.sqrt(row.dot(row))) for row in rows]
    if not all(map(math.isfinite, norms)):
        return None
    if bound is not None and max(norms, default=0.0) > bound:
        return None
    if not codec.rows_pass_decoded(rows, layout):
        return None
    return rows, norms


__all__ = ["TaskMessages", "chunk_problem", "rows_pass", "stacks"]
