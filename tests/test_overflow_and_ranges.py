"""Integer sums that would wrap, FedAwS rows written for another class, absurd config values.

1. int64 sums (FedAwS's fixed-point reduction, the integer LinearAccumulator of FRL's vote and
   SignSGD's majority) never wrap around: a sum outside int64 raises SumOverflowError (one
   line, a RaysimError); sums that fit are bit-identical to plain numpy sums.
2. A FedAwS client may only send back the row of the class it holds: a message naming another
   class is refused with one rejection line naming the client.
3. Finite but absurd config values (lr 1e308, eps 1e-320, delays of 1e300 s, ...) are one
   ConfigError naming the key, instead of a crash deep inside torch or a NaN model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

# The tiny FedAwS run (12 one-class clients) the corpus sends its messages to.
from corpus.numbers import tiny_fedaws_setup

from raysim import config as config_module
from raysim.core.aggregators import LinearAccumulator, Sum, WeightedMean, contributions_of, total
from raysim.core.state import ClientUpdate, ReducedUpdate, RoundInfo
from raysim.errors import ConfigError, RaysimError

NEAR_LIMIT = np.float32(2**20 - 1)  # |value x samples| must stay below 2^20: the largest allowed


@pytest.fixture(scope="module")
def fedaws_setup():
    return tiny_fedaws_setup()


def _message(server, value: float, class_id: int, bag_ids=()) -> dict:
    """A well-formed FedAwS message: every dense entry `value`, small rows."""
    from raysim.models.layout import layout_of
    from raysim.models.vector import cached_model

    layout = layout_of(cached_model(server.ctx))
    dim = server.state.arrays["class_embeddings"].shape[1]
    ids = np.asarray(bag_ids, dtype=np.int32)
    return {
        "dense": np.full(len(layout.dense_index), value, dtype=np.float32),
        "bag_ids": ids,
        "bag_rows": np.full((len(ids), layout.bag_width), value, dtype=np.float32),
        "class": int(class_id),
        "row": np.full(dim, 0.5, dtype=np.float32),
    }


def _reduce(algorithm, ctx, updates, sent=None) -> dict:
    reducer = algorithm.task_reducer(ctx)
    for update in updates:
        extra = () if sent is None else (sent,)
        assert reducer.add(update, *extra) is None
    return reducer.result()


# --- 1. integer sums never wrap ----------------------------------------------------------------


def test_item1_integer_sums_wrap_silently_fedaws_fixed_point(fedaws_setup):
    """2,049 clients at the per-client limit pass 2^63 in FedAwS's int64 fixed-point sum: in
    one task, across tasks (the server's merge) and in the grouped bag-row sum, the sum is
    refused instead of wrapping to a huge negative total."""
    ctx, _, _, classes, server = fedaws_setup
    algorithm = server.algorithm
    count = 2_200  # 2,049 terms of 2^52 - 2^32 already pass 2^63 - 1
    updates = [
        ClientUpdate(client, 1, _message(server, NEAR_LIMIT, classes[client % 12], bag_ids=[3]))
        for client in range(count)
    ]
    # Within one task: the 2,049th client's dense sum would wrap.
    with pytest.raises(RaysimError, match=r"'dense' overflows"):
        _reduce(algorithm, ctx, updates)
    # Across tasks: each half fits, their merge on the server does not.
    first = _reduce(algorithm, ctx, updates[: count // 2])
    second = _reduce(algorithm, ctx, updates[count // 2 :])
    assert first["dense"].min() > 0 and second["dense"].min() > 0
    with pytest.raises(RaysimError, match=r"overflows") as caught:
        algorithm.merge_reduced(first, second, ctx)
    assert "\n" not in str(caught.value)
    # The grouped sum of one bag row sent by every client (dense kept tiny so it fits).
    tiny = [
        ClientUpdate(u.client_id, 1, {**u.vector, "dense": u.vector["dense"] * 0}) for u in updates
    ]
    with pytest.raises(RaysimError, match=r"'bag_rows' overflows"):
        _reduce(algorithm, ctx, tiny)
    # Sums that fit are unchanged: the bounds only decide when to check.
    small = [ClientUpdate(c, 3, _message(server, 0.25, classes[c], bag_ids=[c])) for c in range(8)]
    merged = None
    for update in small:
        merged = algorithm.merge_reduced(merged, _reduce(algorithm, ctx, [update]), ctx)
    assert np.array_equal(merged["dense"], np.full_like(merged["dense"], 8 * 3 * 2**30))
    assert np.array_equal(merged["bag_rows"], np.full_like(merged["bag_rows"], 3 * 2**30))


def test_item1_exact_sums_equal_plain_sums_and_refuse_exactly_what_leaves_int64():
    """The exact paths (taken when the bounds might pass 2^63) give the plain sums bit for bit
    and refuse exactly the sums outside int64."""
    from raysim.core.fixed_point import SumOverflowError, checked_add, sum_rows_by_id

    rng = np.random.default_rng(7)
    fitted = refused = 0
    for _ in range(300):
        n = int(rng.integers(1, 30))
        ids = rng.integers(0, 3, n)
        rows = rng.integers(-(2**59), 2**59, (n, 2), dtype=np.int64) * rng.integers(1, 9)
        exact = {}
        for i, row in zip(ids.tolist(), rows.tolist(), strict=True):
            exact[i] = [a + b for a, b in zip(exact.get(i, [0, 0]), row, strict=True)]
        fits = all(-(2**63) <= v < 2**63 for values in exact.values() for v in values)
        try:
            unique, summed, _ = sum_rows_by_id(ids, rows, 2**64, "rows")
        except SumOverflowError:
            assert not fits
            refused += 1
            continue
        assert fits
        fitted += 1
        assert {int(k): [int(v) for v in s] for k, s in zip(unique, summed, strict=True)} == exact
        a, b = rows[0], rows[-1]
        true = [int(x) + int(y) for x, y in zip(a, b, strict=True)]
        try:
            result, _ = checked_add(a, 2**63, b, 2**63, "x")
            assert [int(v) for v in result] == true
        except SumOverflowError:
            assert not all(-(2**63) <= v < 2**63 for v in true)
    assert fitted > 30 and refused > 30


def test_item1_integer_sums_wrap_silently_linear_accumulator():
    """FRL's vote / SignSGD's count (`sum`) and integer weighted means sum in int64: a total or
    a weighted term outside int64 is refused instead of wrapping; the accumulator keeps its
    previous total."""
    big = np.array([2**62, 5], dtype=np.int64)
    with pytest.raises(RaysimError, match="overflows"):
        total([big, big])  # 2^63: wraps to -2^63 without the check
    with pytest.raises(RaysimError, match="overflows"):
        Sum().aggregate(contributions_of([big, big, -big]))  # the running sum passes 2^63 first
    # the weight times the update leaves int64 (num_samples as weight)
    with pytest.raises(RaysimError, match="times its weight"):
        WeightedMean().aggregate(contributions_of([np.array([2**40], np.int64)], [2**30]))
    # uint64 values above 2^63 would wrap when read as int64
    with pytest.raises(RaysimError):
        total([np.array([2**63 + 1], dtype=np.uint64)])
    accumulator = LinearAccumulator(normalize=False)
    accumulator.add(big, 1)
    with pytest.raises(RaysimError):
        accumulator.add(big, 1)
    assert np.array_equal(accumulator.result(), big) and accumulator.count == 1
    # Sums near the edge that fit are exact, including after the exact path was taken.
    edge = np.array([2**62, -(2**62)], dtype=np.int64)
    result = total([edge, np.array([2**62 - 1, -(2**62)], dtype=np.int64), -edge])
    assert result.tolist() == [2**62 - 1, -(2**62)]  # after partial sums 2^63 - 1 and -2^63
    # int8 signs take the bound from the dtype: no pass over the data, same result
    signs = [np.array([1, -1, 1], dtype=np.int8)] * 5
    assert total(signs).tolist() == [5, -5, 5] and total(signs).dtype == np.int64


# --- 2. a FedAwS client writes only its own class's row -------------------------------------------


def test_item2_fedaws_client_may_write_any_class_row(fedaws_setup):
    """The server sends client c the row of its class (a ClassRow carrying the class id); the
    task's reducer refuses a message naming any other class, and the server logs one line
    naming the client."""
    ctx, _, _, classes, server = fedaws_setup
    algorithm = server.algorithm
    ids = np.array([1, 5, 9])
    personal = server.personal_payloads(ids)
    assert [p.class_id for p in personal] == [int(classes[c]) for c in ids]
    own = int(classes[5])
    other = int(classes[9])
    assert own != other
    reducer = algorithm.task_reducer(ctx)
    honest = ClientUpdate(5, 2, _message(server, 0.01, own))
    lying = ClientUpdate(5, 2, _message(server, 0.01, other))
    problem = reducer.add(lying, personal[1])
    assert problem == (
        f"'class' is {other}, but this client holds class {own} "
        f"(a client may only send its own class's row)"
    )
    assert reducer.add(honest, personal[1]) is None
    # Refused in the task, logged by the server with the client's id.
    server.start_round(RoundInfo(0, ids))
    reduced = ReducedUpdate([5], [2], reducer.result(), [{}], 0, rejected=[(5, problem)])
    server.add([reduced])
    stats = server.finish_round(evaluate=False)
    assert stats.rejected == [f"round 1: rejected the update of client 5: {problem}"]
    assert stats.clients_rejected == 1 and stats.clients_done == 1


def test_item2_end_to_end_a_lying_fedaws_client_is_rejected(fedaws_setup):
    """Through the task body: a client whose message names another class is rejected."""
    from raysim.algorithms.fedaws import FedAwS
    from raysim.core.clients import train_clients

    ctx, dataset, split, classes, server = fedaws_setup

    class Lying(FedAwS):
        def client_messages(self, payload, trained, ctx):
            updates = super().client_messages(payload, trained, ctx)
            for update in updates:
                update.vector["class"] = (update.vector["class"] + 1) % 12
            return updates

    lying = Lying(k=2, class_lr=0.1, spreadout="none")
    ids = np.array([2])
    updates = train_clients(
        ctx,
        lying,
        server.payload(),
        dataset.train_x,
        dataset.train_y,
        split.indices,
        split.offsets,
        0,
        ids,
        server.personal_payloads(ids),
    )
    assert [client for client, _ in updates[0].rejected] == [2]


# --- 3. finite but absurd config values ---------------------------------------------------------

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DIGITS = CONFIGS / "fedavg_digits.yaml"
FEDAWS = CONFIGS / "fedaws_synthetic_xml.yaml"
SOFTMAX = CONFIGS / "fedaws_softmax_synthetic_xml.yaml"

ABSURD = [
    (DIGITS, "clients.lr=1e308", "clients.lr"),
    (DIGITS, "clients.lr=1e5", "clients.lr"),
    (DIGITS, "server.lr=1e300", "server.lr"),
    (DIGITS, "server.eps=1e-320", "server.eps"),
    (DIGITS, "faults.straggler_delay_s=1e300", "faults.straggler_delay_s"),
    (DIGITS, "run.round_deadline_s=1e300", "run.round_deadline_s"),
    (DIGITS, "clients.weight_decay=1e300", "clients.weight_decay"),
    (DIGITS, "clients.num_cpus=1e300", "clients.num_cpus"),
    (DIGITS, "clients.num_gpus=1e9", "clients.num_gpus"),
    (DIGITS, "server.num_gpus=1e9", "server.num_gpus"),
    (DIGITS, "index.num_cpus=.inf", "index.num_cpus"),
    (FEDAWS, "algorithm.class_lr=1e308", "algorithm.class_lr"),
    (FEDAWS, "algorithm.spreadout_lr=1e300", "algorithm.spreadout_lr"),
    (FEDAWS, "algorithm.lambda=1e300", "algorithm.lambda"),
    (FEDAWS, "algorithm.nu=1e300", "algorithm.nu"),
    (SOFTMAX, "algorithm.scale=1e300", "algorithm.scale"),
]


@pytest.mark.parametrize(("path", "override", "key"), ABSURD, ids=[a[1] for a in ABSURD])
def test_item3_absurd_finite_config_values(path, override, key):
    with pytest.raises(ConfigError) as caught:
        config_module.load(path, [override])
    message = str(caught.value)
    assert message.startswith(f"--set {override}: '{key}' must be"), message
    assert "\n" not in message


def test_item3_generous_values_are_still_accepted():
    config_module.load(
        DIGITS,
        [
            "clients.lr=1e4",
            "server.lr=1e4",
            "server.eps=1e-30",
            "faults.straggler_delay_s=86400",
            "run.round_deadline_s=86400",
            "clients.weight_decay=1e4",
            "clients.num_cpus=1024",
        ],
    )
    config_module.load(FEDAWS, ["algorithm.lambda=1e6", "algorithm.nu=1e3"])
