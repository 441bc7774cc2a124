"""Lost capacity is a decision, not a hang: when no live node of the cluster can run a client
task for LOST_CAPACITY_S (a head with 0 CPUs whose last worker node died), the round stops,
the last finished round is checkpointed and one line names the missing resource and the
resume. Before, the run waited forever, silently (149 s and counting in the attack)."""

from __future__ import annotations

from pathlib import Path

import pytest

from raysim import config as config_module
from raysim.assembly import resume, run
from raysim.core.faults import LOST_CAPACITY_S, CapacityLost, CapacityWatch
from raysim.errors import RaysimError
from raysim.runtime.local import LocalBackend

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAD_ONLY = [{"Alive": True, "Resources": {"memory": 1e9}}]  # a head started with 0 CPUs
DEAD_WORKER = {"Alive": False, "Resources": {"CPU": 8.0}}


def test_no_node_with_cpus_for_the_bounded_time_stops_naming_the_resource():
    watch = CapacityWatch(cpus=1.0, gpus=0.0)
    watch.check([*HEAD_ONLY, DEAD_WORKER], now=0.0)
    watch.check([*HEAD_ONLY, DEAD_WORKER], now=LOST_CAPACITY_S - 1)  # still waiting
    with pytest.raises(CapacityLost, match="needs 1 CPU") as error:
        watch.check([*HEAD_ONLY, DEAD_WORKER], now=LOST_CAPACITY_S)
    assert "\n" not in str(error.value) and f"{LOST_CAPACITY_S:g} s" in str(error.value)
    # a node that can run a task again starts the count over
    watch = CapacityWatch(cpus=1.0, gpus=0.0)
    watch.check(HEAD_ONLY, now=0.0)
    watch.check([*HEAD_ONLY, {"Alive": True, "Resources": {"CPU": 2.0}}], now=LOST_CAPACITY_S)
    watch.check(HEAD_ONLY, now=LOST_CAPACITY_S + 1)  # (a new count)


def test_a_run_that_lost_its_capacity_checkpoints_the_last_finished_round_and_resumes(
    tmp_path, monkeypatch
):
    config = config_module.load(
        REPO_ROOT / "configs" / "fedavg_digits.yaml",
        ["runtime.backend=local", "run.rounds=4", "run.checkpoint_every=0", "model.hidden=[16]"],
    )
    original = LocalBackend.run_round

    def losing(self, info, *args, **kwargs):
        if info.round_index == 2:
            raise CapacityLost("no live node of the Ray cluster can run a client task (test)")
        return original(self, info, *args, **kwargs)

    monkeypatch.setattr(LocalBackend, "run_round", losing)
    with pytest.raises(RaysimError) as error:
        run(config, tmp_path, progress=False, tensorboard=False)
    line = str(error.value)
    assert "\n" not in line and "checkpoint of round 2 written" in line
    assert f"raysim run --resume {tmp_path}" in line
    assert (tmp_path / "checkpoints" / "round_000002.npz").is_file()
    monkeypatch.setattr(LocalBackend, "run_round", original)
    resumed = resume(tmp_path, progress=False, tensorboard=False)
    reference = run(config, tmp_path / "whole", progress=False, tensorboard=False)
    for name, value in reference.state.arrays.items():
        assert resumed.state.arrays[name].tobytes() == value.tobytes(), name
