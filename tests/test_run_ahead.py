"""Small rounds trained in the Ray server actor run one ahead (RayBackend.run_round): the
actor runs round t+1 while round t's call returns and the driver logs, instead of waiting a
round trip for the driver's next call. Nothing of that may show: every round's record, every
checkpoint and the final state equal the local backend's bit for bit, on evaluated rounds
too; a run stopped after round t (SIGTERM) while round t+1 already ran in the actor
checkpoints round t, and its resume ends where an uninterrupted run does."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from raysim import config as config_module
from raysim import interrupts
from raysim.assembly import resume, run
from raysim.outputs.checkpoints import checkpoint_paths, load_checkpoint
from raysim.runtime.ray_backend import RayBackend

ROUNDS = 6


def _config(backend: str, **run_settings):
    return config_module.from_dict(
        {
            "run": {
                "name": "ahead",
                "rounds": ROUNDS,
                "checkpoint_every": 1,
                "keep_checkpoints": ROUNDS,
                "eval_every": 2,
                **run_settings,
            },
            "data": {"name": "digits"},
            "partition": {"name": "iid", "num_clients": 40},
            "clients": {"per_round": 4, "local_epochs": 1, "batch_size": 16},
            "model": {"name": "mlp", "hidden": [16]},
            "algorithm": {"name": "fedavg"},
            "runtime": {"backend": backend},
        }
    )


def _in_server_and_counted(monkeypatch) -> list[bool]:
    """Every round after the first trains in the server actor; returns the list that records
    each answer of RayBackend._runs_ahead (so a test sees that rounds did run ahead)."""
    monkeypatch.setattr(RayBackend, "_place", lambda self, round_index: round_index >= 1)
    answers: list[bool] = []
    original = RayBackend._runs_ahead

    def counted(self) -> bool:
        answers.append(original(self))
        return answers[-1]

    monkeypatch.setattr(RayBackend, "_runs_ahead", counted)
    return answers


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line).get(k) for k in ("round", "eval", "train_loss")} for line in lines]


def _checkpoints(out: Path) -> dict[int, dict[str, np.ndarray]]:
    states = [load_checkpoint(path)[0] for path in checkpoint_paths(out / "checkpoints")]
    return {state.round: state.arrays for state in states}


def _assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.mark.ray
def test_rounds_run_ahead_in_the_server_actor_equal_the_local_backend(
    ray_session, tmp_path, monkeypatch
):
    answers = _in_server_and_counted(monkeypatch)
    on_ray = run(_config("ray"), tmp_path / "ray", progress=False, tensorboard=False)
    local = run(_config("local"), tmp_path / "local", progress=False, tensorboard=False)
    assert answers.count(True) >= ROUNDS - 2  # rounds 2.. were queued ahead
    assert on_ray.summary["placement"]["clients_in_server_actor"] == (ROUNDS - 1) * 4
    records = _records(tmp_path / "ray")
    assert records == _records(tmp_path / "local")
    assert [bool(r["eval"]) for r in records] == [r % 2 == 0 for r in range(1, ROUNDS + 1)]
    on_ray_checkpoints = _checkpoints(tmp_path / "ray")
    local_checkpoints = _checkpoints(tmp_path / "local")
    assert sorted(on_ray_checkpoints) == list(range(1, ROUNDS + 1))
    for round_done, arrays in local_checkpoints.items():
        _assert_same_arrays(on_ray_checkpoints[round_done], arrays)
    _assert_same_arrays(on_ray.state.arrays, local.state.arrays)


@pytest.mark.ray
def test_a_stop_while_a_round_ran_ahead_checkpoints_the_round_before_and_resumes_identically(
    ray_session, tmp_path, monkeypatch
):
    answers = _in_server_and_counted(monkeypatch)
    asked: list[bool] = []

    def stop_after_round_three() -> bool:  # the loop asks once a round, after logging it
        asked.append(True)
        return len(asked) == 3

    monkeypatch.setattr(interrupts, "stop_requested", stop_after_round_three)
    stopped = tmp_path / "stopped"
    with pytest.raises(interrupts.Terminated):
        run(_config("ray", checkpoint_every=0), stopped, progress=False, tensorboard=False)
    assert answers[-1] is True  # round 4 was queued ahead when the run stopped after round 3
    (checkpoint,) = checkpoint_paths(stopped / "checkpoints")
    state, _ = load_checkpoint(checkpoint)
    assert state.round == 3
    monkeypatch.setattr(interrupts, "stop_requested", lambda: False)
    whole = run(
        _config("local", checkpoint_every=0), tmp_path / "whole", progress=False, tensorboard=False
    )
    _assert_same_arrays(state.arrays, _checkpoints_of_round(tmp_path, 3))
    resumed = resume(stopped, progress=False, tensorboard=False)
    assert resumed.state.round == ROUNDS
    _assert_same_arrays(resumed.state.arrays, whole.state.arrays)


def _checkpoints_of_round(tmp_path: Path, round_done: int) -> dict[str, np.ndarray]:
    """Round `round_done`'s state of an uninterrupted local run (checkpointed every round)."""
    out = tmp_path / f"local_to_{round_done}"
    run(_config("local", rounds=round_done), out, progress=False, tensorboard=False)
    return _checkpoints(out)[round_done]


def _in_blocks_of(monkeypatch, size: int) -> list[int]:
    """Every round after the first trains in the server actor, and rounds run ahead in blocks
    of `size` (or up to the run's end); returns the sizes of the blocks queued."""
    monkeypatch.setattr(RayBackend, "_place", lambda self, round_index: round_index >= 1)
    monkeypatch.setattr(RayBackend, "_block_size", lambda self, first: size)
    sizes: list[int] = []
    original = RayBackend._queue_block

    def counted(self, first):
        block = original(self, first)
        sizes.append(len(block.infos))
        return block

    monkeypatch.setattr(RayBackend, "_queue_block", counted)
    return sizes


LONGER = {"rounds": 11, "keep_checkpoints": 11, "eval_every": 3}


@pytest.mark.ray
def test_rounds_run_ahead_in_blocks_equal_the_local_backend(ray_session, tmp_path, monkeypatch):
    """Blocks of four rounds a call, evaluations inside them (every third round) and a
    checkpoint every round (the rounds' states kept in the actor until the driver takes them):
    every record, checkpoint and the final state as on the local backend."""
    sizes = _in_blocks_of(monkeypatch, 4)
    # where each block was queued: while the driver asked for a checkpoint's state or not
    queued_for_checkpoint: list[bool] = []
    in_get_state = [False]
    get_state, queue_block = RayBackend.get_state, RayBackend._queue_block

    def asking(self):
        in_get_state[0] = True
        queued_before = len(queued_for_checkpoint)
        try:
            return get_state(self)
        finally:
            in_get_state[0] = False
            if len(queued_for_checkpoint) > queued_before:  # it ran while the driver wrote:
                assert self._blocks[-1].timed is False  # not a measure of its rounds' time

    def queued(self, first):
        block = queue_block(self, first)
        queued_for_checkpoint.append(in_get_state[0])
        return block

    monkeypatch.setattr(RayBackend, "get_state", asking)
    monkeypatch.setattr(RayBackend, "_queue_block", queued)
    on_ray = run(_config("ray", **LONGER), tmp_path / "ray", progress=False, tensorboard=False)
    local = run(_config("local", **LONGER), tmp_path / "local", progress=False, tensorboard=False)
    assert sizes == [4, 4, 2]  # rounds 2-5, 6-9 and 10-11 (1-based) ahead
    # the second and third behind the checkpoints' state calls of rounds 1 and 2 (the actor
    # trains while the driver writes), never more than two blocks unfetched
    assert queued_for_checkpoint == [False, True, True]
    assert on_ray.summary["placement"]["clients_in_server_actor"] == 10 * 4
    records = _records(tmp_path / "ray")
    assert records == _records(tmp_path / "local")
    assert [bool(r["eval"]) for r in records] == [r % 3 == 0 or r == 11 for r in range(1, 12)]
    lines = (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()
    calls = [json.loads(line).get("rounds_in_call", 1) for line in lines]
    assert calls == [1] + [4] * 8 + [2] * 2  # each block's rounds came back in one call
    on_ray_checkpoints = _checkpoints(tmp_path / "ray")
    assert sorted(on_ray_checkpoints) == list(range(1, 12))
    for round_done, arrays in _checkpoints(tmp_path / "local").items():
        _assert_same_arrays(on_ray_checkpoints[round_done], arrays)
    _assert_same_arrays(on_ray.state.arrays, local.state.arrays)


@pytest.mark.ray
def test_blocks_follow_a_simulated_time_schedule_as_the_local_backend(
    ray_session, tmp_path, monkeypatch
):
    """With `devices:` (online clients drawn by the simulated clock, over-selection) a block's
    rounds come from the run's schedule: the same clients, simulated records and state."""
    sizes = _in_blocks_of(monkeypatch, 4)
    devices = {
        "profiles": "sampled",
        "compute_sigma": 0.5,
        "online_fraction": 0.8,
        "over_selection": 0.5,
    }

    def config(backend: str):
        raw = _config(backend, **LONGER).to_dict()
        return config_module.from_dict({**raw, "devices": devices})

    on_ray = run(config("ray"), tmp_path / "ray", progress=False, tensorboard=False)
    local = run(config("local"), tmp_path / "local", progress=False, tensorboard=False)
    assert sizes == [4, 4, 2]
    lines = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        for name in ("ray", "local")
    }
    assert all(r["sim"] for r in lines["ray"]) and on_ray.summary["sim"]
    for key in ("round", "sim", "clients", "eval", "train_loss"):
        assert [r.get(key) for r in lines["ray"]] == [r.get(key) for r in lines["local"]], key
    assert on_ray.summary["sim"] == local.summary["sim"]
    _assert_same_arrays(on_ray.state.arrays, local.state.arrays)


@pytest.mark.ray
def test_a_stop_in_the_middle_of_a_block_checkpoints_its_round_and_resumes_identically(
    ray_session, tmp_path, monkeypatch
):
    """Stopped (SIGTERM) after round 5 while the actor has run the blocks up to round 9:
    the checkpoint is round 5's state (a copy the actor kept), and the resume ends where an
    uninterrupted run does."""
    sizes = _in_blocks_of(monkeypatch, 4)
    asked: list[bool] = []

    def stop_after_round_five() -> bool:
        asked.append(True)
        return len(asked) == 5

    monkeypatch.setattr(interrupts, "stop_requested", stop_after_round_five)
    stopped = tmp_path / "stopped"
    settings = {**LONGER, "checkpoint_every": 0}
    with pytest.raises(interrupts.Terminated):
        run(_config("ray", **settings), stopped, progress=False, tensorboard=False)
    # rounds 2-5 and 6-9 (1-based) were queued when it stopped, 10-11 behind the stop's state
    # call (a checkpoint's: the actor trains them for nothing while the driver writes)
    assert sizes == [4, 4, 2]
    (checkpoint,) = checkpoint_paths(stopped / "checkpoints")
    state, _ = load_checkpoint(checkpoint)
    assert state.round == 5
    monkeypatch.setattr(interrupts, "stop_requested", lambda: False)
    out = tmp_path / "local_to_5"
    run(_config("local", **{**settings, "rounds": 5}), out, progress=False, tensorboard=False)
    _assert_same_arrays(
        state.arrays, load_checkpoint(checkpoint_paths(out / "checkpoints")[-1])[0].arrays
    )
    whole = run(_config("local", **settings), tmp_path / "whole", progress=False, tensorboard=False)
    resumed = resume(stopped, progress=False, tensorboard=False)
    assert resumed.state.round == 11
    _assert_same_arrays(resumed.state.arrays, whole.state.arrays)


def test_a_blocks_rounds_share_its_wait_in_the_round_times():
    """The driver waits for a block at its first round, so metrics.jsonl's times give that
    round the block's time and the others almost none; the run's median round and the
    benchmarks share it over the block's rounds, and blocks back to back as one
    (`round_seconds`)."""
    from raysim.core.run_record import RunTally, round_seconds, spread_over_calls
    from raysim.core.state import RoundStats

    assert spread_over_calls([0.8, 0.0, 0.0, 0.0, 0.3], [4, 4, 4, 4, 1]) == [0.2] * 4 + [0.3]
    assert spread_over_calls([0.6, 0.0], [4, 4]) == [0.3, 0.3]  # a block cut short (a stop)
    # blocks back to back share as one: the second, queued behind a checkpoint, was done
    # before the driver asked for it, so its own wait (0.04) says nothing of its rounds
    waits = [0.68, 0.0, 0.0, 0.0, 0.04, 0.0, 0.0, 0.0, 0.3]
    assert np.allclose(spread_over_calls(waits, [4] * 8 + [1]), [0.09] * 8 + [0.3])
    elapsed = [1.0, 1.3, 1.31, 1.32, 1.42]
    records = [
        {"elapsed_s": e, **({"rounds_in_call": 3} if 1 <= i <= 3 else {})}
        for i, e in enumerate(elapsed)
    ]
    assert np.allclose(round_seconds(records), [1.0, 0.32 / 3, 0.32 / 3, 0.32 / 3, 0.1])
    tally = RunTally(None)
    for wall, call in [(0.01, 1), (0.04, 4), (0.0001, 4), (0.0001, 4), (0.0001, 4), (0.011, 1)]:
        tally.add({"round": 1, "wall_s": wall}, RoundStats(rounds_in_call=call))
    summary = tally.summary(rounds=6, resumed_from=None, wall_s=1.0, server_restarts=0)
    assert summary["median_round_s"] == pytest.approx(0.0403 / 4)  # not the block's 0.0001


def test_the_warm_up_pays_the_batching_check_ahead_and_never_raises(ray_session):
    """The server actor runs warm_up_training on a thread at its start (small rounds may move
    into it): afterwards the clients' model has its batching probe's answer cached, so the first
    round trained there does not pay the process's first vmapped call. A bundle it cannot use
    raises nothing there (the round that trains reports the problem)."""
    import ray

    from raysim.assembly import plan_run
    from raysim.core import batched_training
    from raysim.core.server import build_algorithm
    from raysim.data.datasets import load_dataset
    from raysim.models.devices import client_device
    from raysim.models.vector import cached_model
    from raysim.runtime import ray_tasks

    raw = {**_config("ray").to_dict()}
    raw["clients"] = {**raw["clients"], "batched": True}
    config = config_module.from_dict(raw)
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    bundle = ray_tasks.put_run_bundle(
        plan.ctx, build_algorithm(plan.ctx), ray.put(dataset.train_x), dataset, plan.split
    )
    ctx = ray_tasks.run_bundle(bundle)[0]
    model = cached_model(ctx, client_device(ctx))
    batched_training._PROBLEMS.pop(model, None)  # (an earlier test may have probed it)
    ray_tasks.warm_up_training(bundle)
    assert batched_training._PROBLEMS.get(model, False) is None  # probed: no problem

    ray_tasks.warm_up_training(ray.put("not a run bundle"))  # the check: nothing is raised
