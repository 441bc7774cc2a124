"""FedAwS: the positive loss, the server's row write-back, per-client payloads, exactness."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim import config as config_module
from raysim.algorithms.fedaws import FedAwS, positive_loss
from raysim.algorithms.fedaws_wire import Broadcast
from raysim.assembly import plan_run, run
from raysim.core.clients import single_class_of_clients, train_clients
from raysim.core.fixed_point import to_fixed
from raysim.core.server import Server, ServerData
from raysim.core.state import RoundInfo
from raysim.data.datasets import load_dataset
from raysim.metrics.xml import mean_pairwise_cosine, precision_at_k

TINY = {
    "run": {"seed": 3, "rounds": 3, "eval_every": 1, "checkpoint_every": 0},
    "data": {
        "name": "synthetic_xml",
        "num_labels": 40,
        "num_features": 300,
        "num_train": 800,
        "num_test": 200,
    },
    "partition": {"name": "one_class", "num_clients": 40},
    "clients": {"per_round": 12, "local_epochs": 1, "batch_size": 64, "lr": 1.0},
    "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6},
    "model": {"name": "xml_embedding_bag", "bag_dim": 16, "hidden": [32], "embedding_dim": 8},
    "algorithm": {"name": "fedaws", "k": 5, "class_lr": 0.1, "spreadout_lr": 0.01},
    "runtime": {"backend": "local"},
}


def tiny_config(**overrides) -> config_module.Config:
    config = config_module.from_dict(TINY)
    return config.replace(**overrides) if overrides else config


def test_positive_loss_matches_hand_computation():
    embeddings = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    row = torch.tensor([3.0, 4.0], requires_grad=True)  # unit row (0.6, 0.8)
    loss = positive_loss(embeddings, row, 0.9)
    # similarities 0.6 and 1.0 -> hinge 0.3 and 0 -> mean of squares 0.045
    assert float(loss.detach()) == pytest.approx(0.045, abs=1e-7)
    loss.backward()
    # d/dw of 0.5 * (0.9 - e.w/|w|)^2 for e = (1, 0): -(0.3) * (e - (e.u) u) / |w|
    unit = np.array([0.6, 0.8])
    e = np.array([1.0, 0.0])
    expected = -0.3 * (e - e.dot(unit) * unit) / 5.0
    np.testing.assert_allclose(row.grad.numpy(), expected, atol=1e-7)


def test_fixed_point_sum_is_exact_in_any_grouping():
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(50).astype(np.float32) * 1e-3 for _ in range(7)]
    weights = [3, 1, 4, 1, 5, 9, 2]
    fixed = [to_fixed(v, w, i) for i, (v, w) in enumerate(zip(values, weights, strict=True))]
    left = fixed[0] + fixed[1] + fixed[2] + (fixed[3] + fixed[4] + fixed[5] + fixed[6])
    right = fixed[6] + (fixed[5] + fixed[4]) + fixed[3] + fixed[2] + fixed[1] + fixed[0]
    assert np.array_equal(left, right)
    exact = sum(v.astype(np.float64) * w for v, w in zip(values, weights, strict=True))
    assert np.max(np.abs(left / 2.0**32 - exact)) <= 7 * 2.0**-33
    with pytest.raises(ValueError, match="client 4"):
        to_fixed(np.array([np.nan], dtype=np.float32), 1, 4)


def test_precision_at_k_and_mean_cosine():
    top = np.array([[1, 2, 3, 4, 5], [7, 8, 9, 10, 11]])
    labels = np.array([[1, 5, -1], [9, -1, -1]])
    result = precision_at_k(top, labels)
    assert result["p@1"] == 0.5
    assert result["p@3"] == pytest.approx((1 / 3 + 1 / 3) / 2)
    assert result["p@5"] == pytest.approx((2 / 5 + 1 / 5) / 2)
    rows = np.eye(3, dtype=np.float32)
    assert mean_pairwise_cosine(rows) == 0.0
    assert mean_pairwise_cosine(np.ones((4, 2), dtype=np.float32) / np.sqrt(2)) == pytest.approx(
        1.0
    )


@pytest.fixture(scope="module")
def tiny_setup():
    config = tiny_config()
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    split, ctx = plan.split, plan.ctx
    classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)
    return config, dataset, split, ctx, classes


def _round(server: Server, dataset, split, ctx, client_ids, personal=True):
    info = RoundInfo(0, np.asarray(client_ids, dtype=np.int64))
    server.start_round(info)
    updates = train_clients(
        ctx,
        server.algorithm,
        server.payload(),
        dataset.train_x,
        dataset.train_y,
        split.indices,
        split.offsets,
        0,
        info.client_ids,
        server.personal_payloads(info.client_ids),
    )
    server.add(updates)
    return server.finish_round(evaluate=False), updates


def test_client_payload_is_only_its_own_row(tiny_setup):
    config, dataset, split, ctx, classes = tiny_setup
    server = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
    ids = np.array([2, 7, 30])
    personal = server.personal_payloads(ids)
    W = server.state.arrays["class_embeddings"]
    assert len(personal) == 3
    for client, row in zip(ids, personal, strict=True):
        assert row.shape == (W.shape[1],)
        assert np.array_equal(row, W[classes[client]])
    server.start_round(RoundInfo(0, ids))
    theta_bytes = server.state.arrays["params"].nbytes
    assert server._stats.bytes_down == 3 * theta_bytes + 3 * W.shape[1] * 4


def test_server_writes_back_rows_and_never_averages_W(tiny_setup):
    config, dataset, split, ctx, classes = tiny_setup
    ctx = plan_run(tiny_config(algorithm__spreadout="none"), dataset).ctx
    server = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
    before = server.state.arrays["class_embeddings"].copy()
    ids = np.array([1, 4, 9, 20])
    # The clients' own rows, trained exactly as the task will (same generator, same payload).
    algorithm = server.algorithm  # the configured FedAwS (spreadout none, class_lr 0.1)
    assert isinstance(algorithm, FedAwS) and algorithm.spreadout == "none"
    expected = {}
    for client in ids:
        rows = split.indices[split.offsets[client] : split.offsets[client + 1]]
        update = algorithm.client_update(
            (server.payload(), before[classes[client]]),
            torch.from_numpy(dataset.train_x[rows]),
            torch.from_numpy(dataset.train_y[rows]),
            int(client),
            __import__("raysim.seeds", fromlist=["x"]).client_generator(3, 0, int(client)),
            ctx,
        )
        expected[classes[client]] = update.vector["row"]
    _round(server, dataset, split, ctx, ids)
    after = server.state.arrays["class_embeddings"]
    for cls, row in expected.items():
        np.testing.assert_allclose(after[cls], row, atol=2e-7)
    untouched = np.setdiff1d(np.arange(len(before)), list(expected))
    assert np.array_equal(after[untouched], before[untouched])


def test_task_packing_gives_identical_models(tiny_setup):
    """Reducing clients in one task or three gives the same model bit for bit."""
    config, dataset, split, ctx, classes = tiny_setup
    ids = np.arange(0, 40, 3)
    states = []
    for groups in ([ids], np.array_split(ids, 3)):
        server = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
        server.start_round(RoundInfo(0, ids))
        for group in groups:
            server.add(
                train_clients(
                    ctx,
                    server.algorithm,
                    server.payload(),
                    dataset.train_x,
                    dataset.train_y,
                    split.indices,
                    split.offsets,
                    0,
                    group,
                    server.personal_payloads(group),
                )
            )
        server.finish_round(evaluate=False)
        states.append(server.state)
    for key in states[0].arrays:
        assert np.array_equal(states[0].arrays[key], states[1].arrays[key]), key


def test_fedaws_spreads_classes_apart_and_baseline1_collapses(tmp_path):
    """Positive-only training pulls every class row together (Baseline-1); FedAwS's spreadout
    keeps them apart while the model learns (40 classes: chance P@1 is 0.025)."""
    overrides = {
        "run__rounds": 60,
        "clients__per_round": 20,
        "run__eval_every": 60,
        "algorithm__spreadout_lr": 0.05,
    }
    fedaws = run(tiny_config(**overrides), tmp_path / "a", progress=False, tensorboard=False)
    baseline = run(
        tiny_config(**overrides, algorithm__spreadout="none"),
        tmp_path / "b",
        progress=False,
        tensorboard=False,
    )
    assert baseline.summary["final"]["class_cosine_mean"] > 0.6
    assert fedaws.summary["final"]["class_cosine_mean"] < 0.1
    assert fedaws.summary["final"]["p@1"] >= 0.1


def test_fedaws_rejects_a_split_with_several_classes_per_client(tmp_path):
    from raysim.errors import ConfigError

    config = tiny_config(partition__name="iid")
    with pytest.raises(ConfigError, match="one_class"):
        run(config, tmp_path / "x", progress=False, tensorboard=False)


def test_broadcast_counts_only_sent_arrays():
    from raysim.core.payload import encoded_nbytes

    theta = np.zeros(10, dtype=np.float32)
    assert encoded_nbytes(Broadcast(theta)) == 40
    assert encoded_nbytes(Broadcast(theta, np.zeros((3, 2), dtype=np.float32))) == 64


def test_payload_objects_declare_their_byte_count_and_chunked_reads_by_subclassing():
    """The byte count and the chunked read are protocols (WireSized, ChunkedValues) the wire
    objects subclass, not method names the core looks for: an object that merely has such a
    method is not counted."""
    from raysim.algorithms.fedaws_wire import ClassRow, DenseDelta
    from raysim.core.fixed_point import ChunkedValues
    from raysim.core.payload import WireSized, encoded_nbytes

    assert issubclass(Broadcast, WireSized) and issubclass(ClassRow, WireSized)
    assert issubclass(DenseDelta, WireSized) and issubclass(DenseDelta, ChunkedValues)
    assert encoded_nbytes({"row": ClassRow(3, np.zeros(5, dtype=np.float32))}) == 20

    class LooksSized:
        def wire_nbytes(self) -> int:
            return 1

    with pytest.raises(TypeError, match="cannot count the bytes of a LooksSized payload"):
        encoded_nbytes(LooksSized())


def test_bad_client_updates_are_refused_in_the_task_and_the_round_equals_the_round_without_them(
    tiny_setup,
):
    config, dataset, split, ctx, classes = tiny_setup
    ids = np.array([3, 8, 15, 22])
    reference = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
    _round(reference, dataset, split, ctx, np.array([3, 15, 22]))

    server = Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes))
    original = server.algorithm.client_update

    def poisoned(payload, x, y, client_id, generator, ctx):
        update = original(payload, x, y, client_id, generator, ctx)
        if client_id == 8:
            update.vector["dense"][0] = np.nan
        return update

    server.algorithm.client_update = poisoned
    stats, _ = _round(server, dataset, split, ctx, ids)
    assert stats.clients_rejected == 1 and stats.clients_done == 3
    assert "client 8" in stats.rejected[0] and "NaN" in stats.rejected[0]
    for key in reference.state.arrays:
        assert np.array_equal(reference.state.arrays[key], server.state.arrays[key]), key


@pytest.mark.ray
@pytest.mark.parametrize("index", ["exact", "hnsw"])
def test_ray_backend_equals_local_bit_for_bit(ray_session, tmp_path, index):
    """Per-client payloads, in-task reduction and the index on the Ray backend give exactly
    the local backend's model (packing differs: Ray splits the round over tasks). With HNSW
    too: its graph is written by one thread (a parallel build links rows in whatever order
    the threads reach them, and two Ray runs of one config differed)."""
    overrides = {"run__rounds": 3, "clients__per_round": 16}
    if index == "hnsw":
        pytest.importorskip("hnswlib")
        overrides["index__backend"] = "hnsw"
    local = run(tiny_config(**overrides), tmp_path / "local", progress=False, tensorboard=False)
    remote = run(
        tiny_config(**overrides, runtime__backend="ray", clients__per_task=3),
        tmp_path / "ray",
        progress=False,
        tensorboard=False,
    )
    for key, value in local.state.arrays.items():
        assert np.array_equal(value, remote.state.arrays[key]), key
    assert local.summary["final"] == remote.summary["final"]
