"""SIGTERM is a clean stop, and storage faults are one line.

SIGTERM (the only polite stop of a run started in the background from a non-interactive
shell, where SIGINT is ignored) stops a run after the round in progress, checkpoints that
round, names `raysim run --resume DIR` in one line and exits 143; the resumed run ends exactly
where an uninterrupted one does. Before, Ray's own handler called sys.exit anywhere (aborts
with a stack dump, exit 134) and the rounds since the last checkpoint were lost. An output
folder that cannot be written is one line, found before Ray or the data start. A full disk
while checkpointing and an output folder deleted under a running run (each a 23-87 line
traceback before) are one line each, `raysim: error: storage: PATH: REASON`, exit 1; after the
full disk the run resumes from its intact earlier checkpoint (checkpoints are written to a temp
file and renamed) and ends exactly where an uninterrupted run does."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raysim import cli
from raysim import config as config_module
from raysim.assembly import resume, run

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs" / "fedavg_digits.yaml"
# ~0.1-0.2 s a round here: SIGTERM lands mid-run, whatever the machine's load
SETTINGS = [
    "runtime.backend=local",
    "run.rounds=40",
    "run.checkpoint_every=0",
    "model.hidden=[16]",
    "clients.local_epochs=20",
]


# A short run that checkpoints every 2 rounds, for the storage faults
CHECKPOINTING = [
    "runtime.backend=local",
    "run.rounds=6",
    "run.checkpoint_every=2",
    "model.hidden=[16]",
]
KEYS = ("round", "eval", "train_loss", "clients_done")


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_checkpoints_the_last_finished_round_names_the_resume_and_resumes_identically(
    tmp_path,
):
    out = tmp_path / "stopped"
    args = [sys.executable, "-m", "raysim.cli", "run", str(CONFIG), "--out", str(out)]
    args += [f"--set={setting}" for setting in SETTINGS] + ["--no-progress"]
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    # SIGINT ignored, as in a background job of a non-interactive shell: SIGTERM must still
    # stop it cleanly
    process = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        metrics = out / "metrics.jsonl"
        limit = time.monotonic() + 240
        while time.monotonic() < limit and process.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, stderr[-2000:]
    lines = [line for line in stderr.splitlines() if "SIGTERM" in line]
    assert len(lines) == 1 and f"raysim run --resume {out}" in lines[0], stderr[-2000:]
    assert "Traceback" not in stderr
    stopped_at = len(_records(out))
    assert 2 <= stopped_at < 40
    checkpoints = sorted(
        int(p.stem.removeprefix("round_")) for p in (out / "checkpoints").glob("round_*.npz")
    )
    assert checkpoints[-1] == stopped_at  # the last finished round, not an older one
    assert f"round {stopped_at}" in lines[0]

    resumed = resume(out, progress=False, tensorboard=False)
    config = config_module.load(CONFIG, SETTINGS)
    reference = run(config, tmp_path / "whole", progress=False, tensorboard=False)
    for name, value in reference.state.arrays.items():
        assert resumed.state.arrays[name].tobytes() == value.tobytes(), name
    assert [{k: r.get(k) for k in KEYS} for r in _records(out)] == [
        {k: r.get(k) for k in KEYS} for r in _records(tmp_path / "whole")
    ]


def test_an_unwritable_out_is_one_line_before_ray_starts(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root writes through permission bits: a read-only mount, then
        import raysim.outputs.run_folder

        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system", str(folder))

        monkeypatch.setattr(raysim.outputs.run_folder.tempfile, "mkstemp", read_only)

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for an output folder that cannot be written")

    monkeypatch.setattr("raysim.runtime.ray_backend.connect", no_ray)
    try:
        code = cli.main(["run", str(CONFIG), "--out", str(folder / "out"), "--no-progress"])
    finally:
        folder.chmod(0o755)
    stderr = capsys.readouterr().err
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert "is not writable" in line and str(folder) in line


def _run_checkpointing(out: Path) -> int:
    args = ["run", str(CONFIG), "--out", str(out), "--no-progress"]
    return cli.main(args + [f"--set={setting}" for setting in CHECKPOINTING])


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("raysim: error")]


def test_a_full_disk_while_checkpointing_is_one_line_and_the_run_resumes_identically(
    tmp_path, monkeypatch, capsys
):
    import raysim.outputs.checkpoints as checkpoints

    write = checkpoints.atomic_write_bytes
    failed: list[Path] = []

    def full_at_round_four(path: Path, data: bytes) -> None:
        if path.name == "round_000004.npz":
            # what the kernel says when the temp file's write finds no space
            temporary = path.with_name(f".{path.name}.tmp")
            failed.append(temporary)
            raise OSError(errno.ENOSPC, "No space left on device", str(temporary))
        write(path, data)

    monkeypatch.setattr(checkpoints, "atomic_write_bytes", full_at_round_four)
    out = tmp_path / "full"
    assert _run_checkpointing(out) == 1
    stderr = capsys.readouterr().err
    (line,) = _error_lines(stderr)
    assert line.startswith(f"raysim: error: storage: {failed[0]}: No space left on device")
    assert "newest checkpoint: round 2" in line
    assert f"continue with: raysim run --resume {out}" in line
    assert "Traceback" not in stderr
    # The earlier checkpoint is intact and the records cover at least its rounds.
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["round_000002.npz"]
    assert [r["round"] for r in _records(out)][:2] == [1, 2]

    monkeypatch.setattr(checkpoints, "atomic_write_bytes", write)  # space again
    assert cli.main(["run", "--resume", str(out), "--no-progress"]) == 0
    assert _run_checkpointing(tmp_path / "whole") == 0
    assert [{k: r.get(k) for k in KEYS} for r in _records(out)] == [
        {k: r.get(k) for k in KEYS} for r in _records(tmp_path / "whole")
    ]


def test_an_output_folder_deleted_under_a_running_run_is_one_line_naming_it(
    tmp_path, monkeypatch, capsys
):
    import raysim.outputs as outputs

    write_checkpoint = outputs.write_checkpoint
    out = tmp_path / "deleted"

    def delete_the_folder_first(checkpoint_dir, state, *args, **kwargs):
        if state.round == 4:  # someone removes the run's folder while it trains
            shutil.rmtree(out)
        return write_checkpoint(checkpoint_dir, state, *args, **kwargs)

    monkeypatch.setattr(outputs, "write_checkpoint", delete_the_folder_first)
    assert _run_checkpointing(out) == 1
    stderr = capsys.readouterr().err
    (line,) = _error_lines(stderr)
    assert line.startswith(f"raysim: error: storage: {out}")
    assert "No such file or directory" in line
    assert line.endswith(f"{out} does not exist (any more), so there is nothing to resume from")
    assert "Traceback" not in stderr
    assert not out.exists()  # nothing was recreated behind the user's back


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "")
