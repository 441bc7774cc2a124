"""Batched FedAwS / Softmax-oracle clients on the embedding-bag model
(raysim/algorithms/fedaws_bag_batched.py; docs/BATCHED.md).

- FedAwS, Baseline-1, Baseline-2 and the oracle (one-class clients; the oracle also with
  clients holding many labels): every client's batched update (the dense delta, the touched
  rows' ids and deltas, its class row or W delta, its loss) equals its sequential update within
  TOLERANCE, the message's keys, order and dtypes included;
- ragged clients (1 sample, different numbers of features per sample, a sample without any,
  an empty client, different step counts) each match their own sequential training;
- a client's batched result is the same bit for bit whatever chunk it shares (alone, in pairs,
  in threes, in padded GPU-style slots; 1 and 2 threads);
- the vmapped step runs nothing client by client (no vmap fallback: the bag is pooled by a
  gather and a sum, not embedding_bag, which vmap has no batching rule for);
- end to end on the local backend: batched runs do not depend on the chunk and agree with the
  sequential run; on a CPU (the default) these clients train one at a time after one notice.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from test_fedaws import TINY

from raysim import config as config_module
from raysim.algorithms import fedaws_bag_batched
from raysim.algorithms.fedaws_wire import ClassRow
from raysim.assembly import plan_run, run
from raysim.core.algorithm import AlgorithmHooks
from raysim.core.batched_training import ClientBatch, batched_updates
from raysim.core.clients import single_class_of_clients
from raysim.core.server import build_algorithm
from raysim.data.datasets import load_dataset
from raysim.models import devices
from raysim.seeds import client_generator

# Largest |batched - sequential| entry of a client's update, relative to the magnitude of what
# was trained: max(1, the entry's largest magnitude), for the bag rows max(1, the largest
# magnitude of theta's bag table): a row delta is a trained row minus theta's, so it rounds
# as rows of magnitude ~4 do. Measured on these configs (docs/BATCHED.md): dense deltas up to
# 2.9e-7 relative (7.6e-6 absolute, clients.lr 1 with momentum 0.9), bag rows up to 2.4e-7
# absolute (5.2e-8 relative), class rows and W up to 3.0e-7 relative.
TOLERANCE = 1e-6

STRONG = {"local_epochs": 2, "batch_size": 8, "momentum": 0.9, "weight_decay": 1e-3}
ORACLE = {"name": "fedaws_softmax", "scale": 4.0, "class_lr": 0.3}
METHODS = {
    "fedaws": ({"class_lr": 0.3}, {}),
    "baseline1": ({"spreadout": "none", "class_lr": 0.3}, {}),
    "baseline2": ({"train_class_embeddings": False}, {}),
    "softmax_oracle": (ORACLE, {}),
    "softmax_oracle_many_labels": (ORACLE, {"partition": {"name": "iid"}}),
}


@pytest.fixture(autouse=True)
def batch_on_cpu(monkeypatch):
    """These tests run the batched bag path on the CPU (off there by default: slower)."""
    monkeypatch.setattr(fedaws_bag_batched, "BATCH_ON_CPU", True)


def _config(method: str = "fedaws", clients: dict | None = None, **sections):
    algorithm, extra = METHODS[method]
    raw = copy.deepcopy(TINY)
    raw["clients"].update(STRONG if clients is None else clients)
    raw["algorithm"] = dict(algorithm) if "name" in algorithm else {**raw["algorithm"], **algorithm}
    for name, values in {**extra, **sections}.items():
        raw[name] = {**raw.get(name, {}), **values}
    return config_module.from_dict(raw)


def _setup(config):
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    algorithm = build_algorithm(plan.ctx)
    state = algorithm.init_server(plan.ctx)
    return dataset, plan.split, plan.ctx, algorithm, state


def _bag_scale(state, ctx) -> float:
    """The largest magnitude of theta's bag table: what a bag row delta's rounding scales with."""
    from raysim.models.layout import layout_of
    from raysim.models.vector import cached_model

    layout = layout_of(cached_model(ctx))
    theta = state.arrays["params"]
    table = theta[layout.bag_offset : layout.bag_offset + layout.bag_rows * layout.bag_width]
    return float(np.abs(table).max())


def _close(batched: dict, expected: dict, bag_scale: float) -> None:
    """The same message as the sequential one, up to TOLERANCE on its float arrays."""
    assert list(batched) == list(expected)
    for key, value in expected.items():
        got = batched[key]
        if key == "class":
            assert got == value
            continue
        value = np.asarray(value)
        assert got.dtype == value.dtype and got.shape == value.shape, key
        if key == "bag_ids":
            assert np.array_equal(got, value)
            continue
        scale = max(1.0, float(np.abs(value).max(initial=0.0)))
        if key == "bag_rows":
            scale = max(scale, bag_scale)
        assert float(np.abs(got - value).max(initial=0.0)) <= TOLERANCE * scale, key


@pytest.mark.parametrize("method", list(METHODS))
def test_batched_bag_updates_match_sequential(method):
    dataset, split, ctx, algorithm, state = _setup(_config(method))
    hooks = AlgorithmHooks.of(algorithm)
    assert algorithm.batching_problem(ctx) is None
    payload = algorithm.server_payload(state)
    sizes = np.diff(split.offsets)
    # the smallest and the largest clients, and some between (ragged sizes and tables)
    ids = np.unique(np.concatenate([np.argsort(sizes)[[0, 1, -2, -1]], [3, 7, 12, 20, 33]]))
    personal = None
    if hooks.client_payload is not None:
        classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)[ids]
        personal = algorithm.client_payload(state, ids, classes)
    batched = batched_updates(
        ctx, hooks, payload, dataset.train_x, dataset.train_y, split.indices, split.offsets, 2,
        ids, personal,
    )  # fmt: skip
    assert batched is not None
    for position, update in enumerate(batched):
        client = int(ids[position])
        rows = split.indices[split.offsets[client] : split.offsets[client + 1]]
        x = torch.from_numpy(dataset.train_x[rows])
        y = torch.from_numpy(dataset.train_y[rows].astype(np.int64))
        sent = payload if personal is None else (payload, personal[position])
        generator = client_generator(ctx.seed, 2, client)
        reference = algorithm.client_update(sent, x, y, client, generator, ctx)
        assert float(np.abs(reference.vector["bag_rows"]).max()) > 100 * TOLERANCE  # moved
        _close(update.vector, reference.vector, _bag_scale(state, ctx))
        assert update.num_samples == reference.num_samples
        assert update.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)


# --- ragged clients, made by hand ----------------------------------------------------------------


def _ragged_clients(dataset, ctx):
    """Clients of one class each: 1 sample; samples with 1, a few and all their features;
    one sample without any feature; an empty client; a client of several batches."""
    x, y = dataset.train_x, dataset.train_y
    pad = ctx.num_features
    counts = np.bincount(y)
    largest = int(np.argmax(counts))
    assert counts[largest] >= 11
    small = int(np.flatnonzero((counts >= 4) & (np.arange(len(counts)) != largest))[0])
    first = np.flatnonzero(y == small)
    second = np.flatnonzero(y == largest)[:11]  # 2 epochs of 2 batches of 8, the last short
    trimmed = x[first[:4]].copy()
    trimmed[0, 1:] = pad  # one feature
    trimmed[1, 5:] = pad  # five
    trimmed[2, :] = pad  # none: its bag is the zero vector
    clients = [
        (x[first[:1]], y[first[:1]]),
        (trimmed, y[first[:4]]),
        (x[:0], y[:0]),
        (x[second], y[second]),
    ]
    return [(torch.from_numpy(a), torch.from_numpy(b.astype(np.int64))) for a, b in clients]


def _chunk(algorithm, state, payload, clients, positions, ctx, slots=None):
    """The batched updates of `clients[positions]` in one call."""
    rows = state.arrays["class_embeddings"]
    personal = None
    if AlgorithmHooks.of(algorithm).client_payload is not None:
        personal = tuple(
            ClassRow(int(clients[p][1][0]) if len(clients[p][1]) else 0,
                     rows[int(clients[p][1][0]) if len(clients[p][1]) else 0])
            for p in positions
        )  # fmt: skip
    batch = ClientBatch(
        client_ids=tuple(100 + p for p in positions),
        xs=tuple(clients[p][0] for p in positions),
        ys=tuple(clients[p][1] for p in positions),
        generators=tuple(client_generator(ctx.seed, 1, 100 + p) for p in positions),
        rows=8,
        slots=slots,
        personal=personal,
    )
    return algorithm.batched_client_updates(payload, batch, ctx), personal


@pytest.mark.parametrize("method", ["fedaws", "softmax_oracle"])
def test_ragged_bag_clients_each_match_their_sequential_training(method):
    dataset, _, ctx, algorithm, state = _setup(_config(method))
    payload = algorithm.server_payload(state)
    clients = _ragged_clients(dataset, ctx)
    positions = list(range(len(clients)))
    batched, personal = _chunk(algorithm, state, payload, clients, positions, ctx)
    for position, update in enumerate(batched):
        x, y = clients[position]
        sent = payload if personal is None else (payload, personal[position])
        generator = client_generator(ctx.seed, 1, 100 + position)
        reference = algorithm.client_update(sent, x, y, 100 + position, generator, ctx)
        _close(update.vector, reference.vector, _bag_scale(state, ctx))
        assert update.num_samples == reference.num_samples == len(y)
        if len(y):
            assert update.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
        else:  # no steps: nothing moved, loss 0.0 as sequentially
            assert update.metrics["loss"] == reference.metrics["loss"] == 0.0
            assert not np.asarray(update.vector["dense"]).any()
            assert len(update.vector["bag_ids"]) == 0


@pytest.mark.parametrize("threads", [1, 2])
def test_a_bag_clients_result_does_not_depend_on_its_chunk(threads):
    dataset, split, ctx, algorithm, state = _setup(_config("fedaws"))
    payload = algorithm.server_payload(state)
    clients = _ragged_clients(dataset, ctx)
    for client in (5, 17, 28):  # more clients, of other sizes and tables
        rows = split.indices[split.offsets[client] : split.offsets[client + 1]]
        clients.append((torch.from_numpy(dataset.train_x[rows]),
                        torch.from_numpy(dataset.train_y[rows].astype(np.int64))))  # fmt: skip
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, _ = _chunk(algorithm, state, payload, clients, list(range(len(clients))), ctx)
        chunks = ([0], [1, 2], [5, 3, 4], [6], [4, 6, 1], [3])
        for positions in chunks:
            for slots in (None, 5):  # as on a GPU: empty clients fill the chunk's slots
                updates, _ = _chunk(algorithm, state, payload, clients, positions, ctx, slots)
                for update, position in zip(updates, positions, strict=True):
                    alone, shared = update.vector, together[position].vector
                    assert list(alone) == list(shared)
                    assert alone.get("class") == shared.get("class")
                    for key in set(shared) - {"class"}:
                        same = np.asarray(alone[key]).tobytes() == shared[key].tobytes()
                        assert same, (positions, position, key)
                    assert update.metrics == together[position].metrics
    finally:
        torch.set_num_threads(previous)


def test_the_vmapped_bag_step_runs_nothing_client_by_client():
    """vmap runs an op without a batching rule once per client, with a warning (on a GPU, a
    chunk's launches grow with its clients); the vmapped driver runs the gathered twin of
    forward_rows, whose every op is batched. The control shows the check can fail."""
    import warnings

    from raysim.models.embedding import XMLEmbeddingBag

    dataset, split, ctx, algorithm, state = _setup(_config("fedaws"))
    payload = algorithm.server_payload(state)
    clients = _ragged_clients(dataset, ctx)
    fallback = r"There is a performance drop"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        updates, _ = _chunk(algorithm, state, payload, clients, [0, 1, 3], ctx)
    assert len(updates) == 3
    assert not [w for w in caught if fallback in str(w.message)]

    # No hidden ReLU: with one, a random draw can leave every unit dead for a bag and its rows'
    # gradients exactly zero, which made the nonzero check below fail for some draws.
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = XMLEmbeddingBag(20, 4, 4, [], sparse_gradients=False)
        tables = torch.randn(2, 3, 4)
    ids = torch.tensor([[[0, 1, 2], [3, 3, 3]], [[1, 1, 3], [0, 3, 3]]])  # padding id 3

    def pooled_sum(forward):
        return torch.func.vmap(torch.func.grad(lambda t, x: forward(x, t).sum()))(tables, ids)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = pooled_sum(model.forward_rows_gathered).detach()
    assert not [w for w in caught if fallback in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bagged = pooled_sum(
            model.forward_rows
        ).detach()  # the control: embedding_bag, client by client
    assert [w for w in caught if fallback in str(w.message)]
    assert float((gathered - bagged).abs().max()) <= 1e-6
    assert gathered[0, 2].abs().max() > 0  # the first client's bag names row 2
    assert not gathered[1, 2].any()  # the second client names no row 2: exactly 0


# --- end to end ----------------------------------------------------------------------------------


def test_batched_bag_runs_do_not_depend_on_the_chunk_and_match_sequential(tmp_path):
    states = {}
    for mode in ("false", "true-1", "true-5"):
        batched, _, chunk = mode.partition("-")
        clients = {**STRONG, "per_round": 12, "batched": batched == "true"}
        if chunk:
            clients["batch_chunk"] = int(chunk)
        config = _config("fedaws", clients, run={"rounds": 2, "eval_every": 2})
        result = run(config, tmp_path / mode, progress=False, tensorboard=False)
        states[mode] = result.state
        assert np.isfinite(result.summary["final"]["train_loss"])
    for key in ("params", "class_embeddings"):
        one, five = (states[m].arrays[key] for m in ("true-1", "true-5"))
        assert one.tobytes() == five.tobytes(), key
        sequential = states["false"].arrays[key]
        assert float(np.abs(sequential - five).max()) <= 10 * TOLERANCE, key


def test_on_a_cpu_bag_clients_train_one_at_a_time_after_one_notice(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fedaws_bag_batched, "BATCH_ON_CPU", False)
    devices._NOTICES.clear()
    finals = []
    for batched in (False, True):
        clients = {"per_round": 12, "batched": batched}
        config = _config("fedaws", clients, run={"rounds": 1, "eval_every": 1})
        finals.append(run(config, tmp_path / str(batched), progress=False, tensorboard=False))
    lines = [line for line in capsys.readouterr().err.splitlines() if "clients.batched" in line]
    assert lines == [
        "raysim: notice: clients.batched: algorithm 'fedaws': embedding-bag clients are slower "
        "batched than one at a time on a CPU; training clients one at a time (docs/BATCHED.md)"
    ]
    sequential, batched = (r.state.arrays["params"] for r in finals)
    assert sequential.tobytes() == batched.tobytes()


def test_a_new_payload_over_theta_stepped_in_place_starts_clients_from_the_new_values():
    """FedAwS's server steps theta in place, so the next round's payload holds the same array
    with new values: a client of that round starts from the new dense values (the dense part a
    task gathers once is kept per payload, not per theta array)."""
    from raysim.algorithms.fedaws_wire import Broadcast
    from raysim.models.layout import layout_of

    dataset, split, ctx, algorithm, state = _setup(_config())
    step = algorithm.client_step(algorithm.server_payload(state), ctx)
    layout = layout_of(step.model)
    theta = state.arrays["params"]
    rows = split.indices[split.offsets[3] : split.offsets[4]]
    xs = [torch.from_numpy(dataset.train_x[rows])]
    extra = [np.asarray(state.arrays["class_embeddings"][0], np.float32)]
    first = fedaws_bag_batched.bag_chunk(step, layout, Broadcast(theta), xs, extra)
    before = np.asarray(first.starts[0]).copy()
    theta += 1.0  # the server's in-place step
    second = fedaws_bag_batched.bag_chunk(step, layout, Broadcast(theta), xs, extra)
    after = np.asarray(second.starts[0])
    dense = first.notes[0].dense_size
    assert np.array_equal(after[:dense], before[:dense] + 1.0)
