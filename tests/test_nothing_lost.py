"""Regression tests for "nothing lost": each is named after the item it holds."""

from __future__ import annotations

import numpy as np

from raysim.core.loop import find_resume_point
from raysim.core.state import ServerState
from raysim.outputs import RunOutputs


def test_checkpoint_pruning_and_resume_sort_rounds_numerically(digits_config, tmp_path):
    # past round 999,999 the names grow a digit: a string sort would call round 1,000,000
    # older than 999,999, prune the newest checkpoints and resume from an old one
    outputs = RunOutputs(
        tmp_path, digits_config("run.keep_checkpoints=2"), tensorboard=False, history=[]
    )
    try:
        for round_index in (999_998, 999_999, 1_000_000, 1_000_001):
            params = np.full(3, round_index, dtype=np.float32)
            outputs.save_checkpoint(ServerState(round_index, {"params": params}))
    finally:
        outputs.close()
    kept = sorted(path.name for path in (tmp_path / "checkpoints").glob("*.npz"))
    assert kept == ["round_1000000.npz", "round_1000001.npz"]
    state, _ = find_resume_point(tmp_path)
    assert state.round == 1_000_001 and state.arrays["params"][0] == 1_000_001
