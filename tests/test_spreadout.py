"""The FedAwS spreadout regularizer (Eq. 7 and Eq. 8): values by hand, gradients by autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raysim.algorithms.spreadout import mine_negatives, spreadout_full, spreadout_topk
from raysim.index import build_index


def unit_rows(count: int, dim: int, seed: int) -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((count, dim))
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def distance_torch(u: torch.Tensor, v: torch.Tensor, distance: str) -> torch.Tensor:
    return 1.0 - (u * v).sum(-1) if distance == "cosine" else (u - v).norm(dim=-1)


# Three classes on the unit circle: e1, e2 and their bisector.
THREE = np.array([[1.0, 0.0], [0.0, 1.0], [math.sqrt(0.5), math.sqrt(0.5)]])


def test_three_class_value_by_hand_cosine():
    # d01 = 1, d02 = d12 = 1 - sqrt(1/2); with nu = 1.2 every pair is inside the margin.
    nu = 1.2
    h01, h02 = nu - 1.0, nu - (1.0 - math.sqrt(0.5))
    expected = 2 * (h01**2 + 2 * h02**2)  # each unordered pair twice
    value, grad = spreadout_full(THREE, nu, "cosine")
    assert value == pytest.approx(expected, rel=1e-12)
    # grad w_0 = 2 * (2 h01 w_1 + 2 h02 w_2): pushes w_0 away from the others
    np.testing.assert_allclose(grad[0], 4 * h01 * THREE[1] + 4 * h02 * THREE[2], rtol=1e-12)


def test_three_class_value_by_hand_euclidean():
    # ||e1 - e2|| = sqrt(2); ||e1 - b|| = sqrt(2 - sqrt(2)); with nu = 1 only the latter count.
    nu = 1.0
    near = math.sqrt(2 - math.sqrt(2))
    value, grad = spreadout_full(THREE, nu, "euclidean")
    assert value == pytest.approx(2 * 2 * (nu - near) ** 2, rel=1e-12)
    expected_w0 = -4 * (nu - near) * (THREE[0] - THREE[2]) / near
    np.testing.assert_allclose(grad[0], expected_w0, rtol=1e-12)


def test_three_class_topk_by_hand():
    # class 0 with its nearest neighbour 2 and nu_0 = 1.2: one term, gradient to w_0 and w_2
    value, rows, ids = spreadout_topk(THREE, [0], [[2]], [1.2], "cosine")
    h = 1.2 - (1.0 - math.sqrt(0.5))
    assert value == pytest.approx(h**2, rel=1e-12)
    np.testing.assert_array_equal(ids, [0, 2])
    np.testing.assert_allclose(rows, [2 * h * THREE[2], 2 * h * THREE[0]], rtol=1e-12)


@pytest.mark.parametrize("distance, nu", [("cosine", 1.05), ("euclidean", 1.4)])
def test_full_gradient_matches_autograd(distance, nu):
    weights = unit_rows(30, 5, seed=1)
    value, grad = spreadout_full(weights, nu, distance)
    w = torch.tensor(weights, requires_grad=True)
    i, j = torch.triu_indices(30, 30, offset=1)
    hinge = torch.clamp(nu - distance_torch(w[i], w[j], distance), min=0)
    reference = 2 * (hinge**2).sum()  # ordered pairs = twice the unordered ones
    reference.backward()
    assert value == pytest.approx(reference.item(), rel=1e-12)
    assert 0 < (hinge > 0).float().mean() < 1  # the margin is active for some pairs only
    np.testing.assert_allclose(grad, w.grad.numpy(), rtol=1e-10, atol=1e-12)


def topk_autograd(weights, classes, neighbors, nu, distance):
    w = torch.tensor(weights, requires_grad=True)
    pairs_c = torch.from_numpy(np.repeat(classes, neighbors.shape[1]))
    pairs_y = torch.from_numpy(neighbors.ravel())
    margin = torch.from_numpy(np.repeat(nu, neighbors.shape[1]).astype(np.float64))
    hinge = torch.clamp(margin - distance_torch(w[pairs_c], w[pairs_y], distance), min=0)
    total = (hinge**2).sum()
    total.backward()
    return total.item(), w.grad.numpy()


@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
def test_topk_gradient_matches_autograd_and_is_sparse(distance):
    weights = unit_rows(200, 8, seed=2)
    index = build_index("exact", 200, 8)
    index.reset(weights.astype(np.float32))
    classes = np.array([3, 17, 40, 41, 99, 150, 151, 199])
    neighbors, nu = mine_negatives(index, weights, classes, k=6, distance=distance)
    value, rows, ids = spreadout_topk(weights, classes, neighbors, nu, distance)
    reference_value, reference_grad = topk_autograd(weights, classes, neighbors, nu, distance)
    assert value == pytest.approx(reference_value, rel=1e-10)
    touched = np.flatnonzero(np.abs(reference_grad).sum(axis=1) > 0)
    np.testing.assert_array_equal(ids, touched)  # exactly the rows with a gradient, sorted
    np.testing.assert_allclose(rows, reference_grad[ids], rtol=1e-9, atol=1e-12)
    dense = np.zeros_like(weights)
    dense[ids] = rows
    np.testing.assert_allclose(dense, reference_grad, rtol=1e-9, atol=1e-12)
    # neighbours that are themselves updated classes get both sides of the gradient
    assert len(set(ids) - set(classes)) > 0


def test_topk_over_all_pairs_equals_the_full_regularizer():
    weights = unit_rows(12, 4, seed=3)
    classes = np.arange(12)
    neighbors = np.array([[j for j in range(12) if j != i] for i in range(12)])
    nu = np.full(12, 0.9)
    value, rows, ids = spreadout_topk(weights, classes, neighbors, nu, "cosine")
    full_value, full_grad = spreadout_full(weights, 0.9, "cosine")
    assert value == pytest.approx(full_value, rel=1e-12)
    dense = np.zeros_like(weights)
    dense[ids] = rows
    np.testing.assert_allclose(dense, full_grad, rtol=1e-12, atol=1e-14)


def test_topk_is_deterministic_and_keeps_float32():
    weights = unit_rows(500, 16, seed=4).astype(np.float32)
    index = build_index("exact", 500, 16)
    index.reset(weights)
    classes = np.arange(0, 500, 3)
    neighbors, nu = mine_negatives(index, weights, classes, k=10)
    first = spreadout_topk(weights, classes, neighbors, nu)
    second = spreadout_topk(weights.copy(), classes.copy(), neighbors.copy(), nu.copy())
    assert first[0] == second[0]
    np.testing.assert_array_equal(first[2], second[2])
    np.testing.assert_array_equal(first[1], second[1])
    assert first[1].dtype == np.float32 and nu.dtype == np.float32
    # torch in, torch out
    value, rows, ids = spreadout_topk(torch.from_numpy(weights), classes, neighbors, nu)
    assert isinstance(rows, torch.Tensor)
    np.testing.assert_array_equal(rows.numpy(), first[1])


def test_mine_negatives_splits_k_plus_one():
    weights = unit_rows(60, 6, seed=5)
    index = build_index("exact", 60, 6)
    index.reset(weights.astype(np.float32))
    classes = np.array([0, 10, 59])
    neighbors, nu = mine_negatives(index, weights, classes, k=4)
    sims = weights[classes] @ weights.T
    sims[np.arange(3), classes] = -np.inf
    order = np.argsort(-sims, axis=1)
    np.testing.assert_array_equal(neighbors, order[:, :4])
    np.testing.assert_allclose(nu, 1 - sims[np.arange(3), order[:, 4]], atol=1e-6)
    _, euclid = mine_negatives(index, weights, classes, k=4, distance="euclidean")
    fifth = weights[order[:, 4]]
    np.testing.assert_allclose(euclid, np.linalg.norm(weights[classes] - fifth, axis=1), atol=1e-6)


def test_no_active_pair_gives_an_empty_gradient():
    value, rows, ids = spreadout_topk(THREE, [0], [[1]], [0.5], "cosine")  # d01 = 1 > nu
    assert value == 0.0 and rows.shape == (0, 2) and ids.shape == (0,)


@pytest.mark.parametrize(
    "args, message",
    [
        (([0, 0], [[1], [2]], [1.0, 1.0]), "class_ids must be distinct"),
        (([0], [[0]], [1.0]), "must not contain the class itself"),
        (([0], [1], [1.0]), "expected class_ids"),
    ],
)
def test_topk_rejects_malformed_input(args, message):
    with pytest.raises(ValueError, match=message):
        spreadout_topk(THREE, *args)


def test_unknown_distance_is_rejected():
    with pytest.raises(ValueError, match="distance must be one of cosine, euclidean"):
        spreadout_full(THREE, 1.0, "manhattan")
