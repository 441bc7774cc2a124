"""Ray backend: same config and seed => the same global model as the local backend, bit for bit,
whatever the task packing or the number of CPUs.

In-process tests share the session's Ray (`ray_session`, 2 CPUs); `run()` reuses it and leaves
it running. The CLI test starts its own Ray, with 1 CPU.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from raysim.assembly import run
from raysim.outputs.checkpoints import load_checkpoint

pytestmark = pytest.mark.ray

ROUNDS = 3


@pytest.fixture(scope="module")
def local_reference(digits_config, tmp_path_factory):
    """The local backend's 3-round run: what every Ray run must reproduce exactly."""
    return run(
        digits_config(f"run.rounds={ROUNDS}"),
        tmp_path_factory.mktemp("local"),
        progress=False,
        tensorboard=False,
    )


def _assert_same_run(result, reference) -> None:
    assert result.state.round == reference.state.round == ROUNDS
    assert set(result.state.arrays) == set(reference.state.arrays)
    for name, value in reference.state.arrays.items():
        assert result.state.arrays[name].tobytes() == value.tobytes(), name


def test_a_cli_run_with_one_cpu_matches_local(
    run_cli, digits_config_path, tmp_path, local_reference
):
    """The CLI starts its own Ray with `runtime.num_cpus=1` and the default settings otherwise
    (its dashboard on; the in-process tests below use the session's 2 CPUs); its final
    checkpoint equals local's."""
    out = tmp_path / "cpus1"
    result = run_cli(
        [
            "run",
            digits_config_path,
            "--out",
            out,
            "--set",
            "runtime.backend=ray",
            "--set",
            f"run.rounds={ROUNDS}",
            "--set",
            "runtime.num_cpus=1",
        ]
    )  # progress on: plain lines, since there is no terminal
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"\b1 CPUs\b", result.stdout), result.stdout  # Ray got the 1 CPU asked for
    # the default runtime.dashboard: the Ray raysim starts has its dashboard, on loopback
    assert "Ray dashboard: http://127.0.0.1:" in result.stdout, result.stdout
    assert f"done: {ROUNDS} rounds" in result.stdout
    # the last round's progress line says where its clients trained
    last = rf"raysim: round {ROUNDS}/{ROUNDS} .*clients in "
    assert re.search(last + r"(\d+ tasks on 1 node|the server actor)\)", result.stderr), (
        result.stderr[-3000:]
    )
    state, meta = load_checkpoint(out / "checkpoints" / f"round_{ROUNDS:06d}.npz")
    assert meta["round"] == ROUNDS
    assert state.arrays["params"].tobytes() == local_reference.state.arrays["params"].tobytes()


def test_ray_run_matches_local_bit_for_bit(ray_session, digits_config, tmp_path, local_reference):
    result = run(
        digits_config(f"run.rounds={ROUNDS}", backend="ray"),
        tmp_path,
        progress=False,
        tensorboard=False,
    )
    assert ray_session.is_initialized()  # run() reuses the session's Ray and leaves it running
    assert result.summary["backend"] == "ray"
    _assert_same_run(result, local_reference)
    for key in ("bytes_up", "bytes_down", "clients_done", "clients_failed"):
        assert result.summary[key] == local_reference.summary[key], key
    assert result.summary["bytes_down"] == ROUNDS * 10 * 4 * 9610
    # client losses are computed by the same deterministic clients and reduced in id order
    assert result.summary["final"]["train_loss"] == local_reference.summary["final"]["train_loss"]
    assert result.summary["final"]["accuracy"] > 0.3
    state, _ = load_checkpoint(tmp_path / "checkpoints" / f"round_{ROUNDS:06d}.npz")
    assert state.arrays["params"].tobytes() == local_reference.state.arrays["params"].tobytes()


@pytest.mark.parametrize("per_task", [1, 3, "auto"])
def test_task_packing_does_not_change_the_result(
    ray_session, digits_config, tmp_path, local_reference, per_task
):
    result = run(
        digits_config(f"run.rounds={ROUNDS}", f"clients.per_task={per_task}", backend="ray"),
        tmp_path,
        progress=False,
        tensorboard=False,
    )
    _assert_same_run(result, local_reference)


def test_ray_server_optimizer_state_matches_local(ray_session, digits_config, tmp_path):
    """Server-optimizer slots live in the server actor; they too must match local exactly."""
    overrides = (
        f"run.rounds={ROUNDS}",
        "server.optimizer=adam",
        "server.lr=0.03",
        "clients.per_task=2",
    )
    local = run(digits_config(*overrides), tmp_path / "local", progress=False, tensorboard=False)
    remote = run(
        digits_config(*overrides, backend="ray"),
        tmp_path / "ray",
        progress=False,
        tensorboard=False,
    )
    assert set(remote.state.arrays) == {
        "params",
        "optimizer.first_moment",
        "optimizer.second_moment",
    }
    for name, value in local.state.arrays.items():
        assert remote.state.arrays[name].tobytes() == value.tobytes(), name
    assert not np.array_equal(remote.state.arrays["optimizer.first_moment"], 0)


def test_small_rounds_train_in_the_server_actor_with_the_same_result(
    ray_session, digits_config, tmp_path, monkeypatch
):
    """With automatic packing, rounds that train faster in the server actor than in tasks (as
    measured) train there (the next round's on a thread while the driver logs): records say
    `tasks: 0`, and the model equals the local backend's bit for bit, checkpoints in the
    middle included."""
    from raysim.runtime.ray_backend import RayBackend

    # from round 3 on the server actor, whatever the timing on the test machine says
    monkeypatch.setattr(RayBackend, "_place", lambda self, round_index: round_index >= 2)
    rounds = ["run.rounds=9", "run.checkpoint_every=4"]
    local = run(digits_config(*rounds), tmp_path / "local", progress=False, tensorboard=False)
    ray_run = run(
        digits_config(*rounds, backend="ray"), tmp_path / "ray", progress=False, tensorboard=False
    )
    records = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").open()]
    assert records[0]["tasks"] > 0  # measured in tasks first
    assert [r["tasks"] > 0 for r in records] == [True] * 2 + [False] * 7
    assert ray_run.state.arrays["params"].tobytes() == local.state.arrays["params"].tobytes()
    for round_number in (4, 8):
        name = f"round_{round_number:06d}.npz"
        ours, _ = load_checkpoint(tmp_path / "ray" / "checkpoints" / name)
        theirs, _ = load_checkpoint(tmp_path / "local" / "checkpoints" / name)
        assert ours.arrays["params"].tobytes() == theirs.arrays["params"].tobytes(), round_number
