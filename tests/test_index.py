"""Nearest-class indexes (raysim.index): exactness across shard layouts, exclusion, updates,
approximate recall, and config errors."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.errors import ConfigError
from raysim.index import MISSING_ID, ExactIndex, build_index, merge, shard_bounds


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These searches are tiny: on a loaded 2-core box, OpenMP thread hand-offs would dominate."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def normalized(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def clustered(num_rows: int, dim: int, clusters: int, noise: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centres = normalized(rng.standard_normal((clusters, dim)))
    labels = rng.integers(0, clusters, num_rows)
    return normalized(centres[labels] + noise * rng.standard_normal((num_rows, dim)))


def near_ties(num_rows: int = 3000, dim: int = 48, seed: int = 0) -> np.ndarray:
    """Clustered rows plus piles of near-duplicates (float32 GEMM cannot order them)."""
    rng = np.random.default_rng(seed)
    rows = clustered(num_rows, dim, 30, 0.4, seed)
    for start in (100, 1400, 2200):  # 200-row piles, 1e-7 apart, straddling shard borders
        rows[start : start + 200] = rows[start] + 1e-7 * rng.standard_normal((200, dim))
    rows[2900:2950] = rows[5]  # exact duplicates of another row: true ties, decided by id
    return normalized(rows)


def brute_force(rows: np.ndarray, query_ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The specification: float64 dot products, rounded to float32, best first, ties by id."""
    sims = (rows[query_ids].astype(np.float64) @ rows.astype(np.float64).T).astype(np.float32)
    sims[np.arange(len(query_ids)), query_ids] = -np.inf
    ids = np.broadcast_to(np.arange(len(rows)), sims.shape)
    order = np.lexsort((ids, -sims), axis=-1)[:, :k]
    return order, np.take_along_axis(sims, order, axis=1)


def recall(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [len(set(a) & set(b)) for a, b in zip(found, truth, strict=True)]
    return float(np.mean(hits)) / truth.shape[1]


@pytest.fixture(scope="module")
def tied_rows() -> np.ndarray:
    return near_ties()


@pytest.fixture(scope="module")
def tied_queries(tied_rows) -> np.ndarray:
    rng = np.random.default_rng(1)
    picked = rng.choice(len(tied_rows), 150, replace=False)
    return np.concatenate([picked, [100, 101, 1450, 2250, 2399, 5, 2900, 2949]])


def test_exact_one_and_four_shards_give_identical_ids_and_similarities(tied_rows, tied_queries):
    k = 40
    one = build_index("exact", *tied_rows.shape, shards=1)
    four = build_index(
        "exact", *tied_rows.shape, shards=4, max_block_elements=20_000, engine="torch"
    )
    one.reset(tied_rows)
    four.reset(tied_rows)
    ids_one, sims_one = one.search(tied_queries, tied_rows[tied_queries], k)
    ids_four, sims_four = four.search(tied_queries, tied_rows[tied_queries], k)
    np.testing.assert_array_equal(ids_one, ids_four)
    np.testing.assert_array_equal(sims_one, sims_four)
    # ... and both equal the float64 specification, ties by id included
    truth_ids, truth_sims = brute_force(tied_rows, tied_queries, k)
    np.testing.assert_array_equal(ids_one, truth_ids)
    np.testing.assert_array_equal(sims_one, truth_sims)
    # the near-tie piles really exercised the exact fallback
    assert sum(d.get("fallback_queries", 0) for d in four.diagnostics()) > 0


def test_every_shard_count_and_block_size_agrees(tied_rows, tied_queries):
    k = 25
    reference = build_index("exact", *tied_rows.shape)
    reference.reset(tied_rows)
    expected = reference.search(tied_queries, tied_rows[tied_queries], k)
    for shards, block in ((2, 1 << 25), (3, 100_000), (7, 50_000)):
        index = build_index(
            "exact", *tied_rows.shape, shards=shards, max_block_elements=block, engine="torch"
        )
        index.reset(tied_rows)
        ids, sims = index.search(tied_queries, tied_rows[tied_queries], k)
        np.testing.assert_array_equal(ids, expected[0])
        np.testing.assert_array_equal(sims, expected[1])


def test_torch_and_faiss_engines_agree_bit_for_bit(tied_rows, tied_queries):
    answers = []
    for engine in ("torch", "faiss"):
        index = build_index("exact", *tied_rows.shape, shards=3, engine=engine, device="cpu")
        index.reset(tied_rows)
        answers.append(index.search(tied_queries, tied_rows[tied_queries], 35))
    np.testing.assert_array_equal(answers[0][0], answers[1][0])
    np.testing.assert_array_equal(answers[0][1], answers[1][1])


def test_merge_orders_by_similarity_then_id():
    a = (np.array([[4, 9, MISSING_ID]]), np.array([[0.5, 0.25, -np.inf]], dtype=np.float32))
    b = (np.array([[2, 7, 1]]), np.array([[0.5, 0.25, 0.1]], dtype=np.float32))
    ids, sims = merge([a, b], 5)
    np.testing.assert_array_equal(ids, [[2, 4, 7, 9, 1]])
    np.testing.assert_array_equal(sims, np.float32([[0.5, 0.5, 0.25, 0.25, 0.1]]))


def test_query_is_excluded_even_with_identical_rows_and_k_all_others():
    rows = normalized(np.random.default_rng(0).standard_normal((9, 4)))
    rows[3] = rows[6] = rows[0]  # rows 0, 3, 6 identical
    for shards in (1, 4):
        index = build_index("exact", 9, 4, shards=shards)
        index.reset(rows)
        ids, sims = index.search(np.array([3, 0]), rows[[3, 0]], 8)  # k = every other row
        assert 3 not in ids[0] and 0 not in ids[1]
        assert sorted(ids[0]) == [0, 1, 2, 4, 5, 6, 7, 8]
        np.testing.assert_array_equal(ids[0][:2], [0, 6])  # the duplicates, tie broken by id
        np.testing.assert_array_equal(ids[1][:2], [3, 6])
        assert sims[0][0] == sims[0][1] == pytest.approx(1.0, abs=1e-6)


def test_a_shard_smaller_than_k_still_yields_k_neighbours():
    rows = clustered(10, 8, 2, 0.3, seed=3)
    index = build_index("exact", 10, 8, shards=4)  # shards of 2-3 rows, k = 8
    index.reset(rows)
    ids, _ = index.search(np.arange(10), rows, 8)
    truth, _ = brute_force(rows, np.arange(10), 8)
    np.testing.assert_array_equal(ids, truth)


def test_update_replaces_rows_in_place():
    rows = clustered(2000, 16, 10, 0.5, seed=4)
    for shards in (1, 3):
        index = build_index("exact", 2000, 16, shards=shards)
        index.reset(rows)
        moved = rows.copy()
        changed = np.array([5, 700, 1999])
        moved[changed] = moved[[10, 10, 20]]  # 5 and 700 become copies of 10, 1999 of 20
        index.update(changed, moved[changed])
        ids, _ = index.search(np.array([10, 20]), moved[[10, 20]], 3)
        np.testing.assert_array_equal(ids[0][:2], [5, 700])
        assert ids[1][0] == 1999
        queries = np.arange(0, 2000, 37)
        ids, sims = index.search(queries, moved[queries], 10)
        truth_ids, truth_sims = brute_force(moved, queries, 10)
        np.testing.assert_array_equal(ids, truth_ids)
        np.testing.assert_array_equal(sims, truth_sims)


@pytest.mark.parametrize(
    "backend, options",
    [("faiss_ivf", {"nlist": 32, "nprobe": 8}), ("hnsw", {"M": 12, "ef_search": 64})],
)
def test_approximate_backends_reach_high_recall_and_exclude_the_query(backend, options):
    rows = clustered(4000, 32, 40, 0.08, seed=5)  # easy: tight clusters
    queries = np.arange(0, 4000, 16)
    k = 20
    truth, _ = brute_force(rows, queries, k)
    for shards in (1, 2):
        index = build_index(backend, 4000, 32, shards=shards, **options)
        index.reset(rows)
        ids, sims = index.search(queries, rows[queries], k)
        assert ids.shape == (len(queries), k) and (ids >= 0).all()
        assert not (ids == queries[:, None]).any()
        assert all(len(set(row)) == k for row in ids)
        assert np.all(np.diff(sims, axis=1) <= 0)
        assert recall(ids, truth) > 0.95, (backend, shards, recall(ids, truth))
        # in-place update: move row 7 onto query 0's position; it must come first
        index.update(np.array([7]), rows[[0]])
        ids, _ = index.search(np.array([0]), rows[[0]], k)
        assert ids[0, 0] == 7


def test_hnsw_relinks_only_rows_that_moved_far_and_rescores_exactly():
    rows = clustered(3000, 16, 30, 0.1, seed=8)
    index = build_index("hnsw", 3000, 16, M=8, relink_distance=0.05)
    index.reset(rows)
    moved = rows.copy()
    nudged = np.arange(0, 3000, 10)  # tiny moves: kept in place in the graph
    moved[nudged] = normalized(moved[nudged] + 0.001 * np.ones(16, np.float32))
    moved[[1, 2]] = moved[[500, 600]]  # big moves: re-linked
    changed = np.concatenate([nudged, [1, 2]])
    index.update(changed, moved[changed])
    counters = index.diagnostics()[0]
    assert counters["relinked_rows"] == 2 and counters["skipped_rows"] == len(nudged)
    queries = np.array([500, 600, 30, 40])
    ids, sims = index.search(queries, moved[queries], 10)
    assert ids[0, 0] == 1 and ids[1, 0] == 2
    # similarities are exact dot products with the current rows (the exact index's numbers)
    exact = build_index("exact", 3000, 16)
    exact.reset(moved)
    exact_ids, exact_sims = exact.search(queries, moved[queries], 10)
    expected = (moved[queries, None, :].astype(np.float64) * moved[ids]).sum(-1)
    np.testing.assert_allclose(sims, expected, rtol=0, atol=1e-6)
    same = ids == exact_ids
    np.testing.assert_array_equal(sims[same], exact_sims[same])


def test_hnsw_graph_follows_rows_and_seed_alone_and_parallel_build_is_opt_in():
    """The graph is written by one thread unless `parallel_build` (a parallel insertion links
    rows in the order the threads reach them): two builds and updates give the same answers,
    and a parallel build still answers; a non-boolean parallel_build is refused."""
    rows = clustered(3000, 16, 30, 0.1, seed=9)
    queries = np.arange(0, 3000, 7)
    answers = []
    for _ in range(2):
        index = build_index("hnsw", 3000, 16, M=8, threads=2)
        index.reset(rows)
        index.update(np.arange(0, 3000, 5), rows[np.arange(1, 3000, 5)])
        answers.append(index.search(queries, rows[queries], 5))
    np.testing.assert_array_equal(answers[0][0], answers[1][0])
    np.testing.assert_array_equal(answers[0][1], answers[1][1])
    fast = build_index("hnsw", 3000, 16, M=8, threads=2, parallel_build=True)
    fast.reset(rows)
    ids, _ = fast.search(queries, rows[queries], 5)
    assert (ids >= 0).all()
    with pytest.raises(ConfigError, match="parallel_build"):
        build_index("hnsw", 10, 4, parallel_build="yes")


def test_ivf_with_few_probes_still_returns_k_and_retrains():
    rows = clustered(3000, 16, 30, 0.3, seed=6)
    index = build_index("faiss_ivf", 3000, 16, nlist=60, nprobe=1, retrain_every=2)
    index.reset(rows)
    ids, _ = index.search(np.arange(50), rows[:50], 150)  # more than a single list holds
    assert (ids >= 0).all() and not (ids == np.arange(50)[:, None]).any()
    assert index.diagnostics()[0]["trainings"] == 1
    index.update(np.array([1, 2]), rows[[3, 4]])
    index.update(np.array([1, 2]), rows[[1, 2]])
    assert index.diagnostics()[0]["trainings"] == 2


def test_exact_index_memory_bound_does_not_change_answers():
    rows = clustered(12_000, 16, 12, 0.4, seed=7)
    queries = np.arange(0, 12_000, 30)
    # 16 queries x 4096 rows per score block: 3 row blocks (threshold path), 25 query blocks
    small = ExactIndex(12_000, 16, max_block_elements=1 << 16, device="cpu", engine="torch")
    small.reset(rows)
    ids, sims = small.search(queries, rows[queries], 12)
    truth_ids, truth_sims = brute_force(rows, queries, 12)
    np.testing.assert_array_equal(ids, truth_ids)
    np.testing.assert_array_equal(sims, truth_sims)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"backend": "exakt"}, "index.backend: unknown index 'exakt' (did you mean 'exact'?)"),
        ({"backend": "exact", "shards": 0}, "index.shards must be in [1, 100]"),
        ({"backend": "exact", "shards": 2.5}, "'index.shards' expects an integer"),
        ({"backend": "faiss_ivf", "nlsit": 4}, "unknown option 'index.nlsit'"),
        ({"backend": "faiss_ivf", "nlist": 80, "shards": 2}, "index.nlist must be in [1, 50]"),
        ({"backend": "faiss_ivf", "nprobe": "8"}, "'index.nprobe' expects int"),
        ({"backend": "hnsw", "M": 1}, "index.M must be >= 2"),
        ({"backend": "hnsw", "relink_distance": 3}, "index.relink_distance must be in [0, 2]"),
        ({"backend": "exact", "device": "tpu"}, "index.device must be"),
        ({"backend": "exact", "engine": "blas"}, "index.engine must be"),
        ({"backend": "exact", "num_gpus": -1}, "'index.num_gpus' expects a number >= 0"),
    ],
)
def test_bad_index_config_names_the_key(kwargs, message):
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend")
    with pytest.raises(ConfigError) as error:
        build_index(backend, 100, 8, **kwargs)
    assert message in str(error.value)


def test_search_rejects_k_without_room_for_the_exclusion():
    index = build_index("exact", 5, 3)
    index.reset(normalized(np.ones((5, 3))))
    with pytest.raises(ValueError, match="k must be >= 1, at most num_rows - 1 = 4"):
        index.search(np.array([0]), np.ones((1, 3), np.float32), 5)


def test_shard_bounds_are_contiguous_blocks():
    np.testing.assert_array_equal(shard_bounds(10, 4), [0, 2, 5, 7, 10])


@pytest.mark.ray
def test_ray_actor_shards_match_in_process_exact(ray_session, tied_rows, tied_queries):
    k = 30
    local = build_index("exact", *tied_rows.shape)
    local.reset(tied_rows)
    expected = local.search(tied_queries, tied_rows[tied_queries], k)
    with build_index("exact", *tied_rows.shape, shards=2, use_ray=True, device="cpu") as remote:
        remote.reset(tied_rows)
        ids, sims = remote.search(tied_queries, tied_rows[tied_queries], k)
        np.testing.assert_array_equal(ids, expected[0])
        np.testing.assert_array_equal(sims, expected[1])
        # updates are routed to the right actors
        changed = np.array([0, 1500, 2999])
        moved = tied_rows.copy()
        moved[changed] = moved[[700, 700, 700]]
        remote.update(changed, moved[changed])
        ids, _ = remote.search(np.array([700]), moved[[700]], 3)
        np.testing.assert_array_equal(ids[0], [0, 1500, 2999])
