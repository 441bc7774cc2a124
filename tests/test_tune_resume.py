"""`raysim tune` stops and resumes: SIGTERM (or Ctrl-C) after the first trial leaves that
trial's results (tune_results.csv) and the best config so far (best_config.yaml) written, and
`raysim tune --resume OUT` continues with Tune's restore, reusing the finished trial. Before, a
TypeError in tune._rows lost everything, and running again recomputed every trial."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]

SWEEP = {
    "run": {"name": "tiny_sweep", "seed": 0, "rounds": 2, "checkpoint_every": 0},
    "data": {"name": "digits", "validation_fraction": 0.1},
    "partition": {"name": "dirichlet", "num_clients": 20, "alpha": 0.5},
    "clients": {"per_round": 4, "local_epochs": 1, "batch_size": 16, "lr": 0.05},
    "model": {"name": "mlp", "hidden": [16]},
    "algorithm": {"name": "fedavg"},
    # trials train in their own process; no dashboard (not this test's subject)
    "runtime": {"backend": "local", "num_cpus": 2, "dashboard": False},
    "tune": {
        "metric": "val/accuracy",
        "mode": "max",
        "num_samples": 1,
        "scheduler": "fifo",
        "max_concurrent_trials": 1,
        "client_slots": 1,
        "space": {"clients.lr": {"grid": [0.02, 0.1]}},
    },
}


def _raysim(*args: str, **kwargs) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def _rows(out: Path) -> list[dict]:
    with open(out / "tune_results.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def test_a_sweep_stopped_after_one_trial_writes_its_results_and_resumes_reusing_it(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(SWEEP, sort_keys=False))
    out = tmp_path / "sweep_out"
    process = _raysim("tune", str(path), "--out", str(out))
    try:
        for line in process.stdout:  # one line per finished trial (tune._trial_lines)
            if " completed: " in line:
                break
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr[-3000:]
    assert f"continue with: raysim tune --resume {out}" in stderr
    assert "Traceback" not in stderr, stderr[-3000:]
    first = [row for row in _rows(out) if row["status"] == "completed"]
    assert len(first) >= 1
    assert (out / "best_config.yaml").is_file()
    finished = {row["trial"]: Path(row["out"]) / "summary.json" for row in first}
    written = {trial: summary.stat().st_mtime_ns for trial, summary in finished.items()}

    process = _raysim("tune", "--resume", str(out))
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stdout[-2000:] + stderr[-3000:]
    rows = _rows(out)
    assert sorted(float(row["clients.lr"]) for row in rows) == [0.02, 0.1]
    assert all(row["status"] == "completed" for row in rows), rows
    for trial, summary in finished.items():  # reused, not trained again
        assert summary.stat().st_mtime_ns == written[trial], trial
    assert (out / "best_config.yaml").is_file()
