"""FedAwS's evaluation at Amazon-670K scale: P@k's top classes against all classes and the
spread of W (mean pairwise cosine), the same numbers as the direct computations
(raysim.metrics.xml.mean_pairwise_cosine; a full `queries @ classes.T` score matrix and
torch.topk) without their full-size intermediates: with 670,091 classes of 512 floats a score
matrix is 1.37 GB per 512 queries, and a float64 copy of W 2.7 GB."""

from __future__ import annotations

import numpy as np
import torch

_COSINE_BLOCK_ROWS = 4096  # rows of W converted to float64 at a time
_PAIRWISE_LEAF = 1 << 20  # elements of W squared in float64 at a time
_SCORE_COLUMNS = 8192  # classes scored at a time: 512 x 8192 float32 scores (16 MB)
_MIN_COLUMNS = 8  # columns summed together at least (see mean_pairwise_cosine)


def _threads(requested: int | None) -> int:
    return max(1, requested if requested is not None else torch.get_num_threads())


def _map(function, items: list, threads: int) -> list:
    """[function(item) for item in items], on `threads` threads (numpy releases the GIL)."""
    if threads <= 1 or len(items) < 2:
        return [function(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(function, items))


def _column_sums(rows: np.ndarray, columns: slice) -> np.ndarray:
    """rows[:, columns] summed over the rows in float64 exactly as numpy's
    `rows.astype(np.float64).sum(axis=0)` sums them: numpy reduces the outer axis of a
    C-contiguous array of several columns one row after another (row 0, + row 1, + row 2,
    ...), so block by block with the running total as the block's first row is the same chain
    of additions. (A single column is one contiguous run, which numpy sums pairwise: callers
    pass several columns.)"""
    width = columns.stop - columns.start
    block = np.empty((_COSINE_BLOCK_ROWS + 1, width), dtype=np.float64)
    total = None
    for lo in range(0, len(rows), _COSINE_BLOCK_ROWS):
        part = rows[lo : lo + _COSINE_BLOCK_ROWS, columns]
        if total is None:  # the first block alone, as numpy starts from row 0
            block[: len(part)] = part
            total = np.add.reduce(block[: len(part)], axis=0)
        else:
            block[0] = total
            block[1 : len(part) + 1] = part
            total = np.add.reduce(block[: len(part) + 1], axis=0)
    return total


def _pairwise_nodes(start: int, count: int, out: list[tuple[int, int]]) -> object:
    """numpy's pairwise summation tree over [start, start + count) (its `pairwise_sum`: halves,
    the first rounded down to a multiple of 8) down to nodes of at most _PAIRWISE_LEAF
    elements; returns the tree with the leaves as indexes into `out`."""
    if count <= _PAIRWISE_LEAF:
        out.append((start, count))
        return len(out) - 1
    half = count // 2
    half -= half % 8
    return (
        _pairwise_nodes(start, half, out),
        _pairwise_nodes(start + half, count - half, out),
    )


def _fold(tree: object, leaves: list[float]) -> float:
    if isinstance(tree, int):
        return leaves[tree]
    left, right = tree
    return _fold(left, leaves) + _fold(right, leaves)


def _sum_of_squares(flat: np.ndarray, threads: int) -> float:
    """`(flat.astype(np.float64) ** 2).sum()` bit for bit: numpy sums a contiguous array by
    its pairwise tree; every node of that tree is numpy's own sum of its elements, so the
    nodes of at most _PAIRWISE_LEAF elements are summed apart (on several threads) and joined
    by the tree's additions. The squares of float32 values are exact in float64."""
    leaves: list[tuple[int, int]] = []
    tree = _pairwise_nodes(0, flat.size, leaves)

    def leaf(span: tuple[int, int]) -> float:
        start, count = span
        values = flat[start : start + count]
        squares = np.multiply(values, values, dtype=np.float64)
        return np.add.reduce(squares)

    return _fold(tree, _map(leaf, leaves, threads))


def mean_pairwise_cosine(rows: np.ndarray, threads: int | None = None) -> float:
    """raysim.metrics.xml.mean_pairwise_cosine, bit for bit, without its float64 copies of
    `rows` (2.7 GB each for Amazon-670K's W): (|sum w|^2 - sum |w|^2) / (C (C - 1)), the sums
    in float64 in numpy's own order (see _column_sums and _sum_of_squares). `threads` (None:
    torch's thread count) split the work, never a sum."""
    rows = np.asarray(rows)
    count = len(rows)
    if (
        count < 2
        or rows.ndim != 2
        or rows.shape[1] < _MIN_COLUMNS
        or rows.dtype != np.float32
        or not rows.flags.c_contiguous
    ):  # small or unusual: the direct computation (its copies are small or needed)
        from raysim.metrics.xml import mean_pairwise_cosine as direct

        return direct(rows)
    threads = _threads(threads)
    dim = rows.shape[1]
    # every column's sum is its own chain of additions: columns split over the threads, each
    # part at least _MIN_COLUMNS wide (numpy sums a single column pairwise, not row by row)
    parts = max(1, min(threads, dim // _MIN_COLUMNS))
    cuts = [dim * t // parts for t in range(parts + 1)]
    spans = [slice(a, b) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    total = np.concatenate(_map(lambda span: _column_sums(rows, span), spans, threads))
    squares = _sum_of_squares(rows.reshape(-1), threads)
    return float((total @ total - squares) / (count * (count - 1)))


def top_k_classes(
    queries: torch.Tensor, classes: torch.Tensor, k: int, columns: int | None = None
) -> torch.Tensor:
    """`torch.topk(queries @ classes.T, k, dim=1).indices`, the same answer, without the full
    (queries x classes) score matrix when `classes` is on the CPU.

    The scores are computed for `columns` classes at a time (None: 8192): each score is the
    same number as in the full product (the GEMM computes every output element from its row
    and column alone; cutting the classes into blocks changes which elements are computed
    together, not how). Each block keeps its best k + 1, and a query's answer is taken from
    those candidates when its k + 1 best scores are all different and finite: then its top k,
    in order, is the same whatever breaks ties. A query with a tie among them (or a NaN) has
    its whole batch scored again the direct way, so that ties are broken exactly as
    torch.topk breaks them.
    """
    count, total = queries.shape[0], classes.shape[0]
    k = min(k, total)
    columns = columns or _SCORE_COLUMNS
    if classes.device.type != "cpu" or total <= max(columns, k + 1) or count == 0:
        return torch.topk(queries @ classes.T, k, dim=1).indices
    keep = k + 1
    best_scores, best_ids = [], []
    for lo in range(0, total, columns):
        scores = queries @ classes[lo : lo + columns].T
        top = torch.topk(scores, min(keep, scores.shape[1]), dim=1)
        best_scores.append(top.values)
        best_ids.append(top.indices + lo)
    scores = torch.cat(best_scores, dim=1)
    ids = torch.cat(best_ids, dim=1)
    scores, order = torch.sort(scores, dim=1, descending=True, stable=True)
    scores, ids = scores[:, :keep], torch.gather(ids, 1, order[:, :keep])
    distinct = (scores[:, :-1] > scores[:, 1:]).all(dim=1) & torch.isfinite(scores).all(dim=1)
    if not bool(distinct.all()):
        return torch.topk(queries @ classes.T, k, dim=1).indices
    return ids[:, :k]
