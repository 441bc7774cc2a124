"""Resume trusts nothing in the run folder, and a folder never mixes two runs. Each test is
named after the item it holds; all run the local backend in-process (a few seconds each)."""

from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from raysim.assembly import resume, run
from raysim.errors import RaysimError
from raysim.outputs.checkpoints import load_checkpoint

SETTINGS = ("run.rounds=6", "run.checkpoint_every=3", "run.keep_checkpoints=5")


def _run(config, out, tensorboard=False, **options):
    return run(config, out, progress=False, tensorboard=tensorboard, **options)


def _params(result):
    return result.state.arrays["params"].tobytes()


@pytest.fixture(scope="module")
def whole(digits_config, tmp_path_factory):
    """The uninterrupted 6-round run every resumed run must equal."""
    return _run(digits_config(*SETTINGS), tmp_path_factory.mktemp("whole"))


def _stopped_after_round_6_checkpoint(digits_config, out):
    """A run whose round-6 checkpoint is gone (as if stopped before writing it)."""
    _run(digits_config(*SETTINGS), out)
    (out / "checkpoints" / "round_000006.npz").unlink()
    (out / "summary.json").unlink()


@pytest.mark.parametrize(
    "edit",
    ["clients:\n  lr: 0.2\n", "run:\n  seed: 3\n", "partition:\n  num_clients: 50\n"],
    ids=["clients.lr", "run.seed", "partition.num_clients"],
)
def test_resume_refuses_an_edited_config_except_the_round_count(digits_config, tmp_path, edit):
    out = tmp_path / "run"
    _stopped_after_round_6_checkpoint(digits_config, out)
    path = out / "config.yaml"
    import yaml

    raw = yaml.safe_load(path.read_text())
    section, rest = edit.split(":\n  ")
    key, value = rest.strip().split(": ")
    raw[section][key] = yaml.safe_load(value)
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RaysimError, match=rf"{section}\.{key}: .* -> .*; a resume may change only"):
        resume(out, progress=False, tensorboard=False)
    # With no checkpoint left, the fingerprint in config.yaml's header is the witness.
    shutil.rmtree(out / "checkpoints")
    original = (out / "config.yaml").read_text()
    header = [line for line in original.splitlines() if line.startswith("# config_fingerprint")]
    assert not header  # safe_dump above dropped the header: write one back from a clean run
    clean = tmp_path / "clean"
    _run(digits_config(*SETTINGS), clean)
    fingerprint = next(
        line
        for line in (clean / "config.yaml").read_text().splitlines()
        if line.startswith("# config_fingerprint: ")
    )
    path.write_text(fingerprint + "\n" + yaml.safe_dump(raw))
    with pytest.raises(RaysimError, match="was edited after the run started"):
        resume(out, progress=False, tensorboard=False)


def test_resume_extends_a_run_by_the_round_count_alone(digits_config, whole, tmp_path):
    out = tmp_path / "short"
    _run(digits_config("run.rounds=4", "run.checkpoint_every=3", "run.keep_checkpoints=5"), out)
    with pytest.raises(RaysimError, match="a resume may change only run.rounds"):
        resume(out, overrides=["clients.lr=0.2"], progress=False, tensorboard=False)
    extended = resume(out, overrides=["run.rounds=6"], progress=False, tensorboard=False)
    assert extended.state.round == 6
    assert _params(extended) == _params(whole)
    with pytest.raises(RaysimError, match="at round 6 already"):
        resume(out, overrides=["run.rounds=5"], progress=False, tensorboard=False)


def test_a_checkpoint_whose_name_and_round_disagree_is_not_trusted(
    digits_config, whole, tmp_path, capsys
):
    """Round 3's checkpoint renamed as round 6's ended "done: 6 rounds" with round 3's model."""
    out = tmp_path / "run"
    _stopped_after_round_6_checkpoint(digits_config, out)
    checkpoints = out / "checkpoints"
    shutil.copy(checkpoints / "round_000003.npz", checkpoints / "round_000006.npz")
    result = resume(out, progress=False, tensorboard=False)
    assert "holds round 3 but its name says round 6" in capsys.readouterr().err
    assert _params(result) == _params(whole)


def _forge(path, arrays, meta):
    buffer = io.BytesIO()
    meta_bytes = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(buffer, **arrays, __raysim_meta__=meta_bytes)
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("damage", ["nan", "wrong-size", "wrong-dtype", "missing", "extra-nan"])
def test_a_checkpoint_with_nan_wrong_size_or_missing_arrays_falls_back(
    digits_config, whole, tmp_path, capsys, damage
):
    """A valid zip whose arrays are not the run's crashed with a traceback or continued a NaN
    model; now it is reported and the previous checkpoint used."""
    out = tmp_path / "run"
    _stopped_after_round_6_checkpoint(digits_config, out)
    state, meta = load_checkpoint(out / "checkpoints" / "round_000003.npz")
    params = state.arrays["params"].copy()
    arrays = {
        "nan": {"params": np.full_like(params, np.nan)},
        "wrong-size": {"params": params[:-1]},
        "wrong-dtype": {"params": params.astype(np.float64)},
        "missing": {},
        "extra-nan": {"params": params, "momentum": np.full_like(params, np.nan)},
    }[damage]
    _forge(out / "checkpoints" / "round_000006.npz", arrays, {**meta, "round": 6})
    result = resume(out, progress=False, tensorboard=False)
    assert "cannot continue this run" in capsys.readouterr().err
    assert _params(result) == _params(whole)


def test_a_new_run_into_a_folder_holding_another_run_is_refused_unless_overwrite(
    digits_config, tmp_path
):
    """A new run into an earlier run's folder deleted its checkpoints but kept its summary and
    TensorBoard events: stopped early, the folder mixed two runs."""
    out = tmp_path / "run"
    _run(digits_config("run.rounds=2"), out, tensorboard=True)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(RaysimError, match="holds another run .*--resume .*--overwrite"):
        _run(digits_config("run.rounds=1"), out)
    assert sorted(p.name for p in out.iterdir()) == before  # nothing touched
    marker = out / "tensorboard" / "events.from-the-earlier-run"
    marker.write_text("")
    replaced = _run(digits_config("run.rounds=1"), out, overwrite=True)
    assert replaced.summary["rounds"] == 1
    assert not marker.exists()
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    # A folder without a run (here: unrelated files only) is fine, and the files stay.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _run(digits_config("run.rounds=1"), other)
    assert (other / "notes.txt").read_text() == "mine"


def test_after_a_resume_tensorboard_has_each_round_once_and_throughput_is_this_process(
    digits_config, tmp_path
):
    """After a resume TensorBoard held rounds 4-6 twice, and summary.json divided every
    update of the run by the resumed wall time (71-127 million updates/s resuming a finished
    run)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    _run(digits_config(*SETTINGS), out, tensorboard=True)
    (out / "checkpoints" / "round_000006.npz").unlink()
    resumed = resume(out, progress=False)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    steps = [event.step for event in events.Scalars("train_loss")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert 0 < resumed.summary["client_updates_per_s"] < 1e6
    finished = resume(out, progress=False, tensorboard=False)  # nothing left to run
    assert finished.summary["client_updates_per_s"] == 0.0
    assert finished.summary["clients_done"] == 60
