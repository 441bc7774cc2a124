"""A storage fault in the middle of a run is one line naming the path, and loses nothing
already written.

A full disk (ENOSPC while a checkpoint is written) and an output folder deleted under a
running run each used to end in a 23-87 line traceback. Now each is one line, `raysim: error:
storage: PATH: REASON`, with the newest intact checkpoint and the resume command where one
exists, exit status 1. After the full disk, the run resumes from the earlier checkpoint and
ends exactly where an uninterrupted run does (checkpoints are written to a temp file and
renamed, so the failed one never replaces a good one)."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from raysim import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs" / "fedavg_digits.yaml"
SETTINGS = [
    "runtime.backend=local",
    "run.rounds=6",
    "run.checkpoint_every=2",
    "model.hidden=[16]",
]
KEYS = ("round", "eval", "train_loss", "clients_done")


def _run(out: Path, *extra: str) -> int:
    args = ["run", str(CONFIG), "--out", str(out), "--no-progress"]
    return cli.main(args + [f"--set={setting}" for setting in SETTINGS] + list(extra))


def _records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line).get(k) for k in KEYS} for line in lines]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("raysim: error")]


@pytest.fixture(autouse=True)
def _no_ray_address(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "")


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
    assert _run(out) == 1
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
    assert _run(tmp_path / "whole") == 0
    assert _records(out) == _records(tmp_path / "whole")


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
    assert _run(out) == 1
    stderr = capsys.readouterr().err
    (line,) = _error_lines(stderr)
    assert line.startswith(f"raysim: error: storage: {out}")
    assert "No such file or directory" in line
    assert line.endswith(f"{out} does not exist (any more), so there is nothing to resume from")
    assert "Traceback" not in stderr
    assert not out.exists()  # nothing was recreated behind the user's back
