"""Simulated time (devices:, docs/SIMULATED_TIME.md): runs with device profiles, a simulated
deadline and over-selection are a function of the seed alone (twice, Ray vs local for two
packings, resumed), a trace file is read or refused in one line naming its line, and a client
that is offline is never trained."""

from __future__ import annotations

import json

import numpy as np
import pytest

from raysim.assembly import resume, run
from raysim.assembly.plan import plan_run
from raysim.config import from_dict
from raysim.core.schedule.profiles import read_trace
from raysim.data.datasets import load_dataset
from raysim.errors import RaysimError

BASE = {
    "run": {"name": "sim", "seed": 3, "rounds": 4, "checkpoint_every": 2},
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 20, "alpha": 0.5},
    "clients": {"per_round": 4, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
    "model": {"name": "mlp", "hidden": [8]},
    "algorithm": {"name": "fedavg"},
    "runtime": {"backend": "local"},
    "devices": {
        "profiles": "sampled",
        "compute_median": 2e6,
        "compute_sigma": 1.0,
        "upload_sigma": 1.0,
        "online_fraction": 0.6,
        "period_s": 1.0,
        "deadline_s": 0.15,
        "over_selection": 0.5,
        "target": 0.1,
    },
}


def _config(*overrides: str):
    return from_dict(BASE, list(overrides))


def _run(config, out):
    return run(config, out, progress=False, tensorboard=False)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same(a, b) -> None:
    assert a.state.arrays.keys() == b.state.arrays.keys()
    for key in a.state.arrays:
        assert np.array_equal(a.state.arrays[key], b.state.arrays[key]), key
    assert a.summary["sim"] == b.summary["sim"]
    assert a.summary["final"] == b.summary["final"]


@pytest.fixture(scope="module")
def local_deadline_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    return _run(_config(), out), out


def test_a_deadline_run_is_the_same_twice_and_carries_simulated_time(local_deadline_run, tmp_path):
    first, out = local_deadline_run
    _same(first, _run(_config(), tmp_path))
    records = _records(out)
    ends = [r["sim"]["end_s"] for r in records]
    assert ends == sorted(ends) and ends[0] > 0
    assert all(
        r["sim"]["start_s"] == p["sim"]["end_s"] for p, r in zip(records, records[1:], strict=False)
    )
    # the deadline and over-selection decided who trained: never more than K, some late
    assert all(r["clients"] == r["sim"]["kept"] <= 4 for r in records)
    assert sum(r["sim"]["late"] + r["sim"]["offline"] for r in records) > 0
    assert sum(r["clients_done"] for r in records) == first.summary["clients_done"]
    sim = first.summary["sim"]
    assert sim["sim_time_s"] == ends[-1]
    assert sim["time_to_target_s"] in ends


def test_ray_matches_local_for_two_packings(ray_session, local_deadline_run, tmp_path):
    local, _ = local_deadline_run
    for per_task in (1, 3):
        ray = _run(
            _config("runtime.backend=ray", f"clients.per_task={per_task}"), tmp_path / str(per_task)
        )
        _same(local, ray)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(local_deadline_run, tmp_path):
    whole, _ = local_deadline_run
    _run(_config("run.rounds=2"), tmp_path)
    resumed = resume(tmp_path, overrides=["run.rounds=4"], progress=False, tensorboard=False)
    assert resumed.summary["resumed_from_round"] == 2
    _same(whole, resumed)


def test_an_offline_client_is_never_trained(tmp_path):
    # client 1 is online only for its first millisecond of every 1,000 s: too short to finish
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "# client,flops_per_s,download_bps,upload_bps,online\n"
        "client,flops_per_s,download_bps,upload_bps,online\n"
        "0,1e7,1e6,1e6,\n"
        "1,1e5,1e5,1e5,0-0.001\n"
        "2,5e6,1e6,5e5,0-400;600-1000\n"
    )
    config = _config(
        "devices.profiles=trace",
        f"devices.trace={trace}",
        "devices.trace_period_s=1000",
        "devices.deadline_s=0",
        "run.rounds=6",
    )
    result = _run(config, tmp_path / "out")
    plan = plan_run(config, load_dataset(config))
    clock = plan.rounds.clock  # the plan's simulated clock
    trained = np.concatenate([clock.info(r).client_ids for r in range(6)])
    assert len(trained) == result.summary["clients_done"]  # the run trained these
    # trace client 1 is clients 1, 4, 7, ... (client i takes row i mod 3)
    assert not np.isin(trained, np.arange(1, 20, 3)).any()
    assert result.summary["sim"]["clients_offline"] > 0


def test_a_trace_file_is_read(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(
        "client,flops_per_s,download_bps,upload_bps,online\n0,1e9,2e6,1e6,\n1,2e9,4e6,2e6,10-20\n"
    )
    profiles = read_trace(trace, 5, 100.0)
    assert profiles.flops.tolist() == [1e9, 2e9, 1e9, 2e9, 1e9]
    assert profiles.online(15.0).all() and profiles.online(115.0).all()
    assert profiles.online(5.0).tolist() == [True, False, True, False, True]
    assert profiles.online_until(1, 12.0) == 20.0 and profiles.online_until(0, 5.0) == np.inf


@pytest.mark.parametrize(
    ("row", "says"),
    [
        ("1,fast,1e6,1e6,", "flops_per_s must be a number"),
        ("1,1e9,1e6,1e6,20-10", "must have 0 <= start < end"),
        ("1,1e9,1e6", "expected 5 fields"),
        ("0,1e9,1e6,1e6,", "client 0 appears twice"),
    ],
)
def test_a_malformed_trace_is_refused_naming_its_line(tmp_path, row, says):
    trace = tmp_path / "bad.csv"
    trace.write_text(f"client,flops_per_s,download_bps,upload_bps,online\n0,1e9,1e6,1e6,\n{row}\n")
    with pytest.raises(RaysimError) as caught:
        read_trace(trace, 4, 0.0)
    message = str(caught.value)
    assert message.startswith(f"{trace}:3: ") and says in message and "\n" not in message
    with pytest.raises(RaysimError, match="not a regular file"):
        read_trace(tmp_path, 4, 0.0)
