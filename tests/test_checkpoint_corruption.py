"""A damaged newest checkpoint is detected and the previous one is used (in-process).

tests/test_resume.py covers the CLI (`raysim run --resume`) with a checkpoint cut in half; this
covers the other ways a file goes bad: cut by a byte, empty, a flipped byte (the zip's CRC),
no metadata, unreadable metadata. None may escape as anything but a skipped checkpoint.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from raysim.assembly.resume import find_resume_point
from raysim.core.state import ServerState
from raysim.outputs import RunOutputs


def _replace_meta(path, meta: bytes) -> None:
    with np.load(path, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files}
    arrays["__raysim_meta__"] = np.frombuffer(meta, dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())


def _flip_middle_byte(path) -> None:
    content = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:  # a byte inside the stored params, not the headers
        info = archive.getinfo("params.npy")
    position = info.header_offset + 30 + len(info.filename) + info.compress_size // 2
    content[position] ^= 0xFF
    path.write_bytes(bytes(content))


DAMAGE = {
    "cut in half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "cut by one byte": lambda p: p.write_bytes(p.read_bytes()[:-1]),
    "empty": lambda p: p.write_bytes(b""),
    "flipped byte": _flip_middle_byte,
    "no metadata": lambda p: p.write_bytes(_npz({"params": np.zeros(3, np.float32)})),
    "metadata not json": lambda p: _replace_meta(p, b"{round: 4"),
    "metadata without round": lambda p: _replace_meta(p, b'{"epoch": 4}'),
}


def _npz(arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back(digits_config, tmp_path, capsys, damage):
    outputs = RunOutputs(tmp_path, digits_config("run.keep_checkpoints=5"), tensorboard=False)
    states = {
        r: ServerState(r, {"params": np.full(8, r, dtype=np.float32), "ranking.0": np.arange(r)})
        for r in (2, 4)
    }
    try:
        for round_index, state in states.items():
            outputs.log_round({"round": round_index - 1})
            outputs.log_round({"round": round_index})
            outputs.save_checkpoint(state)
    finally:
        outputs.close()
    DAMAGE[damage](tmp_path / "checkpoints" / "round_000004.npz")

    state, history = find_resume_point(tmp_path)

    assert state.round == 2
    assert np.array_equal(state.arrays["params"], states[2].arrays["params"])
    assert np.array_equal(state.arrays["ranking.0"], states[2].arrays["ranking.0"])
    assert [record["round"] for record in history] == [1, 2]
    stderr = capsys.readouterr().err
    assert "skipping checkpoint" in stderr and "round_000004.npz" in stderr
