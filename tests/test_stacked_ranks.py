"""FRL's rank positions travel stacked (raysim.core.wire_chunk): a batched chunk's positions,
rows of one array, are bit-packed at once (`pack_rows`, `Ranks.encode_rows`), checked and
decoded by the server at once, and give what the clients' updates one by one give, bit for
bit: the same bytes on the wire, the same vote, the same refusal lines for a bad row."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_wire_chunk import fold, round_of

from raysim.core import wire_chunk
from raysim.core.aggregators import LinearAccumulator
from raysim.core.codecs import Ranks, VectorLayout, not_a_permutation, rows_are_permutations
from raysim.core.fixed_point import SumOverflowError
from raysim.core.rankcodec import bits_for, pack, pack_rows, packed_nbytes, unpack, unpack_rows
from raysim.core.server import Server
from raysim.core.state import ClientUpdate, WireChunk, WireUpdate
from raysim.core.wire_chunk import TaskMessages

# --- the packing -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9, 63, 64, 65, 640, 1000, 4096, 4097, 70_001])
def test_pack_rows_writes_each_rows_own_bytes_and_unpack_rows_reads_them_back(n):
    rng = np.random.default_rng(n)
    for count in (0, 1, 5):
        for width in sorted({n, n // 2 + 1}):
            rows = rng.integers(0, n, size=(count, width))
            packed = pack_rows(rows, n)
            assert packed.dtype == np.uint8 and packed.shape == (count, packed_nbytes(n, width))
            for row, row_bytes in zip(rows, packed, strict=True):
                assert np.array_equal(row_bytes, pack(row, n))
                assert np.array_equal(unpack(row_bytes, n, width), row)
            unpacked = unpack_rows(packed, n, width)
            assert unpacked.dtype == np.int64 and np.array_equal(unpacked, rows)


def test_pack_rows_refuses_values_out_of_range_and_unpack_rows_a_wrong_width():
    with pytest.raises(ValueError, match=r"values must lie in \[0, 10\), got \[0, 10\]"):
        pack_rows(np.array([[0, 1, 2], [3, 10, 4]]), 10)
    with pytest.raises(ValueError, match=r"got \[-1, 2\]"):
        pack_rows(np.array([[0, -1, 2]]), 10)
    with pytest.raises(ValueError, match="2-D"):
        pack_rows(np.arange(3), 10)
    with pytest.raises(ValueError, match="have 3 bytes; 10 entries of 4 bits need 5"):
        unpack_rows(np.zeros((2, 3), dtype=np.uint8), 10, 10)


# --- the codec's rows interface ----------------------------------------------------------------

SIZES = (12, 40, 7)  # three layers
LAYOUT = VectorLayout(sum(SIZES), np.dtype(np.int64), SIZES)


def _positions(count: int, seed: int = 0) -> np.ndarray:
    """`count` clients' valid positions: every layer a permutation."""
    rng = np.random.default_rng(seed)
    return np.stack(
        [np.concatenate([rng.permutation(n) for n in SIZES]) for _ in range(count)]
    ).astype(np.int64)


def _spoiled(rows: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Rows each made not a permutation in one layer, in the ways a client could."""
    cases = []
    for what, change in [
        ("a repeat", lambda r: r.__setitem__(13, r[14])),
        ("too large", lambda r: r.__setitem__(12, 40)),
        ("negative", lambda r: r.__setitem__(55, -1)),
        ("a repeat in the last layer", lambda r: r.__setitem__(52, r[53])),
    ]:
        bad = rows.copy()
        change(bad[1])
        cases.append((what, bad))
    return cases


def test_ranks_rows_interface_is_the_codec_client_by_client():
    codec, rows = Ranks(), _positions(6)
    stacked = codec.encode_rows(rows, LAYOUT)
    assert isinstance(stacked, tuple) and len(stacked) == len(SIZES)
    for position, row in enumerate(rows):
        alone = codec.encode(row, LAYOUT)
        assert all(np.array_equal(a, s[position]) for a, s in zip(alone, stacked, strict=True))
    decoded = codec.decode_rows(stacked, LAYOUT)
    assert decoded.dtype == np.int64 and np.array_equal(decoded, rows)
    assert codec.rows_pass_decoded(decoded, LAYOUT)
    for what, bad in _spoiled(rows):
        assert codec.check_decoded(bad[1], LAYOUT) is not None, what
        assert not codec.rows_pass_decoded(bad, LAYOUT), what


def test_rows_are_permutations_agrees_with_not_a_permutation():
    rng = np.random.default_rng(3)
    for n in (1, 2, 9):
        rows = np.stack([rng.permutation(n) for _ in range(4)])
        assert rows_are_permutations(rows, n)
        for value in (-1, n, 0):
            bad = rows.copy()
            bad[2, 0] = value if value != 0 else bad[2, -1]
            expected = all(not_a_permutation(row, n) is None for row in bad)
            assert rows_are_permutations(bad, n) == expected
    assert rows_are_permutations(np.zeros((0, 4), dtype=np.int64), 4)
    assert not rows_are_permutations(np.zeros((2, 3), dtype=np.int64), 4)  # a wrong width


def _update(client_id, vector, num_samples=4):
    return ClientUpdate(client_id, num_samples, vector, {"loss": 0.5}, {})


def test_task_messages_stack_a_chunks_positions_under_ranks_and_send_the_rest_alone():
    codec, rows = Ranks(), _positions(5)
    messages = TaskMessages(codec, LAYOUT)
    for client in range(5):
        messages.add(_update(client, rows[client]))
    (chunk,) = messages.result()
    assert isinstance(chunk, WireChunk) and chunk.client_ids.tolist() == [0, 1, 2, 3, 4]
    for update, row in zip(chunk.updates(), rows, strict=True):
        assert isinstance(update.message, list)
        expected = codec.encode(row, LAYOUT)
        assert all(np.array_equal(a, b) for a, b in zip(update.message, expected, strict=True))
    # float vectors are not positions, copies are not rows of one array: each alone
    for vectors in (rows.astype(np.float32), [row.copy() for row in rows]):
        messages = TaskMessages(codec, LAYOUT)
        for client in range(2):
            messages.add(_update(client, vectors[client]))
        assert [type(u) for u in messages.result()] == [WireUpdate] * 2


# --- the server: a real FRL round, batched -----------------------------------------------------


@pytest.fixture(scope="module")
def frl_round():
    """One forced-batched FRL round of six digits clients on the CPU, trained by the task
    code: (backend, info, what the task sent)."""
    from conftest import REPO_ROOT

    from raysim import config
    from raysim.algorithms.frl import FRL

    cfg = config.load(
        REPO_ROOT / "configs" / "frl_digits.yaml",
        [
            "runtime.backend=local",
            "model.hidden=[16]",
            "partition.num_clients=8",
            "clients.per_round=6",
            "clients.batched=true",
        ],
    )
    with pytest.MonkeyPatch.context() as patch:  # a CPU trains FRL one at a time otherwise
        patch.setattr(FRL, "batching_problem", lambda self, ctx: None)
        return round_of(cfg)


def _same_round(a, b):
    (stats_a, state_a), (stats_b, state_b) = a, b
    for key in ("clients_done", "clients_rejected", "rejected", "bytes_up", "model_updated"):
        assert getattr(stats_a, key) == getattr(stats_b, key), key
    assert np.array_equal(stats_a.train_loss, stats_b.train_loss, equal_nan=True)
    assert state_a.arrays.keys() == state_b.arrays.keys()
    for key in state_a.arrays:
        assert np.array_equal(state_a.arrays[key], state_b.arrays[key]), key


def test_a_batched_frl_task_sends_its_positions_stacked_and_they_vote_as_one_by_one(
    frl_round, monkeypatch
):
    backend, info, sent = frl_round
    (chunk,) = sent
    assert isinstance(chunk, WireChunk) and isinstance(chunk.messages, tuple)
    assert chunk.client_ids.tolist() == info.client_ids.tolist()
    sizes = backend.server.layout.segments
    assert [m.shape for m in chunk.messages] == [(6, packed_nbytes(n)) for n in sizes]
    server, initial = backend.server, backend.server.get_state().copy()
    stats, state, slow = fold(server, info, sent, initial, monkeypatch)
    assert slow == 0  # checked, decoded and folded at once
    one_by_one = fold(server, info, chunk.updates(), initial, monkeypatch)
    assert one_by_one[2] == 6
    _same_round((stats, state), one_by_one[:2])
    assert stats.clients_done == 6 and stats.model_updated
    assert stats.bytes_up == 6 * sum(packed_nbytes(n) for n in sizes)  # the bit-packed formula
    assert any(
        not np.array_equal(state.arrays[k], initial.arrays[k]) for k in initial.arrays
    )  # the vote moved the ranking


def _with_row(chunk: WireChunk, position: int, row: np.ndarray, layout) -> WireChunk:
    """`chunk` whose client at `position` sends `row`'s positions, each layer bit-packed in
    its bits (any value they hold, as a hostile client could)."""
    layers = [layer.copy() for layer in chunk.messages]
    for layer, piece, n in zip(layers, layout.pieces(row), layout.segments, strict=True):
        layer[position] = pack(piece, 2 ** bits_for(n))
    return dataclasses.replace(chunk, messages=tuple(layers))


def test_a_row_that_is_not_a_permutation_is_refused_with_its_own_line(frl_round, monkeypatch):
    backend, info, (chunk,) = frl_round
    server, initial = backend.server, backend.server.get_state().copy()
    layout = server.layout
    good = chunk.updates()
    decoded = Ranks().decode(good[2].message, layout)
    repeat = decoded.copy()
    repeat[1] = repeat[0]
    first, edges = layout.segments[0], layout.segments[1]  # layer 1: 160 edges, 8 bits each
    too_large = decoded.copy()
    too_large[first] = 2 ** (int(edges - 1).bit_length()) - 1  # fits its bits, >= its edges
    assert too_large[first] >= edges
    for what, row, line in [
        ("a repeat", repeat, "layer 0 positions are not a permutation: repeats a position"),
        ("out of range", too_large, "layer 1 positions are not a permutation: has a value out"),
    ]:
        bad = _with_row(chunk, 2, row, layout)
        stats, state, slow = fold(server, info, [bad], initial, monkeypatch)
        assert slow == 6, what  # the chunk went one by one
        _same_round((stats, state), fold(server, info, bad.updates(), initial, monkeypatch)[:2])
        assert stats.clients_rejected == 1 and stats.clients_done == 5, what
        assert line in stats.rejected[0], (what, stats.rejected)
    # a layer of the wrong width is a message the codec refuses: one by one, its own line
    short = dataclasses.replace(chunk, messages=(chunk.messages[0][:, :-1], *chunk.messages[1:]))
    stats, _, slow = fold(server, info, [short], initial, monkeypatch)
    assert slow == 6 and stats.clients_rejected == 6
    assert "layer 0 has" in stats.rejected[0] and "bit-packed positions" in stats.rejected[0]


def test_a_stacked_ranks_chunk_with_a_bad_shape_is_a_backend_bug(frl_round):
    backend, info, (chunk,) = frl_round
    backend.server.start_round(info)
    ragged = dataclasses.replace(chunk, messages=(chunk.messages[0][:-1], *chunk.messages[1:]))
    with pytest.raises(TypeError, match="not a 2-D array of 6 rows, nor a tuple of them"):
        backend.server.add([ragged])


# --- the vote's integer sum, rows at once ------------------------------------------------------


def test_integer_rows_add_up_as_row_by_row():
    rows = _positions(7, seed=5)
    for weights in ([1] * 7, [1, 3, 0, 2, 1, 5, 1]):
        at_once, one_by_one = LinearAccumulator(normalize=False), LinearAccumulator(False)
        at_once.add(rows[0], 2)  # a total already there
        one_by_one.add(rows[0], 2)
        at_once.add_rows(rows, weights)
        for row, weight in zip(rows, weights, strict=True):
            one_by_one.add(row, weight)
        assert at_once.total.dtype == np.int64
        assert np.array_equal(at_once.total, one_by_one.total)
        assert (at_once.weight_sum, at_once.count) == (one_by_one.weight_sum, one_by_one.count)
        assert np.array_equal(at_once.result(), one_by_one.result())


def test_integer_rows_near_int64s_limit_are_checked_row_by_row():
    # bounds past int64, a total inside it: the exact checks take it, as row by row
    signs = np.array([[1], [-1], [1]], dtype=np.int64) * np.full((3, 4), 2**62, dtype=np.int64)
    at_once, one_by_one = LinearAccumulator(False), LinearAccumulator(False)
    at_once.add_rows(signs, [1, 1, 1])
    for row in signs:
        one_by_one.add(row, 1)
    assert np.array_equal(at_once.total, one_by_one.total) and at_once.total[0] == 2**62
    # a total past int64, or a term (int64's lowest value, whose numpy abs wraps around): the
    # same error, the total as it was before the failing row
    lowest = np.array([[1, 2], [-(2**63), 0], [3, 4]], dtype=np.int64)
    for rows in (np.full((3, 4), 2**62, dtype=np.int64), lowest):
        at_once, one_by_one = LinearAccumulator(False), LinearAccumulator(False)
        with pytest.raises(SumOverflowError) as raised:
            at_once.add_rows(rows, [1, 1, 1])
        with pytest.raises(SumOverflowError) as expected:
            for row in rows:
                one_by_one.add(row, 1)
        assert str(raised.value) == str(expected.value)
        assert np.array_equal(at_once.total, one_by_one.total)
        assert at_once.count == one_by_one.count


# --- whole runs ---------------------------------------------------------------------------------


def test_a_batched_frl_run_is_the_same_stacked_or_client_by_client(tmp_path, monkeypatch):
    """Forced batched on the CPU, two rounds: the positions stacked give the run the clients'
    updates one by one give (stacking switched off), bit for bit."""
    from conftest import REPO_ROOT

    from raysim import run
    from raysim.algorithms.frl import FRL

    monkeypatch.setattr(FRL, "batching_problem", lambda self, ctx: None)
    overrides = [
        "runtime.backend=local",
        "model.hidden=[16]",
        "partition.num_clients=12",
        "clients.per_round=8",
        "clients.batched=true",
        "run.rounds=2",
        "run.eval_every=2",
    ]
    config = REPO_ROOT / "configs" / "frl_digits.yaml"
    stacked_chunks: list[int] = []  # the chunks whose positions the server took at once
    take_chunk = Server._add_chunk_at_once

    def counted(self, chunk) -> bool:
        taken = take_chunk(self, chunk)
        if taken:
            stacked_chunks.append(chunk.num_clients)
        return taken

    monkeypatch.setattr(Server, "_add_chunk_at_once", counted)
    stacked = run(
        config, tmp_path / "stacked", overrides=overrides, progress=False, tensorboard=False
    )
    assert stacked_chunks == [8, 8]  # each round's eight clients went stacked
    monkeypatch.setattr(wire_chunk, "STACKING_CODECS", (wire_chunk.Dense,))
    alone = run(config, tmp_path / "alone", overrides=overrides, progress=False, tensorboard=False)
    assert stacked_chunks == [8, 8]  # client by client: no chunk
    assert stacked.state.arrays.keys() == alone.state.arrays.keys()
    for key in stacked.state.arrays:
        assert np.array_equal(stacked.state.arrays[key], alone.state.arrays[key]), key
    assert stacked.summary["final"] == alone.summary["final"]
    assert stacked.summary["bytes_up"] == alone.summary["bytes_up"]
