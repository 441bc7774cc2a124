"""FedAwS / Softmax-oracle dense deltas folded where the clients trained them (a GPU's rows stay
there; here the same code runs on CPU tensors): the device fold equals the host fold bit for bit,
refuses the same values with the same words and leaves its sum as it was; whole runs give the
same model whether rows stay tensors or not; a batched task folds one chunk before the next
trains, so one chunk's trained rows are alive at a time."""

from __future__ import annotations

import gc
import itertools
import weakref

import numpy as np
import pytest
import torch
from test_fixed_point_fold import _values  # values over many magnitudes, with exact ties

from raysim.algorithms import class_embedding, fedaws_bag_batched
from raysim.algorithms.fedaws_reduce import TaskReducer
from raysim.algorithms.fedaws_wire import DenseDelta
from raysim.api import run
from raysim.core import batched_training
from raysim.core.fixed_point import (
    EXACT_FLOAT64,
    FIXED_LIMIT,
    FIXED_SCALE,
    FOLD_SCRATCH,
    add_fixed_in_place,
    add_fixed_where_they_lie,
    to_fixed,
)
from raysim.core.state import ClientUpdate


def _pair(rng, size):
    """(trained, base): float32 arrays whose difference is `_values`-like."""
    base = _values(rng, size)
    return (base + _values(rng, size)).astype(np.float32), base


@pytest.mark.parametrize("size", [0, 1, FOLD_SCRATCH, 3 * FOLD_SCRATCH + 123])
def test_the_device_fold_equals_the_host_fold_bit_for_bit(size):
    rng = np.random.default_rng(size)
    host = np.zeros(size, dtype=np.float64)
    device = torch.zeros(size, dtype=torch.float64)
    expected = np.zeros(size, dtype=np.int64)
    for weight, zero_base in itertools.product((1, 3, 64, 1000, 2**28), (False, True)):
        trained, base = _pair(rng, size)
        if zero_base:  # the difference is `_values` itself: its exact ties reach the rounding
            trained, base = _values(rng, size), np.zeros(size, dtype=np.float32)
        difference = np.subtract(trained, base, dtype=np.float32)
        if size:  # keep weight x value in range
            difference_peak = float(np.abs(difference).max())
            if difference_peak * weight * FIXED_SCALE >= FIXED_LIMIT:
                continue
        expected += to_fixed(difference, weight, 0)
        peak_host = add_fixed_in_place(host, DenseDelta(trained, base), weight)
        peak_device = add_fixed_where_they_lie(
            device, torch.from_numpy(trained), torch.from_numpy(base), weight
        )
        assert peak_device == peak_host
    assert device.numpy().tobytes() == host.tobytes()
    assert np.array_equal(host.astype(np.int64), expected)


@pytest.mark.parametrize(
    "bad",
    [
        [(2, np.nan)],
        [(0, np.inf)],
        [(1, -np.inf)],
        [(2, "large")],
        # the first failing block decides, as in the host's chunk order
        [(1, "large"), (2, np.nan)],
        [(1, np.nan), (2, "large")],
        [(3, "large")],  # the last, partial block
    ],
)
def test_a_bad_block_gives_the_host_peak_and_leaves_the_device_sum_as_it_was(bad):
    rng = np.random.default_rng(4)
    size, weight = 3 * FOLD_SCRATCH + 50, 7
    host = np.zeros(size, dtype=np.float64)
    device = torch.zeros(size, dtype=torch.float64)
    trained, base = _pair(rng, size)
    add_fixed_in_place(host, DenseDelta(trained, base), 5)
    add_fixed_where_they_lie(device, torch.from_numpy(trained), torch.from_numpy(base), 5)
    before = device.clone()
    trained, base = _pair(rng, size)
    for block, value in bad:
        position = min(size - 1, block * FOLD_SCRATCH + 5)
        large = np.float32(FIXED_LIMIT / (weight * FIXED_SCALE)) * np.float32(2)
        trained[position] = large if value == "large" else value
        base[position] = 0.0
    peak_host = add_fixed_in_place(host, DenseDelta(trained, base), weight)
    peak_device = add_fixed_where_they_lie(
        device, torch.from_numpy(trained), torch.from_numpy(base), weight
    )
    assert not peak_host * weight * FIXED_SCALE < FIXED_LIMIT
    assert str(peak_device) == str(peak_host)  # (nan == nan is False; the text compares them)
    assert torch.equal(device, before)
    assert device.numpy().tobytes() == host.tobytes()


class _Layout:
    """A model without an embedding bag: the dense part is the whole vector."""

    bag = None

    def __init__(self, size: int) -> None:
        self.size = size


def _update(client: int, trained, base, samples: int) -> ClientUpdate:
    return ClientUpdate(client, samples, {"dense": DenseDelta(trained, base)})


def _reduce(messages, as_tensors) -> tuple[list, dict]:
    """Each (trained, base, samples) folded by a fresh reducer, as tensors where `as_tensors`
    says so (one flag per message); the refusals and the result."""
    size = len(messages[0][0])
    reducer = TaskReducer(_Layout(size), num_classes=4, dim=3)
    refusals = []
    for client, ((trained, base, samples), tensors) in enumerate(
        zip(messages, as_tensors, strict=True)
    ):
        if tensors:
            trained, base = torch.from_numpy(trained), torch.from_numpy(base)
        refusals.append(reducer.add(_update(client, trained, base, samples)))
    return refusals, reducer.result()


def test_the_reducer_gives_the_same_sum_and_refusals_for_tensors_and_arrays():
    rng = np.random.default_rng(7)
    size = 2 * FOLD_SCRATCH + 9
    messages = [(*_pair(rng, size), samples) for samples in (1, 4, 2, 9, 3)]
    messages[1][0][-1] = np.nan  # refused: NaN
    messages[3][0][FOLD_SCRATCH] = np.float32(2.0**30)  # refused: too large
    host = _reduce(messages, [False] * 5)
    assert host[0][1] == "'dense' holds NaN or Inf"
    assert "too large for exact aggregation" in host[0][3]
    for as_tensors in ([True] * 5, [True, False, True, False, True], [False, True] * 2 + [True]):
        refusals, result = _reduce(messages, as_tensors)
        assert refusals == host[0]
        assert result["dense"].dtype == np.int64
        assert result["dense"].tobytes() == host[1]["dense"].tobytes()
        assert (result["weight"], result["bounds"]) == (host[1]["weight"], host[1]["bounds"])


def test_the_reducer_leaves_the_device_past_2_53_and_stays_exact():
    """Terms near 2^52: past 2^53 the sum moves to int64 on the host and stays exact."""
    size = FOLD_SCRATCH + 10
    rng = np.random.default_rng(5)
    near_limit = np.float32(0.9 * FIXED_LIMIT / FIXED_SCALE)
    reducer = TaskReducer(_Layout(size), num_classes=4, dim=3)
    expected = [0] * size
    for client in range(4):
        dense = (rng.uniform(-1, 1, size) * near_limit).astype(np.float32)
        dense[0] = near_limit
        base = np.zeros(size, dtype=np.float32)
        update = _update(client, torch.from_numpy(dense), torch.from_numpy(base), 1)
        assert reducer.add(update) is None
        expected = [e + int(t) for e, t in zip(expected, to_fixed(dense, 1, client), strict=True)]
    assert reducer.bounds["dense"] > EXACT_FLOAT64
    assert isinstance(reducer.dense, np.ndarray) and reducer.dense.dtype == np.int64
    assert reducer.result()["dense"].tolist() == expected


def test_a_tensor_dense_delta_reads_as_its_array_and_pickles_as_one():
    import pickle

    rng = np.random.default_rng(8)
    trained, base = _pair(rng, 100)
    delta = DenseDelta(torch.from_numpy(trained), torch.from_numpy(base))
    expected = np.subtract(trained, base, dtype=np.float32)
    assert delta.tensors is not None
    assert np.asarray(delta).tobytes() == expected.tobytes()
    assert delta.tensors is None  # materialised: now an array of its own
    assert pickle.loads(pickle.dumps(delta)).tobytes() == expected.tobytes()
    with pytest.raises(ValueError, match="both be arrays or both tensors"):
        DenseDelta(torch.from_numpy(trained), base)


# --- whole runs ----------------------------------------------------------------------------------

MLP_DIGITS = {
    "run": {"seed": 1, "rounds": 2, "eval_every": 2},
    "data": {"name": "digits"},
    "partition": {"name": "one_class", "num_clients": 10},
    "clients": {
        "per_round": 6,
        "local_epochs": 2,
        "batch_size": 16,
        "lr": 0.5,
        "momentum": 0.9,
    },
    "model": {"name": "mlp_embedding", "hidden": [32], "embedding_dim": 16},
    "algorithm": {"name": "fedaws", "class_lr": 0.3, "spreadout": "full"},
    "runtime": {"backend": "local"},
}

BAG_XML = {
    "run": {"seed": 2, "rounds": 2, "eval_every": 2},
    "data": {
        "name": "synthetic_xml",
        "num_labels": 30,
        "num_features": 120,
        "num_train": 300,
        "num_test": 40,
    },
    "partition": {"name": "one_class", "num_clients": 30},
    "clients": {"per_round": 8, "local_epochs": 2, "batch_size": 4, "lr": 1.0},
    "model": {"name": "xml_embedding_bag", "bag_dim": 8, "hidden": [16], "embedding_dim": 8},
    "algorithm": {"name": "fedaws", "k": 3},
    "runtime": {"backend": "local"},
}


def _with(raw: dict, **sections) -> dict:
    out = {key: dict(value) for key, value in raw.items()}
    for key, value in sections.items():  # (a section naming another method replaces it)
        out[key] = dict(value) if "name" in value else {**out.get(key, {}), **value}
    return out


@pytest.mark.parametrize(
    "raw",
    [
        _with(MLP_DIGITS, clients={"batched": True, "batch_chunk": 4}),
        _with(MLP_DIGITS),
        _with(
            MLP_DIGITS,
            algorithm={"name": "fedaws_softmax", "scale": 4.0, "class_lr": 0.3},
            clients={"batched": True},
        ),
        _with(BAG_XML, clients={"batched": True, "batch_chunk": 3}),
        _with(BAG_XML),
    ],
    ids=["mlp-batched", "mlp-sequential", "softmax-batched", "bag-batched", "bag-sequential"],
)
def test_rows_kept_as_tensors_give_the_same_run_bit_for_bit(raw, tmp_path, monkeypatch):
    from raysim import config as config_module

    monkeypatch.setattr(fedaws_bag_batched, "BATCH_ON_CPU", True)
    states = []
    for as_tensors in (False, True):
        monkeypatch.setattr(class_embedding, "ROWS_AS_TENSORS_ON_CPU", as_tensors)
        config = config_module.from_dict(raw)
        result = run(config, tmp_path / str(as_tensors), progress=False, tensorboard=False)
        assert np.isfinite(result.summary["final"]["train_loss"])
        states.append(result.state)
    for key in ("params", "class_embeddings"):
        assert states[0].arrays[key].tobytes() == states[1].arrays[key].tobytes(), key


def test_a_batched_task_folds_each_chunk_before_the_next_trains(tmp_path, monkeypatch):
    """With rows kept as tensors, the trained rows of a chunk are gone (folded, nothing holding
    them) when the next chunk starts training: one chunk's rows are alive at a time."""
    from raysim import config as config_module

    monkeypatch.setattr(class_embedding, "ROWS_AS_TENSORS_ON_CPU", True)
    alive_at_start = []
    previous: list[weakref.ref] = []
    original = batched_training.train_batched

    def watched(step, starts, batch):
        gc.collect()
        alive_at_start.append([ref() is not None for ref in previous])
        trained, losses = original(step, starts, batch)
        previous.append(weakref.ref(trained))
        return trained, losses

    monkeypatch.setattr(batched_training, "train_batched", watched)
    raw = _with(MLP_DIGITS, clients={"batched": True, "batch_chunk": 2})
    raw["run"] = {**raw["run"], "rounds": 1, "eval_every": 1}
    run(config_module.from_dict(raw), tmp_path, progress=False, tensorboard=False)
    assert len(alive_at_start) == 3  # 6 clients in chunks of 2
    assert all(not any(alive) for alive in alive_at_start)


@pytest.mark.parametrize("raw", [MLP_DIGITS, BAG_XML], ids=["mlp", "bag"])
def test_rows_on_the_device_start_from_one_copy_of_theta_per_payload(raw, monkeypatch):
    """Clients whose rows stay on the device start from theta's dense part copied there once
    per payload (the same tensor for every client of it); a new payload over theta stepped in
    place (FedAwS's server) gets a new copy with the new values."""
    from raysim import config as config_module
    from raysim.algorithms.fedaws_wire import Broadcast
    from raysim.assembly import plan_run
    from raysim.core.server import build_algorithm
    from raysim.data.datasets import load_dataset

    monkeypatch.setattr(class_embedding, "ROWS_AS_TENSORS_ON_CPU", True)
    config = config_module.from_dict(raw)
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    ctx, split = plan.ctx, plan.split
    algorithm = build_algorithm(ctx)
    state = algorithm.init_server(ctx)
    theta = state.arrays["params"]
    ids = (1, 4)
    xs = [
        torch.from_numpy(dataset.train_x[split.indices[split.offsets[c] : split.offsets[c + 1]]])
        for c in ids
    ]
    personal = algorithm.client_payload(state, np.array(ids), np.array([0, 1]))

    def starts(payload):
        step = algorithm.client_step(payload, ctx)
        assert step.as_tensor
        return algorithm.client_chunk(payload, step, ids, xs, personal, ctx).starts

    payload = Broadcast(theta)
    first, again = starts(payload), starts(payload)
    shared = first[0].parts[0]
    assert isinstance(shared, torch.Tensor)
    assert all(start.parts[0] is shared for start in (*first, *again))
    before = shared.clone()
    theta += 1.0  # the server's in-place step, then the next round's payload
    second = starts(Broadcast(theta))
    assert second[0].parts[0] is not shared
    assert torch.equal(second[0].parts[0], before + 1.0)
