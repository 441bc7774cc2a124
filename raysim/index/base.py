"""The nearest-class index protocol and the pieces every backend shares.

FedAwS (Yu et al., ICML 2020, Eq. 8) needs, every round, the k nearest classes of each updated
class among all C class embeddings. An index answers that by dot product (= cosine similarity,
since the rows are L2-normalised), never returns the query's own id, and orders its answer best
first with ties broken by the smaller id, so that results are reproducible and merging the
answers of several shards is a plain sort.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

import numpy as np

# Padding for a shard that has fewer than k candidate rows: it sorts after every real answer.
MISSING_ID = -1


@runtime_checkable
class NearestClassIndex(Protocol):
    """Nearest rows of a (num_rows x dim) float32 matrix by dot product, with in-place updates."""

    num_rows: int
    dim: int

    def reset(self, rows: np.ndarray) -> None:
        """Replace the whole content with `rows` (num_rows x dim)."""

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        """Replace rows `row_ids` (global ids) in place; other rows keep their content."""

    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-k rows by dot product with each query: (ids int64 (q, k), sims float32 (q, k)).

        Best first, ties by smaller id; row `query_ids[i]` is never part of answer i.
        """


def as_rows(rows: np.ndarray, dim: int, what: str = "rows") -> np.ndarray:
    """`rows` as a C-contiguous float32 (n, dim) array (a copy only when needed)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if rows.ndim != 2 or rows.shape[1] != dim:
        raise ValueError(f"{what} must have shape (n, {dim}), got {rows.shape}")
    return rows


def as_ids(ids: np.ndarray, count: int, num_rows: int | None, what: str = "row_ids") -> np.ndarray:
    """`ids` as int64 of length `count`, each in [0, num_rows) (or just >= 0 if None)."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.shape[0] != count:
        raise ValueError(f"{what} must be a vector of {count} ids, got shape {ids.shape}")
    if count and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what} must be integers, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    if count and ids.min() < 0:
        raise ValueError(f"{what} must be >= 0, got {ids.min()}")
    if count and num_rows is not None and ids.max() >= num_rows:
        raise ValueError(f"{what} must be < {num_rows} (the number of rows), got {ids.max()}")
    return ids


def check_search_args(
    query_ids: np.ndarray, queries: np.ndarray, k: int, num_rows: int | None, dim: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validated (query_ids int64, queries float32).

    With `num_rows` (the whole index), k must leave room for the exclusion: k <= num_rows - 1.
    A shard passes None: it answers with padding when it holds fewer than k other rows.
    """
    queries = as_rows(queries, dim, "queries")
    query_ids = as_ids(query_ids, queries.shape[0], num_rows, "query_ids")
    if k < 1 or (num_rows is not None and k > num_rows - 1):
        limit = "" if num_rows is None else f", at most num_rows - 1 = {num_rows - 1}"
        raise ValueError(f"k must be >= 1{limit}; got {k}")
    return query_ids, queries


def rank(ids: np.ndarray, sims: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the k best (ids, sims) by similarity descending, then id ascending.

    Entries with id MISSING_ID (and similarity -inf) sort last. This is the whole merge of
    sharded answers: similarities are the same numbers whatever the shard layout, so the order
    is too.
    """
    ids = np.asarray(ids, dtype=np.int64)
    sims = np.asarray(sims, dtype=np.float32)
    # Missing entries get the largest id so that they also lose ties at -inf.
    tie_ids = np.where(ids == MISSING_ID, np.iinfo(np.int64).max, ids)
    order = np.lexsort((tie_ids, -sims), axis=-1)[:, :k]
    return np.take_along_axis(ids, order, axis=1), np.take_along_axis(sims, order, axis=1)


def merge(answers: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge per-shard top-k answers into the global top-k (same order rule as `rank`)."""
    if len(answers) == 1:
        return answers[0]
    ids = np.concatenate([a[0] for a in answers], axis=1)
    sims = np.concatenate([a[1] for a in answers], axis=1)
    return rank(ids, sims, k)


def drop_query_and_rank(
    query_ids: np.ndarray, ids: np.ndarray, sims: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Remove each query's own id (and misses) from an approximate answer; best k, ranked.

    Rows with fewer than k answers left are padded with MISSING_ID / -inf; the caller decides
    whether to search those again more widely.
    """
    ids = np.asarray(ids, dtype=np.int64).copy()
    sims = np.asarray(sims, dtype=np.float32).copy()
    drop = (ids == query_ids[:, None]) | (ids < 0)
    ids[drop] = MISSING_ID
    sims[drop] = -np.inf
    if ids.shape[1] < k:
        pad = k - ids.shape[1]
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=MISSING_ID)
        sims = np.pad(sims, ((0, 0), (0, pad)), constant_values=-np.inf)
    return rank(ids, sims, k)


def available_threads() -> int:
    """CPUs this process may run on (its affinity), at least 1."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


@contextmanager
def server_threads(threads: int | None = None) -> Iterator[int]:
    """torch's thread count (and faiss's OpenMP one, when faiss is loaded) set to `threads`
    (None: `available_threads()`) for the block, and restored after.

    The server's phases (index search, spreadout, evaluation) run while the clients' workers
    wait, so they may use every CPU; what the process inherited says nothing about that (Ray
    sets OMP_NUM_THREADS=1 in an actor that reserves no CPU, such as raysim's server). Results
    do not depend on it: the server's reductions are either per element (element-wise ops,
    GEMM outputs, per-row top-k) or sequential in a fixed order.
    """
    import torch

    count = max(1, int(threads)) if threads is not None else available_threads()
    previous = torch.get_num_threads()
    faiss = sys.modules.get("faiss")
    previous_omp = faiss.omp_get_max_threads() if faiss is not None else None
    if previous != count:
        torch.set_num_threads(count)
    if faiss is not None and previous_omp != count:
        faiss.omp_set_num_threads(count)
    try:
        yield count
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
        if faiss is not None and faiss.omp_get_max_threads() != previous_omp:
            faiss.omp_set_num_threads(previous_omp)
