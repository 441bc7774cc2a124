"""A dense task's updates travel as one WireChunk (raysim.core.wire_chunk), and the server's
whole-array checks and fold give what the clients' updates one by one give, bit for bit: the
same state, loss, norms and bytes when all pass, the same rejection lines when a row fails."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

from raysim.core.codecs import Dense, Signs, VectorLayout
from raysim.core.server import Server
from raysim.core.state import (
    ClientUpdate,
    ReducedUpdate,
    RoundInfo,
    WireChunk,
    WireUpdate,
    clients_in,
)
from raysim.core.wire_chunk import TaskMessages
from raysim.runtime import collector

SMALL = (
    "partition.num_clients=8",
    "clients.per_round=6",
    "run.rounds=1",
    "model.hidden=[16]",
    "clients.batched=true",
)


def _round(digits_config, *overrides):
    """A local backend after one round's client training: (backend, info, task result)."""
    return round_of(digits_config(*SMALL, *overrides))  # clients.batched: one chunk of six


def round_of(cfg):
    """A local backend of `cfg` after its first round's client training, as a task trains
    them: (backend, info, the task's result)."""
    from raysim.assembly import plan_run
    from raysim.core.clients import train_clients
    from raysim.data.datasets import load_dataset
    from raysim.runtime.local import LocalBackend
    from raysim.seeds import sample_clients

    dataset = load_dataset(cfg)
    plan = plan_run(cfg, dataset)
    backend = LocalBackend(plan.ctx, dataset, plan.split)
    ids = sample_clients(cfg.run.seed, 0, plan.split.num_clients, cfg.clients.per_round)
    sent = train_clients(
        backend.ctx,
        backend.algorithm,
        backend.server.payload(),
        dataset.train_x,
        dataset.train_y,
        plan.split.indices,
        plan.split.offsets,
        0,
        ids,
    )
    return backend, RoundInfo(0, ids), sent


def fold(server, info, updates, initial, monkeypatch):
    """One round's end from `updates`; also how many updates went the one-by-one way."""
    one_by_one = []
    add_one = Server._add_one
    monkeypatch.setattr(
        Server, "_add_one", lambda self, update: (one_by_one.append(1), add_one(self, update))
    )
    server.set_state(initial)
    server.start_round(info)
    server.add(updates)
    stats = server.finish_round(evaluate=False)
    monkeypatch.setattr(Server, "_add_one", add_one)
    return stats, server.get_state(), len(one_by_one)


def _same_round(a, b):
    (stats_a, state_a), (stats_b, state_b) = a, b
    for key in ("clients_done", "clients_rejected", "rejected", "bytes_up", "model_updated"):
        assert getattr(stats_a, key) == getattr(stats_b, key), key
    for key in ("train_loss", "update_norm_mean"):  # the same bits (NaN only if both)
        assert np.array_equal(getattr(stats_a, key), getattr(stats_b, key), equal_nan=True), key
    assert state_a.arrays.keys() == state_b.arrays.keys()
    for key in state_a.arrays:
        assert np.array_equal(state_a.arrays[key], state_b.arrays[key]), key


def test_a_batched_dense_task_sends_one_chunk_folded_as_its_updates_one_by_one(
    digits_config, monkeypatch
):
    backend, info, sent = _round(digits_config)
    (chunk,) = sent
    assert isinstance(chunk, WireChunk) and chunk.num_clients == len(info.client_ids)
    assert chunk.client_ids.tolist() == info.client_ids.tolist()
    server, initial = backend.server, backend.server.get_state().copy()
    stats, state, slow = fold(server, info, sent, initial, monkeypatch)
    assert slow == 0  # every row checked and folded at once
    stats_one, state_one, slow_one = fold(server, info, chunk.updates(), initial, monkeypatch)
    assert slow_one == len(info.client_ids)
    _same_round((stats, state), (stats_one, state_one))
    assert stats.clients_done == len(info.client_ids) and stats.model_updated
    assert not np.array_equal(state.arrays["params"], initial.arrays["params"])


def _row(chunk: WireChunk, position: int, **changes) -> WireChunk:
    """`chunk` with row `position` changed (fields of the chunk, one entry each)."""
    fields = {
        "client_ids": chunk.client_ids.copy(),
        "num_samples": chunk.num_samples.copy(),
        "messages": chunk.messages.copy(),
        "metrics": list(chunk.metrics),
        "stats": list(chunk.stats),
    }
    for name, value in changes.items():
        fields[name][position] = value(fields[name][position]) if callable(value) else value
    fields["metrics"], fields["stats"] = tuple(fields["metrics"]), tuple(fields["stats"])
    return WireChunk(**fields)


def _nan_row(row):
    row = row.copy()
    row[3] = np.nan
    return row


def _inf_row(row):
    row = row.copy()
    row[-1] = -np.inf
    return row


BAD_ROWS = [
    ("NaN", {"messages": _nan_row}, "NaN/Inf entries"),
    ("Inf", {"messages": _inf_row}, "NaN/Inf entries"),
    ("norm overflows", {"messages": lambda row: row * 0 + 1e30}, "server.max_update_ratio"),
    ("huge", {"messages": lambda row: row + 1e6}, "server.max_update_ratio"),
    ("not sampled", {"client_ids": 7_000}, "was not sampled"),
    ("twice", {"client_ids": "previous"}, "a second update from this client"),
    ("more samples than held", {"num_samples": 100_000}, "holds"),
    ("negative samples", {"num_samples": -1}, "expected an integer >= 0"),
    ("metric not a number", {"metrics": {"loss": "low"}}, "is a str, expected a number"),
    ("stat not finite", {"stats": {"labels": float("inf")}}, "expected a finite number"),
]


@pytest.mark.parametrize(
    ("what", "change", "reason"), BAD_ROWS, ids=[what for what, _, _ in BAD_ROWS]
)
def test_a_bad_row_is_refused_with_its_own_line_and_the_others_fold(
    digits_config, monkeypatch, what, change, reason
):
    backend, info, (chunk,) = _round(digits_config)
    if change.get("client_ids") == "previous":
        change = {"client_ids": int(chunk.client_ids[1])}
    bad = _row(chunk, 2, **change)
    server, initial = backend.server, backend.server.get_state().copy()
    stats, state, slow = fold(server, info, [bad], initial, monkeypatch)
    assert slow == bad.num_clients  # the whole chunk went one by one
    one_by_one = fold(server, info, bad.updates(), initial, monkeypatch)[:2]
    _same_round((stats, state), one_by_one)
    assert stats.clients_rejected == 1 and len(stats.rejected) == 1
    assert reason in stats.rejected[0], stats.rejected
    assert stats.clients_done == bad.num_clients - 1


def test_a_finite_row_whose_norm_overflows_is_judged_alone_without_a_bound(
    digits_config, monkeypatch
):
    """Without server.max_update_ratio a finite row is taken whatever its norm (inf here):
    the chunk goes one by one, and the round is what the clients' updates give alone."""
    backend, info, (chunk,) = _round(digits_config, "server.max_update_ratio=0")
    bad = _row(chunk, 1, messages=lambda row: row * 0 + 1e30)
    server, initial = backend.server, backend.server.get_state().copy()
    stats, state, slow = fold(server, info, [bad], initial, monkeypatch)
    assert slow == bad.num_clients and stats.clients_rejected == 0
    _same_round((stats, state), fold(server, info, bad.updates(), initial, monkeypatch)[:2])


def test_a_malformed_chunk_is_a_backend_bug_in_one_line(digits_config):
    backend, info, (chunk,) = _round(digits_config)
    server = backend.server
    server.start_round(info)
    short = dataclasses.replace(chunk, num_samples=chunk.num_samples[:-1])
    with pytest.raises(TypeError, match="malformed WireChunk: WireChunk.num_samples is not"):
        server.add([short])
    flat = dataclasses.replace(chunk, messages=chunk.messages.reshape(-1))
    with pytest.raises(TypeError, match="WireChunk.messages is not a 2-D array"):
        server.add([flat])


def _update(client_id, vector, num_samples=4):
    return ClientUpdate(client_id, num_samples, vector, {"loss": 0.5}, {})


def test_task_messages_stack_consecutive_rows_of_one_array_and_send_the_rest_alone():
    dense, layout = Dense(), VectorLayout(3, np.dtype(np.float32))
    deltas = np.arange(15, dtype=np.float32).reshape(5, 3)
    other = deltas.copy()

    def sent(updates, codec=dense):
        messages = TaskMessages(codec, layout)
        for update in updates:
            messages.add(update)
        return messages.result()

    (chunk,) = sent([_update(c, deltas[c]) for c in range(5)])
    assert chunk.client_ids.tolist() == [0, 1, 2, 3, 4] and chunk.num_samples.tolist() == [4] * 5
    assert np.shares_memory(chunk.messages, deltas) and np.array_equal(chunk.messages, deltas)

    # runs end where the rows stop following each other: another array, a skipped row
    parts = sent(
        [_update(0, deltas[0]), _update(1, deltas[1]), _update(2, other[2]), _update(3, other[3])]
        + [_update(4, other[0]), _update(5, deltas[4]), _update(6, deltas[2])]
    )
    assert [type(p).__name__ for p in parts] == ["WireChunk", "WireChunk"] + ["WireUpdate"] * 3
    assert np.shares_memory(parts[0].messages, deltas)
    assert np.shares_memory(parts[1].messages, other)
    assert parts[1].client_ids.tolist() == [2, 3] and np.array_equal(parts[1].messages, other[2:4])
    assert [p.client_id for p in parts[2:]] == [4, 5, 6]
    assert np.array_equal(parts[4].message, deltas[2])

    # what must reach the server as it is (a bool count), columns, vectors of their own,
    # another codec: alone, each its own vector
    square = np.arange(9, dtype=np.float32).reshape(3, 3)
    for codec, updates in [
        (dense, [_update(0, deltas[0]), _update(1, deltas[1], num_samples=True)]),
        (dense, [_update(0, square[:, 0]), _update(1, square[:, 1])]),
        (dense, [_update(0, deltas[0].copy()), _update(1, deltas[1].copy())]),
        (Signs(), [_update(0, deltas[0]), _update(1, deltas[1])]),
    ]:
        alone = sent(updates, codec)
        assert [type(u) for u in alone] == [WireUpdate] * 2
        if codec is dense:
            assert all(u.message is v.vector for u, v in zip(alone, updates, strict=True))


def test_clients_in_counts_the_clients_of_a_tasks_result():
    chunk = WireChunk(
        np.arange(3, dtype=np.int64),
        np.ones(3, dtype=np.int64),
        np.zeros((3, 2), np.float32),
        ({},) * 3,
        ({},) * 3,
    )
    reduced = ReducedUpdate([5, 6], [1, 1], None, [{}, {}], 0, rejected=[(7, "NaN")])
    one = WireUpdate(9, 1, np.zeros(2, np.float32))
    assert clients_in([chunk, reduced, one]) == 3 + 3 + 1


def test_the_collector_freezes_only_once_full_collections_happen_in_a_run():
    assert gc.get_freeze_count() == 0
    try:
        collector.after_round("run a")  # the run's first round here: nothing frozen
        collector.after_round("run a")
        assert not collector.frozen()  # no full collection yet during the run
        gc.collect()  # a full collection, as a large round brings
        collector.after_round("run a")
        assert collector.frozen() and gc.get_freeze_count() > 0
        collector.after_round("run b")  # the next run in this process: all unfrozen
        assert not collector.frozen() and gc.get_freeze_count() == 0
        gc.collect()
        collector.after_round("run b")
        assert collector.frozen()
    finally:
        collector.release()
    assert not collector.frozen() and gc.get_freeze_count() == 0


def test_a_run_freezes_once_full_passes_happen_and_leaves_nothing_frozen(
    digits_config, tmp_path, monkeypatch
):
    """The local backend freezes the collector's long-lived objects after a round in which a
    full pass happened (forced here after every round), once, and its end unfreezes them:
    nothing stays frozen in the caller's process, and the results are the same."""
    from raysim.assembly import run

    freezes = []
    monkeypatch.setattr(gc, "freeze", lambda real=gc.freeze: (freezes.append(1), real())[1])
    cfg = digits_config(*SMALL[:2], "run.rounds=4", "model.hidden=[16]")
    plain = run(cfg, tmp_path / "plain", progress=False, tensorboard=False)
    assert gc.get_freeze_count() == 0 and not collector.frozen()
    freezes.clear()  # (a full pass of its own may have come during the plain run's rounds)

    finish_round = Server.finish_round

    def with_a_full_pass(self, evaluate):
        stats = finish_round(self, evaluate)
        gc.collect()
        return stats

    monkeypatch.setattr(Server, "finish_round", with_a_full_pass)
    frozen = run(cfg, tmp_path / "frozen", progress=False, tensorboard=False)
    assert freezes == [1]  # once, after the first round that saw a full pass
    assert gc.get_freeze_count() == 0 and not collector.frozen()
    for key in plain.state.arrays:
        assert np.array_equal(plain.state.arrays[key], frozen.state.arrays[key]), key
