"""Records a resume can trust (raysim.outputs.resume_records).

A resume keeps the metrics records of the rounds up to its checkpoint: they must all be there,
once, whole, in order. A file cut in the middle or holding a round twice is refused in one line
naming the file and the round; a torn last line after the checkpoint's rounds is cut off with a
line, and the resumed run's records equal an uninterrupted run's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS = REPO_ROOT / "configs" / "fedavg_digits.yaml"
SMALL = [
    "runtime.backend=local",
    "run.rounds=4",
    "run.checkpoint_every=2",
    "partition.num_clients=8",
    "clients.per_round=4",
    "clients.local_epochs=1",
    "model.hidden=[16]",
]
SAME = ("round", "eval", "train_loss", "update_norm_mean", "bytes_up", "clients_done")


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """An uninterrupted 4-round run (checkpoints after rounds 2 and 4)."""
    import raysim

    out = tmp_path_factory.mktemp("records") / "whole"
    raysim.run(DIGITS, out=out, overrides=SMALL, progress=False, tensorboard=False)
    return out


def _lines(out: Path) -> list[str]:
    return (out / "metrics.jsonl").read_text().splitlines(keepends=True)


def _stopped_after_round_2(finished: Path, tmp_path: Path, metrics: list[str]) -> Path:
    """The run as if stopped during round 4: checkpoint of round 2 newest, `metrics` kept."""
    out = tmp_path / "stopped"
    shutil.copytree(finished, out)
    (out / "checkpoints" / "round_000004.npz").unlink()
    (out / "summary.json").unlink()
    (out / "metrics.jsonl").write_text("".join(metrics))
    return out


def _resume_line(out: Path, capsys) -> str:
    from raysim.cli import main

    assert main(["run", "--resume", str(out), "--no-progress"]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line, line
    return line


def test_metrics_cut_before_the_checkpoint_round_are_refused_not_silently_shortened(
    finished, tmp_path, capsys
):
    lines = _lines(finished)
    out = _stopped_after_round_2(finished, tmp_path, lines[:1])  # cut after round 1
    before = (out / "metrics.jsonl").read_text()
    line = _resume_line(out, capsys)
    assert line.startswith(f"raysim: error: cannot resume: {out / 'metrics.jsonl'} ends after")
    assert "it lacks round 2" in line and "checkpoint of round 2" in line
    assert (out / "metrics.jsonl").read_text() == before  # nothing rewritten
    # a record missing in the middle (round 1 gone, round 2 present)
    out = _stopped_after_round_2(finished, tmp_path / "b", lines[1:3])
    assert "lacks round 1 (line 1 holds round 2)" in _resume_line(out, capsys)
    # a line torn before the checkpoint's round
    out = _stopped_after_round_2(finished, tmp_path / "c", [lines[0], lines[1][:20] + "\n"])
    assert "line 2 is not a whole record (round 2 expected)" in _resume_line(out, capsys)


def test_a_round_recorded_twice_is_refused(finished, tmp_path, capsys):
    lines = _lines(finished)
    out = _stopped_after_round_2(finished, tmp_path, [lines[0], lines[1], lines[1], lines[2]])
    assert "line 3 holds round 2 a second time" in _resume_line(out, capsys)


def test_a_torn_last_line_after_the_checkpoint_is_cut_off_and_the_run_ends_as_uninterrupted(
    finished, tmp_path, capsys
):
    import raysim

    lines = _lines(finished)
    torn = lines[3][: len(lines[3]) // 2]  # round 4's record, half written, no newline
    out = _stopped_after_round_2(finished, tmp_path, [*lines[:3], torn])
    raysim.resume(out, progress=False, tensorboard=False)
    err = capsys.readouterr().err
    assert f"raysim: {out / 'metrics.jsonl'} line 4, after the records of rounds 1-2" in err
    resumed = [json.loads(line) for line in _lines(out)]
    whole = [json.loads(line) for line in lines]
    assert [{k: r.get(k) for k in SAME} for r in resumed] == [
        {k: r.get(k) for k in SAME} for r in whole
    ]
