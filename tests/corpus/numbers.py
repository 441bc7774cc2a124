"""Absurd numbers: finite config values no run uses, integer sums that would pass int64, and
FedAwS messages that write another class's row.

- config cases load configs/fedavg_digits.yaml (or a FedAwS config) with one `--set` override,
  as `raysim run --set ...` does: one ConfigError naming the key;
- overflow cases feed the exact integer sums (the LinearAccumulator of FRL's vote and SignSGD's
  majority, FedAwS's fixed-point reduction in a task and its merge on the server) terms whose
  total leaves int64: SumOverflowError (a RaysimError), never a wrapped sum;
- class cases send a FedAwS message naming a class the client does not hold (or no valid
  class) through the task's reducer and the server: the server's rejection line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import Case

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
DIGITS = CONFIGS / "fedavg_digits.yaml"
FEDAWS = CONFIGS / "fedaws_synthetic_xml.yaml"
SOFTMAX = CONFIGS / "fedaws_softmax_synthetic_xml.yaml"

CASES: list[Case] = []


class Accepted(AssertionError):
    """raysim took the absurd input without a word: a defect of the case's kind (the runner
    reports any exception other than a RaysimError as one)."""


def case(name: str, timeout_s: float = 30.0) -> Callable[[Callable[[Path], object]], Callable]:
    def register(run: Callable[[Path], object]) -> Callable[[Path], object]:
        CASES.append(Case(f"numbers/{name}", run, timeout_s))
        return run

    return register


# --- absurd config values -------------------------------------------------------------------------

ABSURD_CONFIG = [
    (DIGITS, "clients.lr=1e308"),
    (DIGITS, "clients.lr=3.5e38"),  # just past float32: torch cannot take it as a step size
    (DIGITS, "server.lr=1e300"),
    (DIGITS, "server.eps=1e-320"),
    (DIGITS, "server.eps=5e-324"),
    (DIGITS, "faults.straggler_delay_s=1e300"),
    (DIGITS, "faults.straggler_delay_s=1e10"),
    (DIGITS, "run.round_deadline_s=1e300"),
    (DIGITS, "clients.weight_decay=1e300"),
    (DIGITS, "clients.num_cpus=1e300"),
    (DIGITS, "clients.num_gpus=1e300"),
    (DIGITS, "server.num_gpus=1e12"),
    (DIGITS, "index.num_cpus=1e300"),
    (DIGITS, "index.num_gpus=.inf"),
    (FEDAWS, "clients.lr=1e308"),
    (FEDAWS, "server.eps=1e-320"),
    (FEDAWS, "algorithm.class_lr=1e308"),
    (FEDAWS, "algorithm.spreadout_lr=1e300"),
    (FEDAWS, "algorithm.lambda=1e300"),
    (FEDAWS, "algorithm.nu=1e300"),
    (SOFTMAX, "algorithm.scale=1e300"),
    (SOFTMAX, "algorithm.class_lr=1e100"),
]


def _config_case(path: Path, override: str) -> Callable[[Path], object]:
    def run(folder: Path):
        from raysim import config

        config.load(path, [override])
        raise Accepted(f"config.load accepted --set {override}")

    return run


for _path, _override in ABSURD_CONFIG:
    _name = f"numbers/config-{_path.stem}-{_override.replace('=', '-')}"
    CASES.append(Case(_name, _config_case(_path, _override)))


# --- integer sums that would pass int64 -----------------------------------------------------------


def _wrapped(result) -> Accepted:
    return Accepted(f"summed without an error: {np.asarray(result).ravel()[:4].tolist()}")


@case("int64-vote-sum-passes-2^63")
def _(folder: Path):
    from raysim.core.aggregators import total

    big = np.array([2**62, 1], dtype=np.int64)
    raise _wrapped(total([big, big]))  # 2^63: wraps to -2^63 unchecked


@case("int64-running-sum-passes-2^63-then-comes-back")
def _(folder: Path):
    from raysim.core.aggregators import Sum, contributions_of

    big = np.array([2**62], dtype=np.int64)
    raise _wrapped(Sum().aggregate(contributions_of([big, big, -big])))


@case("int64-weighted-term-leaves-int64")
def _(folder: Path):
    from raysim.core.aggregators import WeightedMean, contributions_of

    vectors = [np.array([2**40, 3], dtype=np.int64)]  # a position of 2^40 x 2^30 samples
    raise _wrapped(WeightedMean().aggregate(contributions_of(vectors, [2**30])))


@case("int64-integral-float-weight-1e30")
def _(folder: Path):
    from raysim.core.aggregators import LinearAccumulator

    accumulator = LinearAccumulator(normalize=False)
    accumulator.add(np.array([1, 2], dtype=np.int32), 1e30)
    raise _wrapped(accumulator.result())


@case("uint64-update-above-2^63")
def _(folder: Path):
    from raysim.core.aggregators import total

    raise _wrapped(total([np.array([2**63 + 5], dtype=np.uint64)]))


@case("int64-mean-of-many-large-positions")
def _(folder: Path):
    from raysim.core.aggregators import mean

    vectors = [np.full(1000, 2**60, dtype=np.int64)] * 9  # 9 x 2^60 > 2^63
    raise _wrapped(mean(vectors))


@case("fixed-point-checked-add-passes-2^63")
def _(folder: Path):
    from raysim.core.fixed_point import checked_add

    a = np.full(4, 2**62 + 2**61, dtype=np.int64)
    raise _wrapped(checked_add(a, 2**63, a, 2**63, "dense")[0])


@case("fixed-point-rows-by-id-pass-2^63")
def _(folder: Path):
    from raysim.core.fixed_point import sum_rows_by_id

    rows = np.full((3, 2), 2**62, dtype=np.int64)
    raise _wrapped(sum_rows_by_id(np.array([7, 7, 7]), rows, None, "bag_rows")[1])


# --- FedAwS: a tiny run to send messages to -------------------------------------------------------

TINY_FEDAWS = {
    "run": {"seed": 3, "rounds": 1, "eval_every": 1, "checkpoint_every": 0},
    "data": {
        "name": "synthetic_xml",
        "num_labels": 12,
        "num_features": 64,
        "num_train": 96,
        "num_test": 24,
    },
    "partition": {"name": "one_class", "num_clients": 12},
    "clients": {"per_round": 4, "local_epochs": 1, "batch_size": 8, "lr": 1.0},
    "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6},
    "model": {"name": "xml_embedding_bag", "bag_dim": 4, "hidden": [4], "embedding_dim": 4},
    "algorithm": {"name": "fedaws", "k": 2, "class_lr": 0.1, "spreadout": "none"},
    "runtime": {"backend": "local"},
}
NEAR_LIMIT = 2**20 - 1  # |value x samples| must stay below 2^20: the largest a client may send


def tiny_fedaws_setup():
    """(ctx, dataset, split, client_classes, server) of the 12-class FedAwS run above, one
    class per client (also the fixture of tests/test_overflow_and_ranges.py)."""
    from raysim import config
    from raysim.assembly import plan_run
    from raysim.core.clients import single_class_of_clients
    from raysim.core.server import Server, ServerData
    from raysim.data.datasets import load_dataset

    run_config = config.from_dict(TINY_FEDAWS)
    dataset = load_dataset(run_config)
    plan = plan_run(run_config, dataset)
    split, ctx = plan.split, plan.ctx
    classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)
    return (
        ctx,
        dataset,
        split,
        classes,
        Server(ctx, ServerData(dataset.test_x, dataset.test_y, client_classes=classes)),
    )


def _fedaws():
    """(ctx, server, client_classes) of the tiny FedAwS run."""
    ctx, _, _, classes, server = tiny_fedaws_setup()
    return ctx, server, classes


def _message(server, value: float, class_id, bag_ids=(), bag_value=None) -> dict:
    from raysim.models.layout import layout_of
    from raysim.models.vector import cached_model

    layout = layout_of(cached_model(server.ctx))
    dim = server.state.arrays["class_embeddings"].shape[1]
    ids = np.asarray(bag_ids, dtype=np.int32)
    return {
        "dense": np.full(len(layout.dense_index), value, dtype=np.float32),
        "bag_ids": ids,
        "bag_rows": np.full(
            (len(ids), layout.bag_width), value if bag_value is None else bag_value, np.float32
        ),
        "class": class_id,
        "row": np.full(dim, 0.5, dtype=np.float32),
    }


def _near_limit_updates(server, classes, count: int, dense: float = NEAR_LIMIT, bag=()):
    """Messages of `count` clients of one sample each: every dense entry `dense`, the rows of
    the bag ids `bag` at the limit."""
    from raysim.core.state import ClientUpdate

    return [
        ClientUpdate(c, 1, _message(server, dense, int(classes[c % 12]), bag, NEAR_LIMIT))
        for c in range(count)
    ]


def _reduce(server, updates) -> dict:
    """The task's exact sum of `updates`, each of them valid on its own."""
    reducer = server.algorithm.task_reducer(server.ctx)
    for update in updates:
        problem = reducer.add(update)
        if problem is not None:
            raise AssertionError(f"a valid message was refused: {problem}")
    return reducer.result()


@case("fedaws-2200-clients-near-limit-in-one-task")
def _(folder: Path):
    ctx, server, classes = _fedaws()
    reduced = _reduce(server, _near_limit_updates(server, classes, 2_200))
    raise _wrapped(reduced["dense"])


@case("fedaws-2200-clients-near-limit-over-two-tasks")
def _(folder: Path):
    ctx, server, classes = _fedaws()
    updates = _near_limit_updates(server, classes, 2_200)
    first, second = _reduce(server, updates[:1_100]), _reduce(server, updates[1_100:])
    merged = server.algorithm.merge_reduced(first, second, ctx)
    raise _wrapped(merged["dense"])


@case("fedaws-2200-clients-same-bag-row")
def _(folder: Path):
    ctx, server, classes = _fedaws()
    reduced = _reduce(server, _near_limit_updates(server, classes, 2_200, dense=0.0, bag=[5]))
    raise _wrapped(reduced["bag_rows"])


@case("fedaws-2200-single-client-tasks-merged-on-the-server")
def _(folder: Path):
    ctx, server, classes = _fedaws()
    merged = None
    for update in _near_limit_updates(server, classes, 2_200):
        merged = server.algorithm.merge_reduced(merged, _reduce(server, [update]), ctx)
    raise _wrapped(merged["dense"])


# --- FedAwS: messages naming a class the client does not hold -------------------------------------


def _rejection(client: int, choose, num_samples=2) -> str:
    """Client `client` sends a message naming class `choose(client_classes)`, through the
    task's reducer (given what the server sent it) and the server; returns the server's
    rejection line, as it logs it."""
    from raysim.core.state import ClientUpdate, ReducedUpdate, RoundInfo

    ctx, server, classes = _fedaws()
    ids = np.array(sorted({client, 0, 11}))
    sent = dict(zip(ids.tolist(), server.personal_payloads(ids), strict=True))
    reducer = server.algorithm.task_reducer(ctx)
    class_id = choose(classes)
    update = ClientUpdate(client, num_samples, _message(server, 0.01, class_id))
    problem = reducer.add(update, sent[client])
    server.start_round(RoundInfo(0, ids))
    if problem is None:
        server.add([ReducedUpdate([client], [num_samples], reducer.result(), [{}], 0)])
        raise Accepted(f"the reducer folded class {class_id!r} from client {client}")
    server.add([ReducedUpdate([], [], None, [], 0, rejected=[(client, problem)])])
    return server.finish_round(evaluate=False).rejected[0]


def _other(classes, client: int) -> int:
    """A class that client `client` does not hold."""
    return int(next(c for c in range(12) if c != classes[client]))


CLASS_CASES = {
    "class-of-another-sampled-client": (5, lambda k: int(k[11]) if k[11] != k[5] else _other(k, 5)),
    "class-plus-one": (5, lambda k: int(k[5] + 1) % 12),
    "class-zero-from-a-client-of-another-class": (5, lambda k: 0 if k[5] != 0 else _other(k, 5)),
    "last-class-from-client-0": (0, lambda k: 11 if k[0] != 11 else 10),
    "first-other-class-from-client-11": (11, lambda k: _other(k, 11)),
    "class-out-of-range": (5, lambda k: 12),
    "class-negative": (5, lambda k: -1),
    "class-huge-int": (5, lambda k: 10**30),
    "class-numpy-int-of-another-class": (5, lambda k: np.int64(_other(k, 5))),
    "class-float": (5, lambda k: float(k[5])),
    "class-bool": (5, lambda k: True),
    "class-null": (5, lambda k: None),
}


def _class_case(client: int, choose) -> Callable[[Path], object]:
    return lambda folder: _rejection(client, choose)


for _name, (_client, _choose) in CLASS_CASES.items():
    CASES.append(Case(f"numbers/fedaws-{_name}", _class_case(_client, _choose)))


@case("fedaws-num-samples-10^400")
def _(folder: Path):
    return _rejection(5, lambda k: int(k[5]), num_samples=10**400)
