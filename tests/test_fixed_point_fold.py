"""The FedAwS task reducer's dense sum: float64 while exact, folded a chunk at a time with the
values checked on the way, equals the int64 fixed-point sum bit for bit; a refused message
leaves the sum untouched; past 2^53 the sum moves to int64 and stays exact."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from raysim.algorithms.fedaws_reduce import TaskReducer as _Reducer
from raysim.core.fixed_point import (
    EXACT_FLOAT64,
    FIXED_LIMIT,
    FIXED_SCALE,
    FOLD_SCRATCH,
    add_fixed_in_place,
    to_fixed,
)
from raysim.core.state import ClientUpdate


def _values(rng: np.random.Generator, size: int) -> np.ndarray:
    """float32 values over many magnitudes, with exact half-way cases for rounding."""
    values = (rng.standard_normal(size) * 10.0 ** rng.integers(-9, 1, size)).astype(np.float32)
    values[::7] = np.float32(0.5) / np.float32(FIXED_SCALE)  # x 2^32 = 0.5: a tie
    values[3::11] = np.float32(-2.5) / np.float32(FIXED_SCALE)
    return values


def test_chunked_float64_fold_equals_the_int64_sum():
    rng = np.random.default_rng(3)
    size = 3 * FOLD_SCRATCH + 123  # several chunks and a partial one
    expected = np.zeros(size, dtype=np.int64)
    total = np.zeros(size, dtype=np.float64)
    for weight in (1, 3, 64, 1000):
        values = _values(rng, size)
        expected += to_fixed(values, weight, 0)
        peak = add_fixed_in_place(total, values, weight)
        assert peak == float(np.abs(values).max())
    assert np.array_equal(total.astype(np.int64), expected)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, "large"])
def test_a_bad_chunk_leaves_the_sum_as_it_was(bad):
    rng = np.random.default_rng(4)
    size = 3 * FOLD_SCRATCH
    total = np.zeros(size, dtype=np.float64)
    add_fixed_in_place(total, _values(rng, size), 5)
    before = total.copy()
    values = _values(rng, size)
    weight = 7
    # in the third chunk: two chunks were already added when it is found
    values[2 * FOLD_SCRATCH + 5] = (
        np.float32(FIXED_LIMIT / (weight * FIXED_SCALE)) if bad == "large" else bad
    )
    peak = add_fixed_in_place(total, values, weight)
    assert not peak * weight * FIXED_SCALE < FIXED_LIMIT
    assert total.tobytes() == before.tobytes()


class _Layout:
    """A model without an embedding bag: the dense part is the whole vector."""

    bag = None

    def __init__(self, size: int) -> None:
        self.size = size


def _update(client: int, dense: np.ndarray, samples: int) -> ClientUpdate:
    return ClientUpdate(client_id=client, num_samples=samples, vector={"dense": dense})


def test_the_reducer_moves_to_int64_past_2_53_and_stays_exact():
    """Terms near the limit 2^52: the third takes the bound past 2^53, where float64 would
    round; the reducer switches to int64 and its sum equals the exact integer sum."""
    size = FOLD_SCRATCH + 10
    reducer = _Reducer(_Layout(size), num_classes=4, dim=3)
    rng = np.random.default_rng(5)
    near_limit = np.float32(0.9 * FIXED_LIMIT / FIXED_SCALE)  # weight 1: |term| ~ 0.9 x 2^52
    expected = [0] * size
    for client in range(4):
        dense = (rng.uniform(-1, 1, size) * near_limit).astype(np.float32)
        dense[0] = near_limit  # same sign every time: the sum really exceeds 2^53
        assert reducer.add(_update(client, dense, 1)) is None
        expected = [e + int(t) for e, t in zip(expected, to_fixed(dense, 1, client), strict=True)]
    assert reducer.bounds["dense"] > EXACT_FLOAT64
    assert reducer.dense.dtype == np.int64
    result = reducer.result()["dense"]
    assert result.tolist() == expected
    assert result[0] > EXACT_FLOAT64  # beyond float64's exact integers


def test_the_reducer_refuses_a_bad_dense_message_and_keeps_its_sum():
    size = 2 * FOLD_SCRATCH
    reducer = _Reducer(_Layout(size), num_classes=4, dim=3)
    rng = np.random.default_rng(6)
    good = _values(rng, size)
    assert reducer.add(_update(0, good, 2)) is None
    state = reducer.dense.copy(), dict(reducer.bounds), reducer.weight
    bad = _values(rng, size)
    bad[-1] = np.nan
    assert reducer.add(_update(1, bad, 2)) == "'dense' holds NaN or Inf"
    huge = _values(rng, size)
    huge[FOLD_SCRATCH + 1] = np.float32(2.0**30)
    assert "too large for exact aggregation" in reducer.add(_update(2, huge, 2))
    assert reducer.dense.tobytes() == state[0].tobytes()
    assert (reducer.bounds, reducer.weight) == (state[1], state[2])
    assert np.array_equal(reducer.result()["dense"], to_fixed(good, 2, 0))


def _read_all(dense) -> np.ndarray:
    out, scratch = np.empty(len(dense), dtype=np.float32), np.empty(77, dtype=np.float32)
    for start in range(0, len(dense), 77):
        stop = min(len(dense), start + 77)
        out[start:stop] = dense.read_chunk(start, stop, scratch)
    return out


def test_a_client_dense_delta_is_folded_where_it_lies_and_stays_its_own():
    """A FedAwS client's dense delta (a DenseDelta over its trained values) folds into the same
    sum as its materialised array, in a different number of chunks; read after the next
    clients trained it still gives its own client's values."""
    from raysim import config as config_module
    from raysim.algorithms.fedaws_wire import DenseDelta
    from raysim.assembly import plan_run
    from raysim.core.clients import single_class_of_clients
    from raysim.core.server import build_algorithm
    from raysim.data.datasets import load_dataset
    from raysim.models.layout import layout_of
    from raysim.models.vector import cached_model
    from raysim.seeds import client_generator

    config = config_module.from_dict(
        {
            "run": {"seed": 2},
            "data": {
                "name": "synthetic_xml",
                "num_labels": 40,
                "num_features": 200,
                "num_train": 600,
                "num_test": 50,
            },  # fmt: skip
            "partition": {"name": "one_class", "num_clients": 40},
            "clients": {"per_round": 4, "local_epochs": 2, "batch_size": 4, "lr": 1.0},
            # a dense part of several chunks, split unevenly over the tensors
            "model": {
                "name": "xml_embedding_bag",
                "bag_dim": 16,
                "hidden": [400],
                "embedding_dim": 200,
            },  # fmt: skip
            "algorithm": {"name": "fedaws", "k": 3},
            "runtime": {"backend": "local"},
        }
    )
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    split, ctx = plan.split, plan.ctx
    algorithm = build_algorithm(ctx)
    state = algorithm.init_server(ctx)
    classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)
    layout = layout_of(cached_model(ctx))
    assert len(layout.dense_index) > 2 * FOLD_SCRATCH
    payload = algorithm.server_payload(state)
    lazy = _Reducer(layout, ctx.num_classes, 200)
    eager = _Reducer(layout, ctx.num_classes, 200)
    updates, copies = [], []
    for client in (3, 17, 30):
        rows = split.indices[split.offsets[client] : split.offsets[client + 1]]
        sent = algorithm.client_payload(state, np.array([client]), classes[[client]])[0]
        update = algorithm.client_update(
            (payload, sent),
            torch.from_numpy(dataset.train_x[rows]),
            torch.from_numpy(dataset.train_y[rows].astype(np.int64)),
            client,
            client_generator(ctx.seed, 0, client),
            ctx,
        )
        dense = update.vector["dense"]
        assert isinstance(dense, DenseDelta)
        copied = ClientUpdate(  # read without materialising it
            client, update.num_samples, {**update.vector, "dense": _read_all(dense)}
        )
        assert np.any(copied.vector["dense"] != 0)
        if client == 30:  # used as an array, it becomes one (the same values)
            assert np.array_equal(np.negative(dense), -copied.vector["dense"])
            assert np.array_equal(dense * 2, copied.vector["dense"] * 2)
            restored = pickle.loads(pickle.dumps(dense))
            assert type(restored) is np.ndarray
            assert restored.tobytes() == copied.vector["dense"].tobytes()
            assert dense.nbytes == restored.nbytes and dense[5] == restored[5]
        assert lazy.add(update, sent) is None
        assert eager.add(copied, sent) is None
        updates.append(update)
        copies.append(copied.vector["dense"])
    # it holds the client's own trained values: read after later clients trained, it is still
    # the first client's delta
    assert np.asarray(updates[0].vector["dense"]).tobytes() == copies[0].tobytes()
    assert lazy.result()["dense"].tobytes() == eager.result()["dense"].tobytes()
