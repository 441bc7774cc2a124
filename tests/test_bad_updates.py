"""Bad client updates are rejected before aggregation, counted and logged with the client id.

Unit tests of every built-in codec's checks (raysim.core.codecs) and of the engine's generic
checks (raysim.core.validation), then the server:
a client sending NaNs, a vector of the wrong shape or dtype, or FRL positions that are not a
permutation is skipped, and the round ends with exactly the state of the same round without
that client (np.array_equal), on the local backend, for FedAvg and FRL.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from raysim.core import validation
from raysim.core.codecs import Dense, Ranks, Signs, TopK, VectorLayout, not_a_permutation
from raysim.core.rankcodec import pack
from raysim.core.state import RoundInfo, ServerState, WireUpdate


def check_message(codec_and_layout, message):
    codec, layout = codec_and_layout
    return codec.check(message, layout)


def check_decoded(codec_and_layout, vector):
    codec, layout = codec_and_layout
    return validation.check_decoded(codec, layout, vector)


# --- the checks, one format at a time --------------------------------------------------------


def test_permutation_check_is_exact():
    n = 1000
    rng = np.random.default_rng(0)
    perm = rng.permutation(n).astype(np.int64)
    assert not_a_permutation(perm, n) is None
    repeated = perm.copy()
    repeated[5] = repeated[6]
    assert "repeats a position" in not_a_permutation(repeated, n)
    out_of_range = perm.copy()
    out_of_range[0] = n
    assert "out of range" in not_a_permutation(out_of_range, n)
    negative = perm.copy()
    negative[3] = -1
    assert "out of range" in not_a_permutation(negative, n)
    assert "has 999 entries" in not_a_permutation(perm[:-1], n)
    assert not_a_permutation(np.zeros(0, dtype=np.int64), 0) is None


DENSE_SPEC = (Dense(), VectorLayout(6, np.dtype(np.float32)))


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (np.zeros(6, dtype=np.float32), None),
        (np.array([0, 1, np.nan, 0, np.inf, 0], dtype=np.float32), "2 NaN/Inf entries"),
        (np.zeros(5, dtype=np.float32), "has 5 entries, expected 6"),
        (np.zeros((2, 3), dtype=np.float32), "shape (2, 3), expected 1-D"),
        (np.zeros(6, dtype=np.float64), "dtype float64, expected float32"),
        (np.zeros(6, dtype=np.int32), "dtype int32"),
        ([0.0] * 6, "is a list, expected a numpy array"),
        (None, "is a NoneType"),
    ],
)
def test_dense_updates(message, expected):
    problem = check_message(DENSE_SPEC, message) or (
        check_decoded(DENSE_SPEC, message) if isinstance(message, np.ndarray) else None
    )
    if expected is None:
        assert problem is None
    else:
        assert expected in problem


def test_sign_updates():
    spec = (Signs(), VectorLayout(20, np.dtype(np.float32)))
    assert check_message(spec, np.zeros(3, dtype=np.uint8)) is None
    assert "has 2 entries, expected 3" in check_message(spec, np.zeros(2, dtype=np.uint8))
    assert "dtype" in check_message(spec, np.zeros(3, dtype=np.uint16))
    assert "dtype float32" in check_message(spec, np.zeros(3, dtype=np.float32))


def test_sparse_updates():
    spec = (TopK(fraction=0.3), VectorLayout(10, np.dtype(np.float32)))

    def message(values=(1.0, -2.0, 0.5), indices=(0, 4, 9), dtype=np.float32):
        return {"values": np.array(values, dtype=dtype), "indices": np.array(indices, np.int32)}

    assert check_message(spec, message()) is None
    assert "strictly increasing" in check_message(spec, message(indices=(4, 4, 9)))
    assert "strictly increasing" in check_message(spec, message(indices=(9, 4, 0)))
    assert "out of range [0, 10)" in check_message(spec, message(indices=(0, 4, 10)))
    assert "out of range [0, 10)" in check_message(spec, message(indices=(-1, 4, 9)))
    assert "NaN/Inf" in check_message(spec, message(values=(1.0, np.nan, 0.5)))
    assert "expected float32" in check_message(spec, message(dtype=np.float64))
    assert "has 2 entries, expected 3" in check_message(spec, message((1.0, 2.0), (0, 1)))
    assert "keys ['indices']" in check_message(spec, {"indices": np.arange(3)})
    assert "got a ndarray" in check_message(spec, np.zeros(10, dtype=np.float32))


def test_rank_updates():
    sizes = (5, 300)
    spec = (Ranks(), VectorLayout(sum(sizes), np.dtype(np.int64), sizes))
    rng = np.random.default_rng(1)
    perms = [rng.permutation(n) for n in sizes]
    good = [pack(p, n) for p, n in zip(perms, sizes, strict=True)]
    assert check_message(spec, good) is None
    assert check_decoded(spec, np.concatenate(perms).astype(np.int64)) is None
    assert "has 1 layers, expected 2" in check_message(spec, good[:1])
    assert "layer 1 has 337 bytes, expected 338" in check_message(spec, [good[0], good[1][:-1]])
    assert "expected one packed array per layer" in check_message(spec, good[0])
    repeated = np.concatenate(perms).astype(np.int64)
    repeated[5 + 10] = repeated[5 + 11]
    assert "layer 1 positions are not a permutation: repeats" in check_decoded(spec, repeated)
    # 9 bits per entry hold up to 511: a position >= 300 is representable but out of range
    high = np.concatenate(perms).astype(np.int64)
    high[5 + 7] = 400
    assert "out of range [0, 300)" in check_decoded(spec, high)


def test_num_samples_must_be_a_count():
    for samples in (-1, 2.5, True, None):
        update = WireUpdate(client_id=3, num_samples=samples, message=np.zeros(6, np.float32))
        assert "num_samples" in validation.check_update(*DENSE_SPEC, update)
    fine = WireUpdate(client_id=3, num_samples=np.int64(4), message=np.zeros(6, np.float32))
    assert validation.check_update(*DENSE_SPEC, fine) is None


def test_declared_stats_must_be_finite_numbers():
    for stats, expected in (({"a": float("nan")}, "finite"), ({"a": "x"}, "a str"), ([], "list")):
        update = WireUpdate(3, 4, np.zeros(6, np.float32), stats=stats)
        assert expected in validation.check_update(*DENSE_SPEC, update)


# --- the server: rejected, logged, and the round equals the round without that client --------

SMALL = ("partition.num_clients=8", "clients.per_round=4", "run.rounds=1", "model.hidden=[16]")
FRL_SMALL = ("algorithm.name=frl", "clients.lr=0.4", "clients.local_epochs=1")


def _round_updates(digits_config, *overrides):
    """A local backend after one round's client training: (backend, info, updates)."""
    from raysim.assembly import plan_run
    from raysim.core.clients import train_clients
    from raysim.data.datasets import load_dataset
    from raysim.runtime.local import LocalBackend
    from raysim.seeds import sample_clients

    cfg = digits_config(*SMALL, *overrides)
    dataset = load_dataset(cfg)
    plan = plan_run(cfg, dataset)
    split = plan.split
    backend = LocalBackend(plan.ctx, dataset, split)
    ids = sample_clients(cfg.run.seed, 0, split.num_clients, cfg.clients.per_round)
    info = RoundInfo(0, ids)
    server = backend.server
    updates = train_clients(
        backend.ctx,
        backend.algorithm,
        server.payload(),
        dataset.train_x,
        dataset.train_y,
        split.indices,
        split.offsets,
        0,
        ids,
    )
    return backend, info, one_by_one(updates)


def one_by_one(updates):
    """A task's result as the clients' own updates (a dense task sends them stacked as one
    WireChunk: tests/test_wire_chunk.py)."""
    return [one for sent in updates for one in getattr(sent, "updates", lambda s=sent: [s])()]


def _one_round(server, info, updates, initial):
    server.set_state(initial)
    server.start_round(info)
    server.add(updates)
    return server.finish_round(evaluate=False), server.get_state()


def _nan(message):
    bad = message.copy()
    bad[len(bad) // 2] = np.nan
    return bad


def _non_permutation(message, backend):
    """FRL positions with one position repeated (and one missing), bit-packed as usual."""
    algorithm, ctx = backend.server.algorithm, backend.ctx
    sizes = algorithm.layer_sizes(ctx)
    layer = len(sizes) - 1
    positions = backend.server.codec.decode(message, backend.server.layout)
    start = sum(sizes[:layer])
    positions[start] = positions[start + 1]
    return [*message[:layer], pack(positions[start:], sizes[layer])]


def _out_of_range(message, backend):
    """A position >= n that the ceil(log2 n) bits can still carry (n not a power of two)."""
    algorithm, ctx = backend.server.algorithm, backend.ctx
    sizes = algorithm.layer_sizes(ctx)
    layer = next(i for i, n in enumerate(sizes) if n & (n - 1))
    start = sum(sizes[:layer])
    decoded = backend.server.codec.decode(message, backend.server.layout)
    positions = decoded[start : start + sizes[layer]].copy()
    positions[0] = sizes[layer]
    bits = int(sizes[layer] - 1).bit_length()
    packed = np.packbits(
        np.unpackbits(
            positions.astype("<u8").view(np.uint8).reshape(-1, 8), axis=1, bitorder="little"
        )[:, :bits].reshape(-1),
        bitorder="little",
    )
    return [*message[:layer], packed, *message[layer + 1 :]]


CORRUPTIONS = [
    ("fedavg", (), "NaN", lambda m, b: _nan(m), "NaN/Inf entries"),
    ("fedavg", (), "wrong shape", lambda m, b: m[:-3], "entries, expected"),
    ("fedavg", (), "2-D", lambda m, b: np.stack([m, m]), "expected 1-D"),
    ("fedavg", (), "wrong dtype", lambda m, b: m.astype(np.float64), "expected float32"),
    ("fedavg", (), "not an array", lambda m, b: m.tolist(), "expected a numpy array"),
    ("frl", FRL_SMALL, "not a permutation", _non_permutation, "not a permutation: repeats"),
    ("frl", FRL_SMALL, "position out of range", _out_of_range, "out of range"),
    ("frl", FRL_SMALL, "missing layer", lambda m, b: m[:-1], "layers, expected"),
    ("frl", FRL_SMALL, "truncated layer", lambda m, b: [m[0][:-1], *m[1:]], "bytes, expected"),
    ("signsgd", ("algorithm.name=signsgd",), "short", lambda m, b: m[:-1], "entries, expected"),
    (
        "topk",
        ("algorithm.name=topk",),
        "repeated index",
        lambda m, b: {
            "values": m["values"],
            "indices": np.sort(m["indices"])[[0, 0, *range(2, len(m["indices"]))]],
        },
        "strictly increasing",
    ),
]


@pytest.mark.parametrize(
    ("name", "overrides", "what", "corrupt", "reason"),
    CORRUPTIONS,
    ids=[f"{name}-{what}" for name, _, what, _, _ in CORRUPTIONS],
)
def test_rejected_update_leaves_the_round_of_the_others(
    digits_config, name, overrides, what, corrupt, reason
):
    backend, info, updates = _round_updates(digits_config, *overrides)
    server = backend.server
    initial = server.get_state().copy()
    bad_position = 1
    bad = updates[bad_position]
    corrupted = dataclasses.replace(bad, message=corrupt(bad.message, backend))
    with_bad = [*updates[:bad_position], corrupted, *updates[bad_position + 1 :]]
    without = [*updates[:bad_position], *updates[bad_position + 1 :]]

    stats, state = _one_round(server, info, with_bad, initial)
    reference_stats, reference = _one_round(server, info, without, initial)

    assert stats.clients_rejected == 1 and reference_stats.clients_rejected == 0
    assert stats.clients_done == reference_stats.clients_done == len(updates) - 1
    assert stats.bytes_up == reference_stats.bytes_up
    assert len(stats.rejected) == 1
    assert f"rejected the update of client {bad.client_id}: " in stats.rejected[0], stats.rejected
    assert reason in stats.rejected[0], stats.rejected
    assert state.round == reference.round == initial.round + 1
    assert state.arrays.keys() == reference.arrays.keys()
    for key in state.arrays:
        assert np.array_equal(state.arrays[key], reference.arrays[key]), key
    # and the round did move: the others' updates were aggregated
    assert any(not np.array_equal(state.arrays[k], initial.arrays[k]) for k in initial.arrays)


def test_a_round_where_every_update_is_rejected_keeps_the_model(digits_config):
    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    broken = [dataclasses.replace(u, message=_nan(u.message)) for u in updates]
    stats, state = _one_round(server, info, broken, initial)
    assert stats.clients_rejected == len(updates) and stats.clients_done == 0
    assert state.round == initial.round + 1
    assert np.array_equal(state.arrays["params"], initial.arrays["params"])


def _run_with_a_bad_client(digits_config, tmp_path, monkeypatch, algorithm_class, corrupt, drop):
    """One local run in which the middle client of round 0 misbehaves; with `drop`, that
    client's update is removed before the server sees it (the reference)."""
    from raysim.assembly import run
    from raysim.core.server import Server
    from raysim.seeds import sample_clients

    cfg = digits_config(*SMALL, *(FRL_SMALL if algorithm_class.__name__ == "FRL" else ()))
    bad_client = int(sample_clients(cfg.run.seed, 0, 8, 4)[2])
    original = algorithm_class.client_update

    def client_update(self, payload, x, y, client_id, generator, ctx):
        update = original(self, payload, x, y, client_id, generator, ctx)
        if client_id == bad_client:
            update = dataclasses.replace(update, vector=corrupt(update.vector))
        return update

    monkeypatch.setattr(algorithm_class, "client_update", client_update)
    if drop:
        add = Server.add
        monkeypatch.setattr(
            Server,
            "add",
            lambda self, ups: add(self, [u for u in one_by_one(ups) if u.client_id != bad_client]),
        )
    out = tmp_path / ("reference" if drop else "bad")
    return bad_client, run(cfg, out, progress=False, tensorboard=False), out


@pytest.mark.parametrize("algorithm", ["fedavg", "frl"])
def test_a_run_logs_the_rejection_and_matches_the_run_without_that_client(
    digits_config, tmp_path, monkeypatch, capsys, algorithm
):
    from raysim.algorithms.fedavg import FedAvg
    from raysim.algorithms.frl import FRL

    algorithm_class = FedAvg if algorithm == "fedavg" else FRL
    corrupt = _nan if algorithm == "fedavg" else (lambda message: message[:-1])
    bad_client, result, out = _run_with_a_bad_client(
        digits_config, tmp_path, monkeypatch, algorithm_class, corrupt, drop=False
    )
    stderr = capsys.readouterr().err
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # the line numbers the round as its record does (from 1)
    assert record["round"] == 1
    assert f"raysim: round 1: rejected the update of client {bad_client}: " in stderr
    assert record["clients_rejected"] == 1 and record["clients_done"] == 3
    assert f"client {bad_client}" in record["rejected"][0]
    assert result.summary["clients_rejected"] == 1

    monkeypatch.undo()
    _, reference, _ = _run_with_a_bad_client(
        digits_config, tmp_path, monkeypatch, algorithm_class, corrupt, drop=True
    )
    assert reference.summary["clients_rejected"] == 0
    for key, value in reference.state.arrays.items():
        assert np.array_equal(result.state.arrays[key], value), key


# --- who sends, and what it says beside its update -----------------------------------------------


def _extra_update_round(digits_config, extra):
    """The round with `extra(updates)` added to the honest updates, and the reference round."""
    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    stats, state = _one_round(server, info, [*updates, *extra(updates)], initial)
    reference_stats, reference = _one_round(server, info, updates, initial)
    assert stats.clients_done == reference_stats.clients_done == len(updates)
    assert np.array_equal(state.arrays["params"], reference.arrays["params"])
    return stats


def test_duplicate_updates_of_one_client_fold_once(digits_config):
    stats = _extra_update_round(digits_config, lambda updates: [updates[0]])
    assert stats.clients_rejected == 1
    assert "a second update from this client in this round" in stats.rejected[0]


def test_updates_for_unsampled_client_ids_are_rejected(digits_config):
    def stranger(updates):
        return [dataclasses.replace(updates[0], client_id=10_000)]

    stats = _extra_update_round(digits_config, stranger)
    assert stats.clients_rejected == 1
    assert "client 10000: this client was not sampled in this round" in stats.rejected[0]


def test_a_non_numeric_loss_metric_is_rejected_not_a_crash(digits_config):
    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    bad = dataclasses.replace(updates[1], metrics={"loss": "low"})
    stats, _ = _one_round(server, info, [updates[0], bad, *updates[2:]], initial)
    assert stats.clients_rejected == 1 and stats.clients_done == len(updates) - 1
    assert "metric 'loss' is a str, expected a number" in stats.rejected[0]


def test_a_round_where_all_clients_claim_0_samples_keeps_the_model(digits_config):
    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    weightless = [dataclasses.replace(u, num_samples=0) for u in updates]
    stats, state = _one_round(server, info, weightless, initial)
    assert stats.clients_done == len(updates) and stats.clients_rejected == 0
    assert state.round == initial.round + 1
    assert np.array_equal(state.arrays["params"], initial.arrays["params"])


def test_num_samples_beyond_the_clients_data_is_rejected(digits_config):
    # 1e30 samples would let one client set the model on its own
    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    liar = dataclasses.replace(updates[0], num_samples=10**30)
    stats, state = _one_round(server, info, [liar, *updates[1:]], initial)
    reference_stats, reference = _one_round(server, info, updates[1:], initial)
    assert stats.clients_rejected == 1
    assert (
        "num_samples is 1000000000000000000000000000000, but this client holds"
        in (stats.rejected[0])
    )
    assert np.array_equal(state.arrays["params"], reference.arrays["params"])


# --- a finite update that would wreck the model --------------------------------------------------

WRECK_ROUNDS = ("partition.num_clients=10", "clients.per_round=4", "run.rounds=8")


def _run_with_a_poisoning_client(digits_config, tmp_path, monkeypatch, overrides, value, drop):
    """Client 0 sends a delta with one coordinate set to `value` whenever it is sampled;
    with `drop` its updates never reach the server (the reference)."""
    from raysim.algorithms.fedavg import FedAvg
    from raysim.assembly import run
    from raysim.core.server import Server

    original = FedAvg.client_update

    def client_update(self, payload, x, y, client_id, generator, ctx):
        update = original(self, payload, x, y, client_id, generator, ctx)
        if client_id == 0:
            vector = update.vector.copy()
            vector[0] = value
            update = dataclasses.replace(update, vector=vector)
        return update

    monkeypatch.setattr(FedAvg, "client_update", client_update)
    if drop:
        add = Server.add
        monkeypatch.setattr(
            Server,
            "add",
            lambda self, ups: add(self, [u for u in one_by_one(ups) if u.client_id != 0]),
        )
    result = run(
        digits_config(*WRECK_ROUNDS, *overrides),
        tmp_path / ("reference" if drop else "poisoned"),
        progress=False,
        tensorboard=False,
    )
    monkeypatch.undo()
    return result


@pytest.mark.parametrize(
    ("overrides", "value"),
    [((), 3e38), (("server.optimizer=adam", "server.lr=0.01"), 1e20)],
    ids=["fedavg-3e38", "fedadam-1e20"],
)
def test_one_finite_but_huge_update_does_not_destroy_the_model(
    digits_config, tmp_path, monkeypatch, capsys, overrides, value
):
    poisoned = _run_with_a_poisoning_client(
        digits_config, tmp_path, monkeypatch, overrides, value, drop=False
    )
    reference = _run_with_a_poisoning_client(
        digits_config, tmp_path, monkeypatch, overrides, value, drop=True
    )
    assert poisoned.summary["clients_rejected"] >= 1
    assert "is more than server.max_update_ratio=1000 times" in capsys.readouterr().err
    # the run kept training: the same model as without the poisoning client
    assert np.isfinite(poisoned.state.arrays["params"]).all()
    accuracy = poisoned.summary["final"]["accuracy"]
    assert abs(accuracy - reference.summary["final"]["accuracy"]) <= 0.01
    assert accuracy > 0.5  # 10 classes: chance is 0.1


def test_a_server_update_that_turns_the_state_non_finite_is_refused(digits_config):
    from raysim.algorithms.fedavg import FedAvg

    backend, info, updates = _round_updates(digits_config, "server.max_update_ratio=0")
    server = backend.server
    initial = server.get_state().copy()
    original = FedAvg.server_update

    def broken_update(self, state, aggregate, ctx):  # e.g. an optimizer slot overflowing
        result, diagnostics = original(self, state, aggregate, ctx)
        params = result.arrays["params"].copy()
        params[3] = np.inf
        return ServerState(result.round, {**result.arrays, "params": params}), diagnostics

    FedAvg.server_update = broken_update
    try:
        stats, state = _one_round(server, info, updates, initial)
    finally:
        FedAvg.server_update = original
    assert state.round == initial.round + 1
    assert np.array_equal(state.arrays["params"], initial.arrays["params"])
    assert "the server update made params non-finite" in stats.rejected[-1]


def test_a_server_update_returning_a_bare_state_is_refused_at_the_first_round(
    digits_config_path, tmp_path
):
    """server_update returns (state, diagnostics), always: a plug-in returning the state alone
    is refused in one line naming it, at the first round it would have ended."""
    import raysim
    from raysim import registry
    from raysim.algorithms.fedavg import FedAvg
    from raysim.errors import ConfigError

    class BareState(FedAvg):
        def server_update(self, state, aggregate, ctx):
            return super().server_update(state, aggregate, ctx)[0]

    registry.algorithms.register("bare_state_test", BareState)
    try:
        with pytest.raises(ConfigError) as caught:
            raysim.run(
                digits_config_path,
                out=tmp_path / "out",
                overrides=[
                    *SMALL,
                    "run.rounds=2",
                    "runtime.backend=local",
                    "algorithm.name=bare_state_test",
                ],
                progress=False,
                tensorboard=False,
            )
    finally:
        registry.algorithms.unregister("bare_state_test")
    assert str(caught.value) == (
        "algorithm 'bare_state_test': server_update must return (state, diagnostics), "
        "got ServerState"
    )
    metrics = tmp_path / "out" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no round ended


@pytest.mark.parametrize(
    "returned, got",
    [
        (lambda state: (state,), "(ServerState)"),
        (lambda state: (state, None), "(ServerState, NoneType)"),
        (lambda state: ({}, state), "(dict, ServerState)"),
        (lambda state: None, "NoneType"),
    ],
)
def test_any_other_shape_from_server_update_is_refused_in_one_line(
    digits_config, monkeypatch, returned, got
):
    from raysim.algorithms.fedavg import FedAvg
    from raysim.errors import ConfigError

    backend, info, updates = _round_updates(digits_config)
    server = backend.server
    initial = server.get_state().copy()
    original = FedAvg.server_update

    def misshapen(self, state, aggregate, ctx):
        return returned(original(self, state, aggregate, ctx)[0])

    monkeypatch.setattr(FedAvg, "server_update", misshapen)
    with pytest.raises(ConfigError) as caught:
        _one_round(server, info, updates, initial)
    assert str(caught.value) == (
        f"algorithm 'fedavg': server_update must return (state, diagnostics), got {got}"
    )
