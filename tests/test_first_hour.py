"""The first hour of a new user: version and plug-in discovery, switching a shipped config to
another model or algorithm with --set, one-line errors for the mistakes people make, Ctrl-C that
says how to continue, run records, and progress output fit for a log file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS = str(REPO_ROOT / "configs" / "fedavg_digits.yaml")
FRL = str(REPO_ROOT / "configs" / "frl_digits.yaml")
FLAG = str(REPO_ROOT / "configs" / "flag_flag.yaml")
LOCAL = ["--set", "runtime.backend=local"]


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    """Exit status 2 and exactly one line on stderr starting 'raysim: error: ' (no traceback)."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("raysim: error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    return errors[0]


def test_version_and_info_with_options_and_defaults(run_cli):
    from raysim import __version__

    version = run_cli(["--version"])
    assert version.returncode == 0 and version.stdout.strip() == f"raysim {__version__}"
    info = run_cli(["info", "algorithm", "fedaws"])
    assert info.returncode == 0, info.stderr
    options = {line.split()[0]: line for line in info.stdout.splitlines()[2:]}
    assert "default 10" in options["k"] and "default 10.0" in options["lambda"]
    assert "default 'topk'" in options["spreadout"]
    listing = run_cli(["info", "index"])
    assert {"exact", "faiss_ivf", "hnsw"} <= {
        line.split()[0] for line in listing.stdout.splitlines()
    }
    assert all(len(line.split()) > 1 for line in listing.stdout.splitlines())  # described
    bad = _one_line_error(run_cli(["info", "algoritm"]))
    assert "did you mean 'algorithm'" in bad


def test_set_switches_a_shipped_config_to_another_model(run_cli, tmp_path):
    result = run_cli(
        ["run", DIGITS, *LOCAL, "--out", str(tmp_path / "lenet"), "--no-progress",
         "--set", "model.name=lenet", "--set", "data.name=synthetic_classification",
         "--set", "data.num_samples=400", "--set", "data.num_test=100",
         "--set", "data.sample_shape=[1,12,12]", "--set", "partition.num_clients=10",
         "--set", "clients.per_round=2", "--set", "run.rounds=1"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "model.name=lenet takes no model.hidden; dropped" in result.stderr
    assert "done: 1 rounds" in result.stdout


def test_set_switches_frl_to_fedavg_and_a_section_can_be_replaced(run_cli, tmp_path):
    result = run_cli(
        ["run", FRL, *LOCAL, "--out", str(tmp_path / "fedavg"), "--no-progress",
         "--set", "algorithm.name=fedavg", "--set", "run.rounds=1"]
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "algorithm.name=fedavg takes no algorithm.k" in result.stderr
    summary = json.loads((tmp_path / "fedavg" / "summary.json").read_text())
    assert summary["rounds"] == 1
    replaced = run_cli(
        ["run", DIGITS, *LOCAL, "--out", str(tmp_path / "replaced"), "--no-progress",
         "--set", "model={name: mlp, hidden: [8]}", "--unset", "aggregator.name",
         "--set", "run.rounds=1"]
    )  # fmt: skip
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    saved = (tmp_path / "replaced" / "config.yaml").read_text()
    assert "hidden:\n  - 8" in saved or "hidden: [8]" in saved


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--set", "clients.lrr=0.1"], "--set clients.lrr=0.1: unknown key 'clients.lrr'"),
        (["--unset", "model.depth"], "--unset model.depth: the config does not set"),
        (["--set", "model=lenet"], "--set model=lenet: a whole section is replaced by a mapping"),
    ],
)
def test_override_mistakes_name_the_override(run_cli, tmp_path, arguments, expected):
    line = _one_line_error(run_cli(["run", DIGITS, *LOCAL, "--out", str(tmp_path), *arguments]))
    assert expected in line and DIGITS not in line


def test_a_single_label_algorithm_on_multi_label_data_is_one_line(run_cli, tmp_path):
    line = _one_line_error(
        run_cli(["run", FLAG, *LOCAL, "--out", str(tmp_path), "--set", "algorithm.name=fedavg"])
    )
    assert "algorithm 'fedavg' trains on single-label data" in line
    line = _one_line_error(
        run_cli(["run", DIGITS, *LOCAL, "--out", str(tmp_path), "--set", "algorithm.name=flag"])
    )
    assert "algorithm 'flag' needs multi-hot labels" in line


def test_out_pointing_at_a_file_is_one_line(run_cli, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    line = _one_line_error(run_cli(["run", DIGITS, *LOCAL, "--out", str(blocker)]))
    assert f"{blocker} is a file" in line
    line = _one_line_error(run_cli(["run", DIGITS, *LOCAL, "--out", str(blocker / "run")]))
    assert f"{blocker} is a file" in line
    assert blocker.read_text() == "not a folder"  # nothing already written is lost


def test_partition_of_a_multi_label_config(run_cli):
    result = run_cli(["partition", FLAG, "--rows", "3"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "clients" in result.stdout


def test_runs_record_what_produced_them_and_log_readable_progress(tmp_path):
    """stdout/stderr to a file (as under `ray job submit`): progress comes as whole lines."""
    log = tmp_path / "log.txt"
    with open(log, "w") as handle:
        code = subprocess.call(
            [sys.executable, "-m", "raysim.cli", "run", DIGITS, *LOCAL, "--out",
             str(tmp_path / "run"), "--set", "run.rounds=3"],
            stdout=handle, stderr=subprocess.STDOUT, env=dict(os.environ, RAY_ADDRESS=""),
        )  # fmt: skip
    text = log.read_text()
    assert code == 0, text[-2000:]
    assert "\r" not in text
    assert "raysim: round 3/3 accuracy=" in text  # the last round always has its line
    assert "clients in this process)" in text  # where the round's clients trained
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    environment = summary["environment"]
    for key in ("raysim", "python", "torch", "ray", "numpy", "cpus", "gpus", "started_at"):
        assert environment[key] is not None, key
    assert "git_commit" in environment
    header = (tmp_path / "run" / "config.yaml").read_text().splitlines()[:9]
    assert any(line.startswith("# torch: ") for line in header)


def test_ctrl_c_names_the_newest_checkpoint_and_the_resume_command(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "run", DIGITS, *LOCAL, "--out", str(out),
         "--no-progress", "--set", "run.rounds=100000", "--set", "run.checkpoint_every=1",
         "--set", "run.eval_every=1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, RAY_ADDRESS="", PYTHONFAULTHANDLER="1"),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("round_*.npz")) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    try:
        _, stderr = process.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # show where it hangs (faulthandler's dump on SIGABRT)
        process.send_signal(signal.SIGABRT)
        _, stderr = process.communicate(timeout=60)
        pytest.fail(f"the run did not stop within 120 s of Ctrl-C:\n{stderr[-6000:]}")
    assert process.returncode == 130, stderr[-2000:]
    line = [x for x in stderr.splitlines() if x.startswith("raysim: interrupted")][-1]
    newest = max(int(p.stem.removeprefix("round_")) for p in (out / "checkpoints").glob("*.npz"))
    assert f"newest checkpoint: round {newest}" in line
    assert f"continue with: raysim run --resume {out}" in line


def test_hnsw_without_hnswlib_names_the_extra(monkeypatch):
    from raysim.errors import ConfigError
    from raysim.index import build_index

    monkeypatch.setitem(sys.modules, "hnswlib", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"pip install 'raysim\[hnsw\]'"):
        build_index("hnsw", 100, 8).reset(__import__("numpy").zeros((100, 8), "float32"))


@pytest.mark.parametrize("address", ["127.0.0.1:9", "ray://127.0.0.1:9", "10.255.255.1:6379"])
def test_an_unreachable_cluster_address_fails_fast_in_one_line(run_cli, tmp_path, address):
    started = time.monotonic()
    line = _one_line_error(run_cli(["run", DIGITS, "--out", str(tmp_path), "--address", address]))
    assert time.monotonic() - started < 30
    assert f"cannot reach a Ray cluster at '{address}'" in line and "ray start --head" in line


@pytest.mark.ray
def test_a_client_task_larger_than_any_node_is_refused(ray_session, digits_config, tmp_path):
    """Refused when the backend starts, before any data moves (the CLI prints a RaysimError as
    its one `raysim: error:` line: test_errors.py). The test session's Ray has 2 CPUs."""
    from raysim import RaysimError
    from raysim.assembly import run

    config = digits_config("clients.num_cpus=64", backend="ray")
    with pytest.raises(RaysimError) as refused:
        run(config, tmp_path / "run", progress=False, tensorboard=False)
    line = str(refused.value)
    assert "clients.num_cpus=64 but the largest node of the Ray cluster has 2 CPUs" in line
    assert "\n" not in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
