"""The spreadout gradient's speed-ups (raysim.algorithms.spreadout), with the direct
computation's numbers bit for bit: work on several threads, and the y-side scatter of the
Eq. 8 gradient added in pair order as one sequential `index_add_` adds it (a row's additions
stay on one thread, in order), without its float64 or (pairs x dim) intermediates at once.
"""

from __future__ import annotations

import numpy as np
import torch


def add_neighbour_side(
    grad, target, pair_class, pair_other, pair_coef, own, weights, distance: str, threads: int
) -> None:
    """The y-side of the Eq. 8 gradient, for every active pair p (class pair_class[p], its
    neighbour pair_other[p], gradient row target[p]) in pair order:

        cosine     grad[target[p]] += pair_coef[p] * own[pair_class[p]]
        euclidean  grad[target[p]] += pair_coef[p] * (own[pair_class[p]] - weights[pair_other[p]])

    as `grad.index_add_(0, target, contributions)` on the CPU (sequential) adds them. `own`
    holds the updated classes' rows, `pair_coef` (pairs, 1) the pairs' coefficients."""
    if grad.dtype in (torch.float32, torch.float64):  # numpy: the same operations, faster
        grad_, pair_coef_, own_, weights_ = grad.numpy(), pair_coef.numpy(), own.numpy(), None
        if distance != "cosine":
            weights_ = weights.numpy()

        def contributions(pairs: np.ndarray) -> np.ndarray:
            rows = own_[pair_class[pairs]]
            if distance != "cosine":
                rows -= weights_[pair_other[pairs]]
            rows *= pair_coef_[pairs]  # coef * row: the product is the same either way round
            return rows

        add_in_pair_order(grad_, target, contributions, threads)
        return
    pair_class_t, pair_other_t = torch.from_numpy(pair_class), torch.from_numpy(pair_other)

    def contributions_torch(pairs: np.ndarray) -> torch.Tensor:
        chosen = torch.from_numpy(pairs)
        rows = own[pair_class_t[chosen]]
        if distance == "cosine":
            return pair_coef[chosen] * rows
        return pair_coef[chosen] * (rows - weights[pair_other_t[chosen]])

    add_in_pair_order(grad, target, contributions_torch, threads)


def zeros(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros; for float32/64 through numpy, whose zeroed pages cost nothing until they
    are written (the gradient rows are all written once)."""
    if dtype in (torch.float32, torch.float64):
        numpy_dtype = np.float32 if dtype == torch.float32 else np.float64
        return torch.from_numpy(np.zeros(shape, dtype=numpy_dtype))
    return torch.zeros(shape, dtype=dtype)


def in_threads(function, items: list, threads: int) -> list:
    """[function(item) for item in items], on `threads` Python threads that run torch
    single-threaded (an item's arithmetic is the same on any thread)."""
    if threads <= 1 or len(items) < 2:
        return [function(item) for item in items]
    from concurrent.futures import ThreadPoolExecutor

    from raysim.index.base import server_threads

    with server_threads(1), ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(function, items))


def add_in_pair_order(grad, target: np.ndarray, contributions, threads: int) -> None:
    """grad[target[p]] += contributions(p) for every pair p in increasing order, as one
    sequential index_add_ does it: each row receives its contributions one after another in
    pair order. Here rows are split among threads (a row's additions stay on one thread, in
    order) and each thread adds in layers: the j-th contribution of each of its rows at once
    (distinct rows), layer after layer. `contributions(pairs)` gives the pairs' rows."""
    if not target.size:
        return
    # rows split by target so that the threads get about the same number of pairs
    per_row = np.bincount(target, minlength=grad.shape[0])
    cumulative = np.cumsum(per_row)
    parts = max(1, min(threads, target.size // 4096))
    cuts = np.searchsorted(cumulative, [target.size * t // parts for t in range(1, parts)])
    bounds = [0, *[int(c) + 1 for c in cuts], grad.shape[0]]
    owner = np.searchsorted(np.asarray(bounds[1:-1]), target, side="right")
    layer_block = 8192  # rows added at once (bounds the contributions' memory)

    def add_part(part: int) -> None:
        pairs = np.flatnonzero(owner == part)  # increasing: pair order
        if not pairs.size:
            return
        order = pairs[np.argsort(target[pairs], kind="stable")]  # by row, pair order within
        rows = target[order]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        counts = np.diff(np.r_[starts, rows.size])
        layer = 0
        while starts.size:
            chosen = order[starts + layer]  # the layer-th pair of every row that has one
            for lo in range(0, chosen.size, layer_block):
                block = chosen[lo : lo + layer_block]
                index = target[block]
                if isinstance(grad, torch.Tensor):
                    index = torch.from_numpy(index)
                grad[index] = grad[index] + contributions(block)
            layer += 1
            keep = counts > layer
            starts, counts = starts[keep], counts[keep]

    in_threads(add_part, list(range(parts)), threads if parts > 1 else 1)
