"""FedAwS's server phases written for Amazon-670K scale give the direct computations' numbers
bit for bit: the in-place server update (theta's optimizer step, W's rows), the spreadout
gradient's scatter, the block-wise evaluation (top-k, mean pairwise cosine), the exact index's
threaded re-score and slice updates, whatever the blocks and the thread counts."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from raysim import config as config_module
from raysim.algorithms import fedaws_fast as fedaws_module
from raysim.algorithms import spreadout
from raysim.algorithms.class_embedding import ClassEmbeddingMethod, normalize_rows
from raysim.assembly import plan_run
from raysim.core import server_optimizers
from raysim.core.clients import single_class_of_clients, train_clients
from raysim.core.server import Server, ServerData
from raysim.core.server_optimizers import ServerAdagrad, ServerAdam, ServerSGD
from raysim.core.state import RoundInfo, ServerState
from raysim.data.datasets import load_dataset
from raysim.index import build_index
from raysim.index.base import server_threads
from raysim.index.exact import exact_dot
from raysim.metrics import xml_scale as metrics
from raysim.metrics.xml import mean_pairwise_cosine as direct_mean_pairwise_cosine

TINY = {
    "run": {"seed": 5, "rounds": 3, "eval_every": 1, "checkpoint_every": 0},
    "data": {
        "name": "synthetic_xml",
        "num_labels": 60,
        "num_features": 300,
        "num_train": 900,
        "num_test": 200,
    },
    "partition": {"name": "one_class", "num_clients": 60},
    "clients": {"per_round": 20, "local_epochs": 1, "batch_size": 64, "lr": 1.0},
    "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6},
    "model": {"name": "xml_embedding_bag", "bag_dim": 16, "hidden": [32], "embedding_dim": 8},
    "algorithm": {"name": "fedaws", "k": 5, "class_lr": 0.1, "spreadout_lr": 0.05},
    "runtime": {"backend": "local"},
}


def bits(value) -> bytes:
    value = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return value.dtype.str.encode() + value.tobytes()


# --- server optimizers in place ------------------------------------------------------------------
OPTIMIZERS = [
    ServerAdam(lr=0.01, eps=1e-6),
    ServerAdam(lr=0.3, beta1=0.5, beta2=0.9, eps=1e-3),
    ServerAdagrad(lr=0.1, eps=1e-3),
    ServerSGD(lr=1.0),
    ServerSGD(lr=0.7, momentum=0.9),
]


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: repr(o))
@pytest.mark.parametrize("threads", [1, 3])
def test_step_in_place_is_step_bit_for_bit(optimizer, threads):
    rng = np.random.default_rng(0)
    size = 3 * (1 << 16) + 123  # several chunks and a short one
    params = rng.standard_normal(size, dtype=np.float32)
    slots = {
        name: np.abs(rng.standard_normal(size, dtype=np.float32)) for name in optimizer.init(params)
    }
    expected_params, expected_slots = params.copy(), {k: v.copy() for k, v in slots.items()}
    peaks = server_optimizers.peaks_of(params, slots)
    for _ in range(3):
        delta = rng.standard_normal(size, dtype=np.float32) * np.float32(1e-2)
        delta[::7] = 0.0
        expected_params, expected_slots = optimizer.step(expected_params, delta, expected_slots)
        after = server_optimizers.in_place_peaks(
            optimizer, params, delta, slots, peaks, float(np.abs(delta).max())
        )
        assert after is not None
        optimizer.step_in_place(params, delta, slots, threads)
        assert bits(params) == bits(expected_params)
        for name in slots:
            assert bits(slots[name]) == bits(expected_slots[name]), name
        actual = server_optimizers.peaks_of(params, slots)
        assert all(actual[name] <= after[name] for name in actual)  # the bounds hold
        peaks = after


def test_in_place_step_is_refused_when_it_could_overflow_or_cannot_write():
    optimizer = ServerAdam(lr=0.01, eps=1e-6)
    params = np.ones(10, dtype=np.float32)
    slots = optimizer.init(params)
    delta = np.full(10, 1e-3, dtype=np.float32)
    peaks = server_optimizers.peaks_of(params, slots)
    assert server_optimizers.in_place_peaks(optimizer, params, delta, slots, peaks, 1e-3)
    # a delta whose square overflows float32: the pure step runs (the server may refuse it)
    assert server_optimizers.in_place_peaks(optimizer, params, delta, slots, peaks, 1e20) is None
    tiny_eps = ServerAdam(lr=0.01, eps=1e-30)
    assert server_optimizers.in_place_peaks(tiny_eps, params, delta, slots, peaks, 1e10) is None
    nan_peaks = {**peaks, "params": float("nan")}
    assert server_optimizers.in_place_peaks(optimizer, params, delta, slots, nan_peaks, 0) is None
    frozen = params.copy()
    frozen.flags.writeable = False  # e.g. from Ray's object store
    assert server_optimizers.in_place_peaks(optimizer, frozen, delta, slots, peaks, 1e-3) is None
    assert server_optimizers.in_place_peaks(object(), params, delta, slots, peaks, 1e-3) is None
    as64 = params.astype(np.float64)
    assert server_optimizers.in_place_peaks(optimizer, as64, delta, slots, peaks, 1e-3) is None


# --- FedAwS's server update in place ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    config = config_module.from_dict(TINY)
    dataset = load_dataset(config)
    split = plan_run(config, dataset).split
    classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)
    return config, dataset, split, classes


def _aggregates(config, dataset, split, classes, rounds: int):
    """Each round's reduced aggregate, from a server run the copying way."""
    ctx = plan_run(config, dataset).ctx
    server = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
    server.algorithm._in_place_update = lambda *args: None  # the copying update only
    aggregates, states = [], [server.state]
    rng = np.random.default_rng(1)
    for round_index in range(rounds):
        ids = np.sort(rng.choice(split.num_clients, config.clients.per_round, replace=False))
        info = RoundInfo(round_index, ids)
        server.start_round(info)
        server.add(
            train_clients(
                ctx,
                server.algorithm,
                server.payload(),
                dataset.train_x,
                dataset.train_y,
                split.indices,
                split.offsets,
                round_index,
                ids,
                server.personal_payloads(ids),
            )
        )
        aggregates.append(server._fold.reduced)
        server.finish_round(evaluate=False)
        states.append(server.state)
    return ctx, aggregates, states


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"algorithm__distance": "euclidean", "server__optimizer": "adagrad"},
        {"server__optimizer": "sgd", "server__momentum": 0.9, "server__lr": 1.0},
        {"algorithm__spreadout": "none"},
        {"algorithm__train_class_embeddings": False},
    ],
    ids=["adam", "euclidean-adagrad", "sgd-momentum", "baseline1", "baseline2"],
)
def test_in_place_server_update_equals_the_copying_update(tiny, overrides, monkeypatch):
    config, dataset, split, classes = tiny
    config = config.replace(**overrides) if overrides else config
    ctx, aggregates, states = _aggregates(config, dataset, split, classes, rounds=3)
    monkeypatch.setattr(fedaws_module, "_ROW_BLOCK", 7)  # many blocks of rows
    algorithm = Server(
        ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes)
    ).algorithm
    state = ServerState(0, {k: v.copy() for k, v in states[0].arrays.items()})
    for round_index, aggregate in enumerate(aggregates):
        before = dict(state.arrays)
        state, _ = algorithm.server_update(state, aggregate, ctx)
        # in place: the same arrays, holding the copying update's values
        assert state.arrays["params"] is before["params"]
        for key, expected in states[round_index + 1].arrays.items():
            assert bits(state.arrays[key]) == bits(expected), (round_index, key)


def test_read_only_state_and_a_refused_bound_take_the_copying_update(tiny):
    config, dataset, split, classes = tiny
    ctx, aggregates, states = _aggregates(config, dataset, split, classes, rounds=2)
    algorithm = Server(
        ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes)
    ).algorithm
    frozen = {k: v.copy() for k, v in states[0].arrays.items()}
    for value in frozen.values():
        value.flags.writeable = False  # as after a restore from Ray's object store
    state, _ = algorithm.server_update(ServerState(0, frozen), aggregates[0], ctx)
    for key, expected in states[1].arrays.items():
        assert bits(state.arrays[key]) == bits(expected), key
        assert bits(frozen[key]) == bits(states[0].arrays[key]), key  # untouched
    # a bound that fails (as for a step that could overflow): nothing is written in place
    previous = {k: v.copy() for k, v in state.arrays.items()}
    stepped = [
        state.arrays[k] for k in ("params", "optimizer.first_moment", "optimizer.second_moment")
    ]
    algorithm._peaks = (
        [weakref.ref(values) for values in stepped],
        {"params": 1e38, "first_moment": 0.0, "second_moment": 0.0},
    )
    next_state, _ = algorithm.server_update(state, aggregates[1], ctx)
    for key, value in previous.items():
        assert bits(state.arrays[key]) == bits(value), key  # the old state is intact
        assert bits(next_state.arrays[key]) == bits(states[2].arrays[key]), key


def test_step_rows_in_place_equals_the_direct_step(monkeypatch):
    rng = np.random.default_rng(3)
    classes = normalize_rows(rng.standard_normal((500, 24)).astype(np.float32))
    ids = np.sort(rng.choice(500, 123, replace=False))
    grad = rng.standard_normal((123, 24)).astype(np.float32)
    expected = normalize_rows(classes[ids] - 0.37 * grad)
    for block, threads in ((4096, 1), (10, 1), (10, 3), (1, 2)):
        monkeypatch.setattr(fedaws_module, "_ROW_BLOCK", block)
        rows = grad.copy()
        assert fedaws_module.step_rows_in_place(classes, ids, rows, 0.37, threads)
        assert bits(rows) == bits(expected)
        written = classes.copy()
        fedaws_module.write_rows(written, ids, rows, threads)
        direct = classes.copy()
        direct[ids] = expected
        assert bits(written) == bits(direct)


# --- the spreadout scatter ------------------------------------------------------------------------
def _reference_topk(W, class_ids, neighbor_ids, nu, distance):
    """The Eq. 8 gradient the direct way: one sequential index_add_ over all pairs."""
    weights = torch.as_tensor(W)
    classes = np.asarray(class_ids, dtype=np.int64)
    neighbors = np.asarray(neighbor_ids, dtype=np.int64)
    own = weights[torch.from_numpy(classes)]
    other = weights[torch.from_numpy(neighbors)]
    nu = torch.as_tensor(np.asarray(nu), dtype=weights.dtype)
    step = max(1, spreadout._PAIR_CHUNK_ELEMENTS // (neighbors.shape[1] * weights.shape[1]))
    hinges, coefs, own_grads = [], [], []
    for lo in range(0, len(classes), step):  # the products in the same chunks
        o, t = own[lo : lo + step], other[lo : lo + step]
        if distance == "cosine":
            dist = 1.0 - torch.einsum("bd,bkd->bk", o, t)
        else:
            dist = torch.linalg.vector_norm(o[:, None, :] - t, dim=2)
        hinge = torch.clamp(nu[lo : lo + step, None] - dist, min=0)
        if distance == "cosine":
            coef = 2.0 * hinge
            own_grad = torch.einsum("bk,bkd->bd", coef, t)
        else:
            coef = torch.where(dist > 0, 2.0 * hinge / torch.where(dist > 0, dist, 1.0), 0.0)
            own_grad = torch.einsum("bk,bkd->bd", coef, t) - coef.sum(1, keepdim=True) * o
        hinges.append(hinge), coefs.append(coef), own_grads.append(own_grad)
    hinge, coef = torch.cat(hinges), torch.cat(coefs)
    active = ((hinge > 0) & (coef != 0)).numpy()
    has_active = active.any(axis=1)
    ids = np.unique(np.concatenate([classes[has_active], neighbors[active]]))
    grad = torch.zeros((ids.size, weights.shape[1]), dtype=weights.dtype)
    grad[torch.from_numpy(np.searchsorted(ids, classes[has_active]))] = torch.cat(own_grads)[
        torch.from_numpy(has_active)
    ]
    pair_class, pair_rank = np.nonzero(active)
    pair_other = neighbors[pair_class, pair_rank]
    contribution = coef[pair_class, pair_rank][:, None] * own[torch.from_numpy(pair_class)]
    if distance != "cosine":
        contribution = coef[pair_class, pair_rank][:, None] * (
            own[torch.from_numpy(pair_class)] - weights[torch.from_numpy(pair_other)]
        )
    grad.index_add_(0, torch.from_numpy(np.searchsorted(ids, pair_other)), contribution)
    return grad, ids


@pytest.mark.parametrize("distance", ["cosine", "euclidean"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spreadout_scatter_adds_in_pair_order_for_any_threads(distance, dtype):
    rng = np.random.default_rng(4)
    count, dim, queries, k = 300, 12, 200, 25  # rows hit by many pairs: deep layers
    W = normalize_rows(rng.standard_normal((count, dim))).astype(dtype)
    ids = np.sort(rng.choice(count, queries, replace=False))
    neighbors = rng.integers(0, count - 1, (queries, k))
    neighbors += neighbors >= ids[:, None]
    nu = np.full(queries, 1.3, dtype=dtype)
    expected, expected_ids = _reference_topk(W, ids, neighbors, nu, distance)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for weights in (W, torch.from_numpy(W)):
                _, rows, grad_ids = spreadout.spreadout_topk(weights, ids, neighbors, nu, distance)
                assert np.array_equal(grad_ids, expected_ids)
                assert bits(rows) == bits(expected), threads
    finally:
        torch.set_num_threads(previous)


# --- evaluation ----------------------------------------------------------------------------------
@pytest.mark.parametrize("columns", [1, 7, 64])
def test_top_k_classes_is_torch_topk_of_the_full_scores(columns):
    rng = np.random.default_rng(5)
    classes = torch.from_numpy(normalize_rows(rng.standard_normal((300, 16)).astype(np.float32)))
    queries = torch.from_numpy(normalize_rows(rng.standard_normal((50, 16)).astype(np.float32)))
    direct = torch.topk(queries @ classes.T, 5, dim=1).indices
    assert torch.equal(metrics.top_k_classes(queries, classes, 5, columns), direct)
    # ties (duplicated classes, a query equal to nothing in particular): the direct way's order
    tied = torch.cat([classes, classes[:40], classes[:40]])
    zero = torch.cat([queries, torch.zeros((3, 16))])
    direct = torch.topk(zero @ tied.T, 5, dim=1).indices
    assert torch.equal(metrics.top_k_classes(zero, tied, 5, columns), direct)
    nan = queries.clone()
    nan[2] = float("nan")
    direct = torch.topk(nan @ classes.T, 5, dim=1).indices
    assert torch.equal(metrics.top_k_classes(nan, classes, 5, columns), direct)
    assert torch.equal(
        metrics.top_k_classes(queries, classes[:3], 5, columns),
        torch.topk(queries @ classes[:3].T, 3, dim=1).indices,
    )


@pytest.mark.parametrize("shape", [(2, 1), (700, 1), (333, 2), (1000, 3), (517, 64), (90, 512)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_mean_pairwise_cosine_is_the_direct_number(shape, threads, monkeypatch):
    rng = np.random.default_rng(6)
    rows = normalize_rows(rng.standard_normal(shape).astype(np.float32))
    rows[::5] *= np.float32(3.0)  # not only unit rows: more rounding to agree on
    expected = direct_mean_pairwise_cosine(rows)
    assert metrics.mean_pairwise_cosine(rows, threads) == expected
    monkeypatch.setattr(metrics, "_PAIRWISE_LEAF", 200)  # a deep pairwise tree
    monkeypatch.setattr(metrics, "_COSINE_BLOCK_ROWS", 13)  # many blocks of rows
    assert metrics.mean_pairwise_cosine(rows, threads) == expected
    assert np.isnan(metrics.mean_pairwise_cosine(rows[:1]))
    assert metrics.mean_pairwise_cosine(rows.astype(np.float64)) == direct_mean_pairwise_cosine(
        rows.astype(np.float64)
    )


@pytest.mark.parametrize("algorithm", ["fedaws", "fedaws_softmax"])
def test_evaluate_equals_the_direct_evaluation(tiny, algorithm, monkeypatch):
    _, dataset, split, classes = tiny
    options = TINY["algorithm"] if algorithm == "fedaws" else {"name": algorithm}
    config = config_module.from_dict({**TINY, "algorithm": options})
    ctx = plan_run(config, dataset).ctx
    method = Server(
        ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes)
    ).algorithm
    state = method.init_server(ctx)
    direct = ClassEmbeddingMethod.evaluate(method, state, dataset.test_x, dataset.test_y, ctx)
    monkeypatch.setattr(metrics, "_SCORE_COLUMNS", 7)  # blocks of classes
    monkeypatch.setattr(metrics, "_COSINE_BLOCK_ROWS", 5)
    assert method.evaluate(state, dataset.test_x, dataset.test_y, ctx) == direct


# --- the exact index -----------------------------------------------------------------------------
def test_exact_dot_is_the_same_for_any_chunks_and_threads():
    rng = np.random.default_rng(7)
    left = torch.from_numpy(rng.standard_normal((50, 37)).astype(np.float32))
    right = torch.from_numpy(rng.standard_normal((400, 37)).astype(np.float32))
    li = torch.from_numpy(rng.integers(0, 50, 5000))
    ri = torch.from_numpy(rng.integers(0, 400, 5000))
    expected = exact_dot(left, li, right, ri, max_elements=1 << 22)
    previous = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            for elements in (64, 1000, 1 << 22):
                assert bits(exact_dot(left, li, right, ri, max_elements=elements)) == bits(expected)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("shards", [1, 3])
def test_sharded_update_by_slices_equals_update_by_any_order(shards):
    rng = np.random.default_rng(8)
    rows = normalize_rows(rng.standard_normal((200, 8)).astype(np.float32))
    a = build_index("exact", 200, 8, shards=shards)
    b = build_index("exact", 200, 8, shards=shards)
    a.reset(rows)
    b.reset(rows)
    ids = np.sort(rng.choice(200, 60, replace=False))
    new = normalize_rows(rng.standard_normal((60, 8)).astype(np.float32))
    a.update(ids, new)  # increasing: one slice per shard
    shuffle = rng.permutation(60)
    b.update(ids[shuffle], new[shuffle])
    queries = np.arange(0, 200, 9)
    for index in (a, b):
        index_rows = np.concatenate([s.rows.numpy() for s in index.shards])
        expected = rows.copy()
        expected[ids] = new
        assert bits(index_rows) == bits(expected)
    assert bits(a.search(queries, expected[queries], 5)[0]) == bits(
        b.search(queries, expected[queries], 5)[0]
    )
    with pytest.raises(ValueError, match="twice"):
        a.update(np.array([3, 5, 3]), new[:3])


def test_server_threads_sets_and_restores_the_thread_counts():
    previous = torch.get_num_threads()
    with server_threads(1) as count:
        assert count == 1 and torch.get_num_threads() == 1
        with server_threads(2):
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == previous
