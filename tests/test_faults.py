"""Client faults (injected exceptions and hard worker exits, retries, drops, stragglers cut by a
round deadline) and server faults (the server actor killed mid-run, restarted from the newest
checkpoint with the missing rounds replayed): runs complete, count what happened, and end with
exactly the parameters of the matching fault-free / uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_fedaws import TINY as TINY_FEDAWS_SETTING

from raysim import config as config_module
from raysim.assembly import run, start_backend
from raysim.core.faults import EXCEPTION, EXIT, FaultPlan, InjectedClientFailure
from raysim.errors import ConfigError
from raysim.seeds import sample_clients

REPO_ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 3
# faults.seed 2 at rate 0.1 with 1 retry: in round 1 client 69 fails twice (an exception, then
# a hard exit) and is dropped, client 39 fails once in round 2 (exception) and client 41 once in
# round 3 (hard exit); see test_the_fault_plan_of_the_test_runs.
FAULTS = (
    f"run.rounds={ROUNDS}",
    "clients.local_epochs=2",
    "faults.client_failure_rate=0.1",
    "faults.hard_exit_fraction=0.5",
    "faults.seed=2",
    "clients.max_retries=1",
)


def _digits(*overrides: str, backend: str = "local") -> config_module.Config:
    return config_module.load(
        REPO_ROOT / "configs" / "fedavg_digits.yaml", [f"runtime.backend={backend}", *overrides]
    )


def _run(config, out) -> object:
    return run(config, out, progress=False, tensorboard=False)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def _assert_same_state(result, reference) -> None:
    assert result.state.round == reference.state.round
    assert set(result.state.arrays) == set(reference.state.arrays)
    for name, value in reference.state.arrays.items():
        assert result.state.arrays[name].tobytes() == value.tobytes(), name


def _expected_faults(plan: FaultPlan, rounds: int, max_retries: int, per_round: int = 10):
    """Per round: (failed attempts, dropped clients, [(client, attempt, kind)]) from the plan."""
    expected = []
    for round_index in range(rounds):
        failed, dropped, events = 0, 0, []
        for client in sample_clients(0, round_index, 100, per_round):
            for attempt in range(max_retries + 1):
                kind = plan.failure(round_index, int(client), attempt)
                if kind is None:
                    break
                failed += 1
                events.append((int(client), attempt, kind))
            else:
                dropped += 1
        expected.append((failed, dropped, events))
    return expected


def test_the_fault_plan_of_the_test_runs():
    plan = FaultPlan.from_config(_digits(*FAULTS))
    expected = _expected_faults(plan, ROUNDS, max_retries=1)
    assert [(f, d) for f, d, _ in expected] == [(2, 1), (1, 0), (1, 0)]
    assert expected[0][2] == [(69, 0, EXCEPTION), (69, 1, EXIT)]
    kinds = [kind for _, _, events in expected for _, _, kind in events]
    assert kinds.count(EXIT) == 2 and kinds.count(EXCEPTION) == 2  # mixed
    assert FaultPlan.from_config(_digits()) is None  # no faults configured: no plan


def test_fault_plan_draws_are_deterministic_and_at_the_configured_rates():
    plan = FaultPlan(0.1, 0.25, 0.2, 1.0, seed=7)
    draws = [plan.failure(r, c, a) for r in range(20) for c in range(100) for a in range(3)]
    assert draws == [plan.failure(r, c, a) for r in range(20) for c in range(100) for a in range(3)]
    failures = [d for d in draws if d is not None]
    assert 0.085 < len(failures) / len(draws) < 0.115
    assert 0.19 < failures.count(EXIT) / len(failures) < 0.31
    stragglers = np.mean([plan.straggles(r, c, 0) for r in range(20) for c in range(100)])
    assert 0.17 < stragglers < 0.23
    other = FaultPlan(0.1, 0.25, 0.2, 1.0, seed=8)
    assert draws != [
        other.failure(r, c, a) for r in range(20) for c in range(100) for a in range(3)
    ]
    with pytest.raises(InjectedClientFailure, match="exit of client 5 in round 1"):
        FaultPlan(1.0, 1.0, 0.0, 0.0, seed=0).inject(0, 5, 0, hard_exits=False)  # simulated


@pytest.mark.parametrize(
    "override, key",
    [
        ("faults.client_failure_rate=1.5", "faults.client_failure_rate"),
        ("faults.client_failure_rate=-0.1", "faults.client_failure_rate"),
        ("faults.hard_exit_fraction=2", "faults.hard_exit_fraction"),
        ("faults.straggler_rate=.nan", "faults.straggler_rate"),
        ("faults.straggler_delay_s=-1", "faults.straggler_delay_s"),
        ("faults.seed=-3", "faults.seed"),
        ("clients.max_retries=-1", "clients.max_retries"),
        ("run.round_deadline_s=0", "run.round_deadline_s"),
        ("faults.rate=0.1", "faults.rate"),
    ],
)
def test_fault_settings_out_of_range_name_their_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _digits(override)


@pytest.fixture(scope="module")
def local_faulty(tmp_path_factory):
    """The local backend under the test's faults: what every Ray run must reproduce."""
    out = tmp_path_factory.mktemp("local_faulty")
    return _run(_digits(*FAULTS), out)


def test_local_run_under_faults_counts_failures_and_is_deterministic(local_faulty, tmp_path):
    records = _records(local_faulty.out_dir)
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    counts = [(r["clients_failed"], r["clients_dropped"], r["clients_done"]) for r in records]
    assert counts == [(2, 1, 9), (1, 0, 10), (1, 0, 10)]
    assert local_faulty.summary["clients_failed"] == 4
    assert local_faulty.summary["clients_dropped"] == 1
    again = _run(_digits(*FAULTS), tmp_path / "again")
    _assert_same_state(again, local_faulty)
    assert again.summary["final"] == local_faulty.summary["final"]
    # Without faults the round-1 aggregate includes client 69: a different model.
    clean = _run(_digits(f"run.rounds={ROUNDS}"), tmp_path / "clean")
    assert clean.state.arrays["params"].tobytes() != local_faulty.state.arrays["params"].tobytes()


def test_a_round_whose_every_client_is_dropped_keeps_the_model(tmp_path):
    config = _digits(
        "run.rounds=2",
        "clients.local_epochs=1",
        "faults.client_failure_rate=1.0",
        "clients.max_retries=0",
    )
    backend = start_backend(config, None)
    initial = backend.get_state()  # round 0 of a fresh server
    backend.shutdown()
    result = _run(config, tmp_path)
    records = _records(tmp_path)
    assert [(r["clients_failed"], r["clients_dropped"]) for r in records] == [(10, 10)] * 2
    assert result.state.round == 2 and result.summary["clients_done"] == 0
    assert result.state.arrays["params"].tobytes() == initial.arrays["params"].tobytes()


@pytest.mark.ray
@pytest.mark.parametrize("per_task", [4, 1])
def test_ray_run_under_faults_equals_local_for_any_packing(
    ray_session, local_faulty, tmp_path, per_task
):
    """Exceptions and hard worker exits on Ray: every round completes, the same clients fail
    and are dropped, and the final parameters equal the local backend's bit for bit."""
    result = _run(_digits(*FAULTS, f"clients.per_task={per_task}", backend="ray"), tmp_path)
    _assert_same_state(result, local_faulty)
    assert result.summary["final"] == local_faulty.summary["final"]
    records, local = _records(tmp_path), _records(local_faulty.out_dir)
    for key in ("round", "clients_done", "clients_failed", "clients_dropped", "bytes_up"):
        assert [r[key] for r in records] == [r[key] for r in local], key
    assert result.summary["task_retries"] >= 3  # every failure short of a drop is retried


def _fedavg_kill():
    # killed in round 4: back to the round-2 checkpoint, round 3 replayed
    return _digits("run.rounds=4", "run.checkpoint_every=2", "clients.local_epochs=1"), 4, 1


def _frl_kill():
    config = config_module.load(
        REPO_ROOT / "configs" / "frl_digits.yaml",
        ["runtime.backend=local", "run.rounds=3", "model.hidden=[128]", "run.checkpoint_every=0"],
    )
    return config, 2, 1  # no checkpoint yet: back to the initial state, round 1 replayed


# The FedAwS tests' tiny setting, with two index shards: on Ray they are actors owned by the
# server actor, and die with it.
TINY_FEDAWS = {**TINY_FEDAWS_SETTING, "index": {"shards": 2}}


@pytest.mark.ray
@pytest.mark.parametrize("make", [_fedavg_kill, _frl_kill], ids=lambda f: f.__name__)
def test_server_actor_killed_mid_run_recovers_to_identical_parameters(
    ray_session, tmp_path, monkeypatch, make
):
    config, kill_round, replayed = make()
    reference = _run(config, tmp_path / "local")  # uninterrupted (Ray == local, bit for bit)
    monkeypatch.setenv("RAYSIM_TEST_KILL_SERVER_AT_ROUND", str(kill_round))
    result = _run(config.replace(runtime__backend="ray"), tmp_path / "ray")
    assert result.summary["server_restarts"] == 1
    _assert_same_state(result, reference)
    assert result.summary["final"] == reference.summary["final"]
    records = _records(tmp_path / "ray")
    assert [r["round"] for r in records] == list(range(1, config.run.rounds + 1))  # no repeats
    assert records[kill_round - 1]["server_restarts"] == 1
    assert records[kill_round - 1]["replayed_rounds"] == replayed
    assert result.summary["bytes_up"] == reference.summary["bytes_up"]  # replays not counted


@pytest.mark.ray
def test_stragglers_past_the_round_deadline_are_cancelled_and_dropped(ray_session, tmp_path):
    """A 120 s straggler never holds up a round with a 10 s deadline: its task is cancelled 10 s
    after it started training and its client dropped as late; the other clients (whose tasks
    are timed from their own start, not from the dispatch) all make it."""
    config = _digits(
        "run.rounds=1",
        "clients.local_epochs=1",
        "clients.per_task=1",
        "clients.num_cpus=0.5",  # 4 slots on the test's 2 CPUs: stragglers block none
        "faults.straggler_rate=0.2",
        "faults.straggler_delay_s=120",
        "run.round_deadline_s=10",
        backend="ray",
    )
    plan = FaultPlan.from_config(config)
    stragglers = [int(c) for c in sample_clients(0, 0, 100, 10) if plan.straggles(0, int(c), 0)]
    assert 1 <= len(stragglers) <= 3
    result = _run(config, tmp_path)
    (record,) = _records(tmp_path)
    assert record["clients_late"] == len(stragglers)
    assert record["clients_dropped"] == record["clients_late"]
    assert record["clients_done"] + record["clients_dropped"] == 10
    assert record["wall_s"] < 60  # far below the stragglers' 120 s
    assert result.state.round == 1


@pytest.mark.ray
def test_a_round_deadline_shorter_than_a_worker_restart_still_trains(ray_session, tmp_path):
    """Issue item: `run.round_deadline_s` shorter than a worker restart trained nothing. Late
    tasks were cancelled with force (which ends their worker) and the replacements' start-up
    missed the next deadline too: 0 of 64 updates in 8 rounds of a 1 s deadline. Now each task
    is timed from its own start (after its worker started and fetched the run's bundle), so
    exactly the stragglers are late and every other client's update arrives."""
    config = _digits(
        "run.rounds=2",  # round 2 runs on the workers that replaced round 1's cancelled ones
        "clients.per_task=1",
        "clients.num_cpus=0.5",  # 4 slots on the test's 2 CPUs
        "faults.straggler_rate=0.2",  # 3 stragglers in round 1, 2 in round 2, cut by the deadline
        "faults.straggler_delay_s=30",
        "run.round_deadline_s=1.0",
        backend="ray",
    )
    plan = FaultPlan.from_config(config)
    stragglers = [
        sum(plan.straggles(r, int(c), 0) for c in sample_clients(0, r, 100, 10)) for r in range(2)
    ]
    assert stragglers == [3, 2]
    _run(config, tmp_path)
    records = _records(tmp_path)
    assert [r["round"] for r in records] == [1, 2]
    assert [r["clients_late"] for r in records] == stragglers  # exactly the stragglers were cut
    assert all(r["clients_done"] + r["clients_late"] == 10 for r in records)


@pytest.mark.ray
def test_fedaws_server_and_index_shard_killed_recover_to_identical_parameters(
    ray_session, tmp_path, monkeypatch
):
    """FedAwS with two index shard actors (owned by the server actor). After round 1 one shard's
    process is SIGKILLed: round 2's spreadout step fails, and the driver restarts the server
    (the index is rebuilt from W) and replays round 1 from the initial state (no checkpoint
    yet). In round 3 the server actor itself is killed: rounds 1-2 are replayed. All the while
    clients fail (faults.seed 26: an exception in each round, and in round 3 client 19 fails
    twice, the second time a hard exit, and is dropped, so the reduced update divides by the
    weight that arrived). The result equals the uninterrupted local run with the same faults."""
    import os
    import signal

    import ray._private.state

    from raysim.runtime import ray_backend

    faults = {"client_failure_rate": 0.1, "seed": 26}
    config = config_module.from_dict(
        {**TINY_FEDAWS, "faults": faults, "clients": {**TINY_FEDAWS["clients"], "max_retries": 1}}
    )
    reference = _run(config, tmp_path / "local")
    original = ray_backend.RayBackend.run_round

    def run_round_then_kill_a_shard(self, info, evaluate, next_info=None):
        stats = original(self, info, evaluate, next_info)
        if info.round_index == 0 and not self.restarts:
            shards = [
                actor["Pid"]
                for actor in ray._private.state.actors().values()
                if actor["ActorClassName"].endswith("IndexShard") and actor["State"] == "ALIVE"
            ]
            assert len(shards) == 2
            os.kill(shards[0], signal.SIGKILL)
        return stats

    monkeypatch.setattr(ray_backend.RayBackend, "run_round", run_round_then_kill_a_shard)
    monkeypatch.setenv("RAYSIM_TEST_KILL_SERVER_AT_ROUND", "3")
    result = _run(config.replace(runtime__backend="ray"), tmp_path / "ray")
    assert result.summary["server_restarts"] == 2
    _assert_same_state(result, reference)
    assert result.summary["final"] == reference.summary["final"]
    records = _records(tmp_path / "ray")
    assert [r["round"] for r in records] == [1, 2, 3]
    assert (records[1]["server_restarts"], records[1]["replayed_rounds"]) == (1, 1)
    assert (records[2]["server_restarts"], records[2]["replayed_rounds"]) == (1, 2)
    expected = [(1, 0, 12), (1, 0, 12), (2, 1, 11)]  # failed, dropped, done; as locally
    for run_records in (records, _records(tmp_path / "local")):
        counts = [
            (r["clients_failed"], r["clients_dropped"], r["clients_done"]) for r in run_records
        ]
        assert counts == expected
