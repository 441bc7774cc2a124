"""Stopping a run (the driver SIGKILLed) and `raysim run --resume DIR` ends exactly where an
uninterrupted run ends; a truncated checkpoint is detected and the previous one used."""

from __future__ import annotations

import json
import os
import signal

from conftest import raysim_cli

from raysim.assembly import run
from raysim.outputs.checkpoints import load_checkpoint

ROUNDS = 6
OVERRIDES = [
    "--set",
    "runtime.backend=local",
    "--set",
    f"run.rounds={ROUNDS}",
    "--set",
    "run.checkpoint_every=2",
    "--set",
    "run.keep_checkpoints=5",
    "--set",
    "server.optimizer=adam",
    "--set",
    "server.lr=0.03",  # optimizer slots resume too
]


def _cli(args, kill_after=None):
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    if kill_after:
        env["RAYSIM_TEST_KILL_AFTER_ROUND"] = str(kill_after)
    return raysim_cli(args, env=env, timeout=300)


def _uninterrupted(digits_config, tmp_path):
    overrides = [OVERRIDES[i + 1] for i in range(0, len(OVERRIDES), 2)]
    return run(digits_config(*overrides), tmp_path / "whole", progress=False, tensorboard=False)


def _rounds_logged(out):
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_killed_run_resumes_to_identical_parameters(digits_config_path, digits_config, tmp_path):
    reference = _uninterrupted(digits_config, tmp_path)
    out = tmp_path / "stopped"
    killed = _cli(
        ["run", digits_config_path, "--out", out, "--no-progress", *OVERRIDES], kill_after=3
    )
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (out / "checkpoints").glob("*.npz")) == ["round_000002.npz"]
    resumed = _cli(["run", "--resume", out, "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    state, _ = load_checkpoint(out / "checkpoints" / f"round_{ROUNDS:06d}.npz")
    for name, value in reference.state.arrays.items():
        assert state.arrays[name].tobytes() == value.tobytes(), name
    assert _rounds_logged(out) == list(range(1, ROUNDS + 1))  # round 3 recomputed, not doubled
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_round"] == 2
    assert summary["bytes_up"] == reference.summary["bytes_up"]  # totals include rounds 1-2
    assert summary["final"]["accuracy"] == reference.summary["final"]["accuracy"]


def test_truncated_checkpoint_falls_back_to_the_previous_one(
    digits_config_path, digits_config, tmp_path
):
    reference = _uninterrupted(digits_config, tmp_path)
    out = tmp_path / "stopped"
    killed = _cli(
        ["run", digits_config_path, "--out", out, "--no-progress", *OVERRIDES], kill_after=5
    )
    assert killed.returncode == -signal.SIGKILL
    newest = out / "checkpoints" / "round_000004.npz"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # cut in half
    resumed = _cli(["run", "--resume", out, "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipping checkpoint" in resumed.stderr and "round_000004.npz" in resumed.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from_round"] == 2
    state, _ = load_checkpoint(out / "checkpoints" / f"round_{ROUNDS:06d}.npz")
    assert state.arrays["params"].tobytes() == reference.state.arrays["params"].tobytes()
    assert _rounds_logged(out) == list(range(1, ROUNDS + 1))


def test_resume_refuses_extra_arguments_and_empty_folders(digits_config_path, tmp_path):
    both = _cli(["run", digits_config_path, "--resume", tmp_path])
    assert both.returncode == 2 and "give no CONFIG" in both.stderr
    empty = _cli(["run", "--resume", tmp_path])  # no run in it at all
    assert empty.returncode == 2
    assert "it holds no run (no config.yaml)" in empty.stderr and "Traceback" not in empty.stderr


def test_a_run_killed_before_its_first_checkpoint_resumes_from_round_0(
    digits_config_path, digits_config, tmp_path
):
    # checkpoint_every: 0 writes only the last round's checkpoint: a kill before it used to
    # lose the whole run ("no readable checkpoint"), though round 0 is a function of the seed
    reference = _uninterrupted(digits_config, tmp_path)
    out = tmp_path / "stopped"
    overrides = [*OVERRIDES, "--set", "run.checkpoint_every=0"]
    killed = _cli(["run", digits_config_path, "--out", out, "--no-progress", *overrides], 3)
    assert killed.returncode == -signal.SIGKILL
    assert not list((out / "checkpoints").glob("*.npz"))
    resumed = _cli(["run", "--resume", out, "--no-progress"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "starting again from round 0" in resumed.stderr
    state, _ = load_checkpoint(out / "checkpoints" / f"round_{ROUNDS:06d}.npz")
    assert state.arrays["params"].tobytes() == reference.state.arrays["params"].tobytes()
    assert _rounds_logged(out) == list(range(1, ROUNDS + 1))
