"""Asynchronous aggregation in simulated time (devices.aggregation: fedbuff | fedasync;
raysim.core.schedule.async_events, docs/SIMULATED_TIME.md): an async run is a function of the
seed alone (twice, Ray vs local for two packings, resumed), its staleness weights follow the
formula on a hand-worked case, an offline client is never trained, and a method that cannot
run asynchronously is refused in one line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from raysim.assembly import resume, run
from raysim.assembly.plan import plan_run
from raysim.config import from_dict
from raysim.core.async_aggregation import AsyncAggregation
from raysim.core.schedule.async_events import staleness_weight
from raysim.core.state import ServerState
from raysim.data.datasets import load_dataset
from raysim.errors import ConfigError, RaysimError
from raysim.outputs.tensorboard import sim_time_step

BASE = {
    "run": {"name": "async", "seed": 5, "rounds": 4, "checkpoint_every": 2},
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 20, "alpha": 0.5},
    "clients": {"per_round": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
    "model": {"name": "mlp", "hidden": [8]},
    "algorithm": {"name": "fedavg"},
    "runtime": {"backend": "local"},
    "devices": {
        "profiles": "sampled",
        "compute_median": 2e6,
        "compute_sigma": 1.0,
        "upload_sigma": 1.0,
        "online_fraction": 0.7,
        "period_s": 2.0,
        "aggregation": "fedbuff",
        "concurrency": 6,
        "target": 0.05,
    },
}


def _config(*overrides: str):
    return from_dict(BASE, list(overrides))


def _run(config, out, tensorboard=False):
    return run(config, out, progress=False, tensorboard=tensorboard)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b) -> None:
    assert a.state.arrays.keys() == b.state.arrays.keys()
    for key in a.state.arrays:
        assert np.array_equal(a.state.arrays[key], b.state.arrays[key]), key
    assert a.summary["sim"] == b.summary["sim"]
    assert a.summary["final"] == b.summary["final"]


@pytest.fixture(scope="module")
def local_async_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    return _run(_config(), out, tensorboard=True), out


def test_an_async_run_is_the_same_twice_and_records_time_and_staleness(local_async_run, tmp_path):
    first, out = local_async_run
    _same(first, _run(_config(), tmp_path))
    records = _records(out)
    ends = [r["sim"]["end_s"] for r in records]
    assert ends == sorted(ends) and ends[0] > 0
    assert all(
        r["sim"]["start_s"] == p["sim"]["end_s"] for p, r in zip(records, records[1:], strict=False)
    )
    assert all(r["clients"] == r["sim"]["kept"] == 3 for r in records)  # K = clients.per_round
    staleness = [s for r in records for s in r["sim"]["staleness"]]
    assert max(staleness) > 0  # 6 in flight, 3 a step: some updates are stale
    assert all(r["sim"]["staleness_max"] == max(r["sim"]["staleness"]) for r in records)
    sim = first.summary["sim"]
    assert sim["aggregation"] == "fedbuff" and sim["sim_time_s"] == ends[-1]
    assert sim["staleness"]["max"] == max(staleness)
    assert sum(sim["staleness"]["counts"]) == len(staleness) == 12
    assert sum(sim["participation"]["per_client"]) == 12
    assert sim["time_to_target_s"] in ends
    # TensorBoard: the metrics against simulated time (step: its milliseconds), and the
    # staleness distribution of every step as a histogram
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard" / "sim_time"), size_guidance={"scalars": 0})
    events.Reload()
    series = {e.step: e.value for e in events.Scalars("sim_time/eval/accuracy")}
    assert series == pytest.approx(
        {sim_time_step(r["sim"]["end_s"]): r["eval"]["accuracy"] for r in records if "eval" in r}
    )
    assert sorted(series) == [round(e * 1000) for e in ends if e]
    by_round = EventAccumulator(str(out / "tensorboard"), size_guidance={"histograms": 0})
    by_round.Reload()
    assert "sim/staleness" in by_round.Tags()["histograms"]
    # the server keeps past models only while a client trains on them (the version window)
    window = [int(k[7:].split(".")[0]) for k in first.state.arrays if k.startswith("async.")]
    assert all(v < 4 for v in window)


def test_fedasync_is_the_same_twice(tmp_path):
    config = _config("devices.aggregation=fedasync", "run.rounds=5")
    a, b = _run(config, tmp_path / "a"), _run(config, tmp_path / "b")
    _same(a, b)
    assert all(r["clients"] == 1 for r in _records(tmp_path / "a"))


def test_ray_matches_local_for_two_packings(ray_session, local_async_run, tmp_path):
    local, _ = local_async_run
    # auto: tasks first, then (as measured) the server actor's own process and its thread
    for per_task in (2, "auto"):
        ray = _run(
            _config("runtime.backend=ray", f"clients.per_task={per_task}"), tmp_path / str(per_task)
        )
        _same(local, ray)


def test_a_resumed_async_run_ends_where_an_uninterrupted_one_does(local_async_run, tmp_path):
    whole, _ = local_async_run
    _run(_config("run.rounds=2"), tmp_path)
    resumed = resume(tmp_path, overrides=["run.rounds=4"], progress=False, tensorboard=False)
    assert resumed.summary["resumed_from_round"] == 2
    _same(whole, resumed)


class _Schedule:
    """One update landing in step 4 from version 1: staleness 3."""

    def __init__(self, fedasync: bool) -> None:
        self.fedasync, self.mixing, self.exponent = fedasync, 0.6 if fedasync else 1.0, 0.5

    def version_of(self, round_index, client_id):
        return 1

    def weight(self, round_index, client_id):
        return self.mixing * float(staleness_weight(round_index - 1, self.exponent))


def test_staleness_weights_match_the_formula_on_a_hand_worked_case():
    # s(tau) = (1 + tau)^-a, a = 0.5: 1, 1/sqrt(2), 1/2 for tau = 0, 1, 3
    assert np.allclose(staleness_weight([0, 1, 3], 0.5), [1.0, 2**-0.5, 0.5])
    assert staleness_weight(7, 0.0) == 1.0  # a = 0: no staleness discount
    inner = SimpleNamespace(update_delta_of="params")
    state = ServerState(
        4,
        {
            "params": np.array([1.0, 1.0], np.float32),
            "async.v1.params": np.array([0.0, 2.0], np.float32),
        },
    )
    delta = np.array([2.0, 0.0], np.float32)
    config = SimpleNamespace(algorithm=SimpleNamespace(name="fedavg"))
    for fedasync, expected in ((False, [1.0, 0.0]), (True, [0.3, 0.3])):
        algorithm = object.__new__(AsyncAggregation)
        algorithm.inner, algorithm.schedule, algorithm.name = inner, _Schedule(fedasync), "x"
        algorithm.update_delta_of = "params"
        weighed = algorithm.weigh_update(state, 4, 0, delta)
        # FedBuff: s(3) x delta = 0.5 x [2, 0]. FedAsync: alpha s(3) = 0.3 times the move from
        # x_{t-1} = [1, 1] to x_new = x_tau + delta = [2, 2], so that x_t = 0.7 x_{t-1} + 0.3
        # x_new = [1.3, 1.3] under FedAvg's server step (sgd, lr 1)
        assert np.allclose(weighed, expected), (fedasync, weighed)
    del config


def test_an_offline_client_is_never_trained(tmp_path):
    # client 1 is online only for its first millisecond of every 1,000 s: too short to finish
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "client,flops_per_s,download_bps,upload_bps,online\n"
        "0,1e7,1e6,1e6,\n"
        "1,1e5,1e5,1e5,0-0.001\n"
        "2,5e6,1e6,5e5,0-400;600-1000\n"
    )
    config = _config(
        "devices.profiles=trace",
        f"devices.trace={trace}",
        "devices.trace_period_s=1000",
        "run.rounds=5",
    )
    result = _run(config, tmp_path / "out")
    schedule = plan_run(config, load_dataset(config)).schedule  # the server's event schedule
    trained = np.concatenate([schedule.info(r).client_ids for r in range(5)])
    assert len(trained) == result.summary["clients_done"]  # the run trained these
    # trace client 1 is clients 1, 4, 7, ... (client i takes row i mod 3)
    assert not np.isin(trained, np.arange(1, 20, 3)).any()
    assert result.summary["sim"]["clients_offline"] > 0
    per_client = np.array(result.summary["sim"]["participation"]["per_client"])
    assert not per_client[1::3].any()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["algorithm.name=frl"], "algorithm 'frl' sends updates that are not deltas"),
        (
            ["algorithm.name=flag", "data.name=synthetic_multilabel", "partition.name=iid"],
            "algorithm 'flag' keeps each client's local model",
        ),
        (
            ["algorithm.name=local_only", "data.name=synthetic_multilabel", "partition.name=iid"],
            "algorithm 'local_only' keeps per-client state",
        ),
        (
            ["algorithm.name=multilabel_fedavg", "data.name=synthetic_multilabel"],
            "algorithm.keep_client_models: false runs it without them",
        ),
        (["devices.max_staleness=0"], "devices.max_staleness=0: in round"),
        (
            ["algorithm.name=signsgd", "aggregator.name=sum", "devices.aggregation=fedasync"],
            "algorithm 'signsgd' sends signs",
        ),
    ],
)
def test_what_cannot_run_asynchronously_is_refused_in_one_line(tmp_path, overrides, says):
    config = _config(*overrides)
    with pytest.raises((ConfigError, RaysimError)) as caught:
        _run(config, tmp_path)
    message = str(caught.value)
    assert says in message and "\n" not in message, message


def test_async_keys_are_checked():
    with pytest.raises(ConfigError, match="devices.mixing"):
        _config("devices.mixing=0")
    with pytest.raises(ConfigError, match="devices.over_selection"):
        _config("devices.over_selection=0.5")
    with pytest.raises(ConfigError, match="devices.buffer_size"):
        _config("devices.aggregation=fedasync", "devices.buffer_size=3")
    with pytest.raises(ConfigError, match="devices.profiles"):
        _config("devices.profiles=none")
    with pytest.raises(ConfigError, match="devices.aggregation"):
        _config("devices.aggregation=async")


def test_compare_ranks_methods_by_simulated_time_to_target():
    from raysim.compare_report import time_to_target, time_to_target_ranking

    def summaries(*times):
        return [
            {"sim": {"target": 0.9, "target_metric": "accuracy", "time_to_target_s": t}}
            for t in times
        ]

    entries = {
        "fedavg": {"time_to_target": time_to_target(summaries(30.0, 50.0))},
        "fedbuff": {"time_to_target": time_to_target(summaries(10.0, 20.0))},
        "fedasync": {"time_to_target": time_to_target(summaries(5.0, None))},
    }
    assert entries["fedbuff"]["time_to_target"]["mean"] == 15.0
    assert entries["fedasync"]["time_to_target"]["reached"] == 1
    rows = [line for line in time_to_target_ranking(entries) if line.startswith("| ")][2:]
    # reached on both seeds first (faster mean first), then the one that missed a seed
    assert [row.split(" | ")[1] for row in rows] == ["fedbuff", "fedavg", "fedasync"]
    assert time_to_target([{"final": {}}]) is None  # no simulated target: no ranking


def test_the_example_gives_every_method_the_same_client_update_budget():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import simulated_time as example

    for dataset, overrides in example.DATASETS.items():
        for method, changes in example.METHODS.items():
            config = from_dict(example.BASE, [*overrides, *changes, "devices.target=0.9"])
            per_step = 1 if config.devices.aggregation == "fedasync" else config.clients.per_round
            assert config.run.rounds * per_step == 300, (dataset, method)


def test_the_async_wrapper_accounts_for_every_algorithm_hook():
    # a hook added to AlgorithmHooks must be forwarded, refused or replaced by the wrapper:
    # otherwise an asynchronous run would silently drop (or wrongly keep) it
    from dataclasses import fields

    from raysim.core import async_aggregation
    from raysim.core.algorithm import AlgorithmHooks

    named = (*async_aggregation.FORWARDED, *async_aggregation.REFUSED, *async_aggregation.OWN)
    assert len(named) == len(set(named))
    assert set(named) == {f.name for f in fields(AlgorithmHooks)}
