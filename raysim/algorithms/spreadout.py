"""The spreadout regularizer of FedAwS (Yu, Rawat, Menon, Kumar; ICML 2020), as pure functions.

In FedAwS each client sees only its own class, so nothing in local training pushes class
embeddings apart; the server does it with one gradient step on

    Eq. 7 (all pairs, small C):  reg(W) = sum_c sum_{c' != c} max(0, nu - d(w_c, w_c'))^2
    Eq. 8 (negative mining):     reg(W) = sum_{c updated} sum_{y in N_k(c)}
                                           max(0, nu_c - d(w_c, w_y))^2

where N_k(c) are the k classes nearest to c (from a nearest-class index) and nu_c is the
distance to the (k+1)-th nearest, held constant. The server then applies
W <- W - lambda * eta * grad and re-normalises the changed rows.

Distances (rows are L2-normalised by the caller):
    "cosine"     d(u, v) = 1 - u.v          (the paper's default; differentiated as written,
                                              i.e. as 1 - u.v, not as the normalised cosine)
    "euclidean"  d(u, v) = ||u - v||        (= sqrt(2 - 2 u.v) on the sphere, so it orders
                                              neighbours exactly as cosine does; at u = v the
                                              gradient is taken as 0)

Inputs may be numpy arrays or torch tensors; results come back in the same kind and dtype.
The threads and the ordered y-side scatter that make `spreadout_topk` fast at Amazon-670K
scale, with a sequential computation's numbers, are in raysim.algorithms.spreadout_fast.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raysim.algorithms.spreadout_fast import add_neighbour_side, in_threads, zeros

DISTANCES = ("cosine", "euclidean")
_PAIR_CHUNK_ELEMENTS = 1 << 24  # bounds the (classes x k x dim) gathers of spreadout_topk


def _check_distance(distance: str) -> None:
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {', '.join(DISTANCES)}, got {distance!r}")


def _like(value: torch.Tensor, template: Any) -> Any:
    """`value` as the kind of `template`: numpy (from any device) or a tensor on its device."""
    if isinstance(template, np.ndarray):
        return value.cpu().numpy()
    return value.to(template.device)


def spreadout_full(
    W: Any, nu: float, distance: str = "cosine", device: torch.device | None = None
) -> tuple[float, Any]:
    """Eq. 7 over all ordered pairs: (value, dense gradient with W's shape).

    Needs C x C memory: for small C (CIFAR, AmazonCat-13K at a push); use spreadout_topk
    beyond that. Each unordered pair appears twice in the sum, so its gradient counts twice.
    `device`: where the products run (None: where W is).
    """
    _check_distance(distance)
    weights = torch.as_tensor(W)
    if device is not None:
        weights = weights.to(device)
    gram = weights @ weights.T
    if distance == "cosine":
        hinge = torch.clamp(nu - (1.0 - gram), min=0)
        hinge.fill_diagonal_(0)
        value = float((hinge * hinge).sum())
        # d reg / d w_a = sum_b 2 h_ab d(w_a . w_b)/dw_a + 2 h_ba d(w_b . w_a)/dw_a
        grad = 2.0 * (hinge + hinge.T) @ weights
        return value, _like(grad, W)
    squared = torch.diagonal(gram)
    dist = torch.sqrt(torch.clamp(squared[:, None] + squared[None, :] - 2.0 * gram, min=0))
    hinge = torch.clamp(nu - dist, min=0)
    hinge.fill_diagonal_(0)
    value = float((hinge * hinge).sum())
    # d h_ab^2 / d w_a = -2 h_ab (w_a - w_b) / d_ab, from both orderings of the pair
    ratio = torch.where(dist > 0, hinge / torch.where(dist > 0, dist, 1.0), 0.0)
    pair = 2.0 * (ratio + ratio.T)
    grad = -(pair.sum(dim=1, keepdim=True) * weights - pair @ weights)
    return value, _like(grad, W)


def mine_negatives(
    index: Any, W: Any, class_ids: Any, k: int, distance: str = "cosine"
) -> tuple[np.ndarray, np.ndarray]:
    """Stochastic negative mining (Eq. 8): the k nearest classes of each class and nu_c.

    Asks the index (a raysim.index NearestClassIndex over the rows of W) for the top-(k+1) of
    each class, excluding the class itself; the first k are N_k(c), and nu_c is the distance
    to the (k+1)-th. Returns (neighbor_ids int64 (q, k), nu (q,) in W's float dtype).
    """
    _check_distance(distance)
    weights = W.detach().cpu().numpy() if isinstance(W, torch.Tensor) else np.asarray(W)
    classes = np.asarray(class_ids, dtype=np.int64)
    queries = np.ascontiguousarray(weights[classes], dtype=np.float32)
    ids, sims = index.search(classes, queries, k + 1)
    last = sims[:, k].astype(np.float64)
    if distance == "cosine":
        nu = 1.0 - last
    else:
        nu = np.sqrt(np.maximum(0.0, 2.0 - 2.0 * last))  # ||u - v|| on the unit sphere
    return ids[:, :k], nu.astype(weights.dtype)


def spreadout_topk(
    W: Any,
    class_ids: Any,
    neighbor_ids: Any,
    neighbor_nu: Any,
    distance: str = "cosine",
    device: torch.device | None = None,
) -> tuple[float, Any, np.ndarray]:
    """Eq. 8 with mined negatives: (value, grad_rows, grad_row_ids).

    class_ids (q,) are the updated classes (distinct), neighbor_ids (q, k) their nearest
    classes (never the class itself), neighbor_nu (q,) the margins nu_c (constants). The
    gradient reaches both w_c and every w_y; it is returned sparse: `grad_row_ids` are the
    distinct rows with a non-zero gradient in increasing order, `grad_rows[i]` the gradient of
    row grad_row_ids[i]. Apply it as W[grad_row_ids] -= lambda * eta * grad_rows.

    Summation order is fixed, so the result is deterministic: a row's gradient is its c-side
    part (one batched product over its k neighbours) plus its y-side contributions added one by
    one in pair order (class order, then neighbour rank; torch's CPU index_add_ is sequential).

    `device`: where the pair products (the gathers and einsums, the bulk of the work) run;
    None: where W is. The scatter of the y-side contributions always runs on the CPU, in
    that fixed order (a GPU's index_add_ adds in no fixed order).
    """
    _check_distance(distance)
    weights = torch.as_tensor(W)
    classes = np.array(class_ids, dtype=np.int64)  # copies: inputs may be read-only views
    neighbors = np.array(neighbor_ids, dtype=np.int64)
    nu = torch.tensor(np.asarray(neighbor_nu), dtype=weights.dtype)
    count, k = neighbors.shape if neighbors.ndim == 2 else (-1, -1)
    if classes.ndim != 1 or count != classes.shape[0] or nu.shape != (count,):
        raise ValueError(
            "expected class_ids (q,), neighbor_ids (q, k), neighbor_nu (q,); got "
            f"{classes.shape}, {neighbors.shape}, {tuple(nu.shape)}"
        )
    if np.unique(classes).size != classes.size:
        raise ValueError("class_ids must be distinct (each updated class once)")
    if (neighbors == classes[:, None]).any():
        raise ValueError("neighbor_ids must not contain the class itself")

    dim = weights.shape[1]
    step = max(1, _PAIR_CHUNK_ELEMENTS // max(1, k * dim))
    # the pair products on `device` (no copies when it is where W already is)
    on_device = weights if device is None else weights.to(device)
    nu_on_device = nu.to(on_device.device)
    threads = torch.get_num_threads() if on_device.device.type == "cpu" else 1

    def pair_products(start: int) -> tuple[torch.Tensor, ...]:
        """One chunk of classes: (hinge, coef, c-side gradient, class rows), on the CPU."""
        stop = min(count, start + step)
        own = on_device[torch.from_numpy(classes[start:stop]).to(on_device.device)]  # (b, dim)
        chosen = torch.from_numpy(neighbors[start:stop].reshape(-1)).to(on_device.device)
        other = on_device.index_select(0, chosen).view(stop - start, k, dim)  # (b, k, dim)
        if distance == "cosine":
            dist = 1.0 - torch.einsum("bd,bkd->bk", own, other)
        else:
            dist = torch.linalg.vector_norm(own[:, None, :] - other, dim=2)
        hinge = torch.clamp(nu_on_device[start:stop, None] - dist, min=0)
        if distance == "cosine":
            # d h^2 / d w_c = 2 h w_y  and  d h^2 / d w_y = 2 h w_c
            coef = 2.0 * hinge
            own_grad = torch.einsum("bk,bkd->bd", coef, other)
        else:
            # d h^2 / d w_c = -2 h (w_c - w_y) / d  and  d h^2 / d w_y = +2 h (w_c - w_y) / d
            coef = torch.where(dist > 0, 2.0 * hinge / torch.where(dist > 0, dist, 1.0), 0.0)
            own_grad = torch.einsum("bk,bkd->bd", coef, other) - coef.sum(1, keepdim=True) * own
        return tuple(t.cpu() for t in (hinge, coef, own_grad, own))  # CPU: no-ops

    # chunks are independent: on the CPU they run side by side, one thread each
    chunks = in_threads(pair_products, list(range(0, count, step)), threads)
    weights = weights.cpu()  # the y-side scatter below runs on the CPU (fixed order)
    empty = torch.zeros((0, k), dtype=weights.dtype)
    hinge = torch.cat([c[0] for c in chunks]) if chunks else empty
    coef = torch.cat([c[1] for c in chunks]) if chunks else empty
    value = float((hinge * hinge).sum())

    active = ((hinge > 0) & (coef != 0)).numpy()
    has_active = active.any(axis=1)
    grad_ids = np.unique(np.concatenate([classes[has_active], neighbors[active]]))
    grad = zeros((grad_ids.size, dim), weights.dtype)
    if grad_ids.size == 0:
        return value, _like(grad, W), grad_ids
    # c-side: each updated class is one distinct row
    own_rows = torch.from_numpy(np.searchsorted(grad_ids, classes[has_active]))
    grad[own_rows] = torch.cat([c[2] for c in chunks])[torch.from_numpy(has_active)]
    # y-side: neighbour contributions added to each row one by one, in pair order
    pair_class, pair_rank = np.nonzero(active)  # class order, then neighbour rank
    pair_other = neighbors[pair_class, pair_rank]
    target = np.searchsorted(grad_ids, pair_other)
    pair_coef = coef[torch.from_numpy(pair_class), torch.from_numpy(pair_rank)][:, None]
    own = torch.cat([c[3] for c in chunks])  # the updated classes' rows
    add_neighbour_side(
        grad, target, pair_class, pair_other, pair_coef, own, weights, distance, threads
    )
    return value, _like(grad, W), grad_ids
