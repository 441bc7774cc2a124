"""One run at a time owns an output folder (raysim.outputs.lock_out_dir).

A second `raysim run` (or a resume) into the folder of a run in progress is refused in one line
naming the holder, and the first run finishes intact; `--overwrite` is never implied; a lock
whose holder is gone is taken over with a line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS = REPO_ROOT / "configs" / "fedavg_digits.yaml"
ROUNDS = 12
# Every client a straggler of 50 ms: 4 clients a round make each round >= 0.2 s, so the run
# lasts seconds whatever the machine.
SLOW = [
    "runtime.backend=local",
    f"run.rounds={ROUNDS}",
    "partition.num_clients=8",
    "clients.per_round=4",
    "clients.local_epochs=1",
    "model.hidden=[16]",
    "faults.straggler_rate=1.0",
    "faults.straggler_delay_s=0.05",
]


def _sets(overrides: list[str]) -> list[str]:
    return [part for override in overrides for part in ("--set", override)]


def test_a_second_run_into_a_folder_in_use_is_refused_and_the_first_finishes_intact(
    tmp_path, capsys
):
    from raysim.cli import main

    out = tmp_path / "out"
    code = "import sys; from raysim.cli import main; sys.exit(main(sys.argv[1:]))"
    first = subprocess.Popen(
        [sys.executable, "-c", code, "run", str(DIGITS), "--out", str(out), "--no-progress",
         *_sets(SLOW)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        # the lock is taken before the data loads; config.yaml is written once it has loaded
        while not (out / "config.yaml").exists() and first.poll() is None:
            assert time.monotonic() < deadline, "the first run never started"
            time.sleep(0.05)
        assert first.poll() is None, first.communicate()
        holder = json.loads((out / ".raysim.lock").read_text())
        assert holder["pid"] == first.pid
        second = ["run", str(DIGITS), "--out", str(out), "--no-progress", *_sets(SLOW)]
        attempts = {
            "run": second,
            "run --overwrite": [*second, "--overwrite"],
            "resume": ["run", "--resume", str(out), "--no-progress"],
        }
        for what, args in attempts.items():
            assert main(args) == 2, what
            err = capsys.readouterr().err.strip()
            assert "\n" not in err, (what, err)
            assert f"is in use by another run (pid {first.pid} on " in err, (what, err)
            assert "deleting" not in err
        assert first.poll() is None, "the first run ended before the second was refused"
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert f"done: {ROUNDS} rounds" in stdout and "deleting" not in stdout + stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == ROUNDS
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    assert not (out / ".raysim.lock").exists()  # released at the end


def test_new_outputs_never_delete_an_earlier_run_without_overwrite(tmp_path, digits_config):
    from raysim.errors import RaysimError
    from raysim.outputs import RunOutputs

    (tmp_path / "metrics.jsonl").write_text('{"round": 1}\n')
    with pytest.raises(RaysimError, match="holds another run"):
        RunOutputs(tmp_path, digits_config(), tensorboard=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"round": 1}\n'
    outputs = RunOutputs(tmp_path, digits_config(), tensorboard=False, overwrite=True)
    outputs.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_stale_lock_is_taken_over_with_a_line(tmp_path, capsys):
    from raysim.outputs.run_folder import LOCK_NAME, lock_out_dir

    out = tmp_path / "out"
    out.mkdir()
    dead = {"pid": 999_999_999, "host": "elsewhere", "started_at": "2020-01-01T00:00:00+00:00"}
    (out / LOCK_NAME).write_text(json.dumps(dead))  # written by a run that was killed
    with lock_out_dir(out) as lock:
        line = capsys.readouterr().err.strip()
        assert line.startswith("raysim: taking over the lock of") and "pid 999999999" in line
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        with pytest.raises(Exception, match="is in use by another run"):
            lock_out_dir(out)  # held: refused, even from the same process
    assert not (out / LOCK_NAME).exists()
    with lock_out_dir(out):
        assert capsys.readouterr().err == ""  # a released lock is not stale


def test_a_run_refused_before_writing_leaves_no_folder(tmp_path):
    import raysim

    out = tmp_path / "never"
    with pytest.raises(raysim.RaysimError):
        raysim.run(DIGITS, out=out, overrides=["runtime.backend=local", "data.root=/nonexistent",
                                               "data.name=mnist"], progress=False)  # fmt: skip
    assert not out.exists()
