"""The shipped stateful example (examples/plugins/scaffold.py: SCAFFOLD, written from scratch,
each client's control variate in the client-state store), run as a researcher would: from a
copy of the folder outside the repository, on the Ray backend and on the local one, with equal
results, and a Ray run resumed on the local backend continuing bit for bit (the store's control
variates come back from the checkpoint). One Ray start; 2-3 rounds of 10 small clients."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import raysim_cli

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.ray

# no dashboard: not this test's subject
SMALL = ["--set", "partition.num_clients=20", "--set", "clients.per_round=5",
         "--set", "run.checkpoint_every=1", "--no-progress",
         "--set", "runtime.dashboard=false"]  # fmt: skip


def _raysim(folder: Path, *args: str) -> str:
    result = raysim_cli(["run", *args], cwd=folder, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_scaffold_from_a_copy_runs_on_ray_and_local_equal_and_resumes(tmp_path):
    folder = tmp_path / "my_methods"  # outside the repository: imported from its own folder
    shutil.copytree(REPO_ROOT / "examples" / "plugins", folder)
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    _raysim(folder, "scaffold.yaml", "--out", str(local), "--set", "run.rounds=3",
            "--set", "runtime.backend=local", *SMALL)  # fmt: skip
    output = _raysim(folder, "scaffold.yaml", "--out", str(on_ray), "--set", "run.rounds=2",
                     "--set", "runtime.backend=ray", "--set", "runtime.num_cpus=2",
                     *SMALL)  # fmt: skip
    assert "sending plug-in code to the workers: " in output
    assert "Ray dashboard:" not in output  # runtime.dashboard=false: Ray started without it
    # Ray's two rounds are the local run's first two, bit for bit (accuracy, losses)
    ray_rounds, local_rounds = _records(on_ray), _records(local)
    assert len(ray_rounds) == 2 and len(local_rounds) == 3
    for on_ray_round, local_round in zip(ray_rounds, local_rounds[:2], strict=True):
        assert on_ray_round["eval"] == local_round["eval"]
        assert on_ray_round["train_loss"] == local_round["train_loss"]
    # the Ray run, continued on the local backend (its own plug-in: --trust-plugins): its
    # third round is the local run's
    resumed = _raysim(folder, "--resume", str(on_ray), "--set", "run.rounds=3",
                      "--set", "runtime.backend=local", "--trust-plugins",
                      "--no-progress")  # fmt: skip
    assert "from its checkpoint of round 2: the next round is 3" in resumed
    final = json.loads((on_ray / "summary.json").read_text())["final"]
    assert final == json.loads((local / "summary.json").read_text())["final"]
