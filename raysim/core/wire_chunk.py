"""A batched chunk's updates as one message (WireChunk): built in the client task, checked and
folded by the server with whole-array operations.

A batched task trains thousands of clients in a few vmapped calls; sent one `WireUpdate` each,
their updates then cost more in Python than the training itself (measured on a 10,000-client
FedAvg round: ~30 us a client, in building, encoding, checking and folding one small message
at a time, docs/BATCHED.md). With the dense codec a client's message is its vector, so a
chunk's messages stack into one (clients, entries) array: one object for Ray to move, and one
pass of the server's checks over all rows.

Nothing changes in what the server accepts or computes. `TaskMessages` stacks only updates of
the plain dense codec, with integer ids and sample counts and 1-D float vectors of one length
and dtype (anything else goes one by one, where the per-client checks name what is wrong).
`rows_pass` runs the server's checks on the whole chunk; when any row fails one, the server
takes the chunk's updates one by one (`WireChunk.updates()`), so a refused row gets the same
line as it would alone. The rows' norms are each computed as `np.linalg.norm` computes a 1-D
vector's (sqrt of its dot with itself), so the round's sums are the same bits.
"""

from __future__ import annotations

import numpy as np

from raysim.core.codecs import Dense
from raysim.core.state import ClientUpdate, WireChunk, WireUpdate
from raysim.core.validation import metrics_problem, stats_problem


def stacks(codec) -> bool:
    """Whether `codec`'s messages may travel stacked: only the built-in dense codec, whose
    message is the vector itself and whose checks `rows_pass` repeats on the whole array (a
    subclass may encode or check differently)."""
    return type(codec) is Dense


class TaskMessages:
    """What a task sends, built as its clients finish: their updates written as rows of one
    WireChunk while they stack (see the module's docstring), else each encoded alone.

    Rows are copied in as updates arrive, so a task holds each vector once more only until
    the caller lets it go (the batched path drops each chunk's deltas as it goes)."""

    def __init__(self, codec, layout, count: int) -> None:
        self.codec, self.layout, self.count = codec, layout, count
        self.rows: np.ndarray | None = None  # (count, entries) once the first update stacks
        # the stacked updates' fields beside their rows: (client_id, num_samples, metrics, stats)
        self.stacked: list[tuple] = []
        self.alone: list[WireUpdate] = []  # once one update does not stack: all of them

    def add(self, update: ClientUpdate) -> None:
        if not self.alone and self._stacks(update):
            if self.rows is None:
                self.rows = np.empty((self.count, len(update.vector)), update.vector.dtype)
            self.rows[len(self.stacked)] = update.vector
            self.stacked.append(
                (update.client_id, update.num_samples, update.metrics, update.stats)
            )
            return
        if self.stacked:  # stacking ends here: the rows so far go one by one too
            self.alone = [
                WireUpdate(client_id, num_samples, row, metrics, stats)
                for (client_id, num_samples, metrics, stats), row in zip(
                    self.stacked, self.rows, strict=False
                )
            ]
            self.stacked, self.rows = [], None
        self.alone.append(update.encoded(self.codec, self.layout))

    def _stacks(self, update: ClientUpdate) -> bool:
        vector = update.vector
        if self.count < 2 or not stacks(self.codec) or len(self.stacked) >= self.count:
            return False
        if not (_is_int64(update.client_id) and _is_int64(update.num_samples)):
            return False
        if not isinstance(vector, np.ndarray) or vector.ndim != 1 or vector.dtype.kind != "f":
            return False
        rows = self.rows
        return rows is None or (vector.dtype == rows.dtype and len(vector) == rows.shape[1])

    def result(self) -> list[WireChunk | WireUpdate]:
        """One WireChunk of every update when all stacked, else their WireUpdates."""
        if not self.stacked:
            return self.alone
        client_ids, num_samples, metrics, stats = zip(*self.stacked, strict=True)
        return [
            WireChunk(
                np.array(client_ids, dtype=np.int64),
                np.array(num_samples, dtype=np.int64),
                self.rows[: len(self.stacked)],
                metrics,
                stats,
            )
        ]


def _is_int64(value) -> bool:
    """An integer (not a bool) that int64 holds: the server checks its value."""
    return (
        isinstance(value, int | np.integer)
        and not isinstance(value, bool)
        and -(2**63) <= value < 2**63
    )


def chunk_problem(chunk: WireChunk) -> str | None:
    """Why `chunk` is not a well-formed WireChunk (a backend's bug: the task builds it), or
    None."""
    count = len(chunk.client_ids) if isinstance(chunk.client_ids, np.ndarray) else -1
    for name in ("client_ids", "num_samples"):
        values = getattr(chunk, name)
        if (
            not isinstance(values, np.ndarray)
            or values.dtype != np.int64
            or values.shape != (count,)
        ):
            return f"WireChunk.{name} is not a 1-D int64 array of {count} entries"
    messages = chunk.messages
    if not isinstance(messages, np.ndarray) or messages.ndim != 2 or len(messages) != count:
        return f"WireChunk.messages is not a 2-D array of {count} rows"
    for name in ("metrics", "stats"):
        if not isinstance(getattr(chunk, name), tuple) or len(getattr(chunk, name)) != count:
            return f"WireChunk.{name} is not a tuple of {count} entries"
    return None


def rows_pass(
    chunk: WireChunk,
    layout,
    sampled: set[int],
    heard_from: set[int],
    client_sizes: np.ndarray | None,
    bound: float | None,
) -> list[float] | None:
    """The rows' update norms when every client of `chunk` passes the server's checks of a
    dense update (sampled this round, heard from once, a sample count it can hold, finite
    numeric metrics and stats, a float vector of the layout's size and dtype, finite, its norm
    within `bound`); None when any fails one. Changes nothing."""
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
    messages = chunk.messages
    if messages.dtype.kind != "f":
        return None
    if layout.dtype is not None and messages.dtype != layout.dtype:
        return None
    if layout.size is not None and messages.shape[1] != layout.size:
        return None
    if not np.isfinite(messages).all():
        return None
    with np.errstate(over="ignore"):  # a huge row's norm is inf: refused one by one
        norms = [float(np.sqrt(row.dot(row))) for row in messages]
    if bound is not None and max(norms, default=0.0) > bound:
        return None
    return norms


__all__ = ["TaskMessages", "chunk_problem", "rows_pass", "stacks"]
