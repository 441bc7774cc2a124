"""Regression tests for "nothing lost": each is named after the item it holds."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from raysim.assembly.resume import newest_usable_checkpoint
from raysim.core.state import ServerState
from raysim.errors import RaysimError
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
    state = newest_usable_checkpoint(tmp_path)  # (no metrics.jsonl written here)
    assert state.round == 1_000_001 and state.arrays["params"][0] == 1_000_001


# --- hostile idx files (MNIST): header checked before the data is read --------------------------


def _peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_mnist_idx_is_checked_before_it_is_read_whole(tmp_path):
    import gzip
    import struct

    import pytest

    from raysim.data.idx import _read_idx
    from raysim.errors import DataError

    # a 1 MB .gz of zeros whose header promises far more than deflate could hold
    lying = tmp_path / "lying-idx3-ubyte.gz"
    header = bytes([0, 0, 0x08, 3]) + struct.pack(">III", 60_000, 1000, 1000)
    with gzip.open(lying, "wb") as handle:
        handle.write(header + bytes(1 << 20))
    before = _peak_rss_bytes()
    with pytest.raises(DataError, match=r"idx header says shape \(60000, 1000, 1000\)"):
        _read_idx(str(lying), 3)
    assert _peak_rss_bytes() - before < 200 << 20  # it never decompressed the lot
    # a 40 GB sparse file claiming its size: refused by the header check, not a MemoryError
    sparse = tmp_path / "sparse-idx3-ubyte"
    with open(sparse, "wb") as handle:
        handle.write(bytes([0, 0, 0x08, 3]) + struct.pack(">III", 4, 4, 4))
        handle.truncate(40 << 30)
    with pytest.raises(DataError, match=r"idx header says shape \(4, 4, 4\)"):
        _read_idx(str(sparse), 3)
    # a FIFO (it would block a reader forever)
    fifo = tmp_path / "fifo-idx3-ubyte"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="is not a regular file"):
        _read_idx(str(fifo), 3)


# --- a YAML alias bomb in a config ---------------------------------------------------------------


def test_a_yaml_alias_bomb_config_is_one_line_fast(tmp_path):
    import time

    import pytest

    from raysim import config
    from raysim.errors import ConfigError

    # one list whose items define anchors that repeat the one before, nine times each: its
    # last item stands for 9 ** 9 = 387 million strings; the option check of a plug-in
    # (fedprox's mu) formatted the value it refused: 33 s, 4.9 GB and a 2.3 GB message
    levels = ["&a [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 9):
        previous, name = chr(ord("a") + level - 1), chr(ord("a") + level)
        levels.append(f"&{name} [{', '.join(['*' + previous] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"algorithm:\n  name: fedprox\n  mu: [{', '.join(levels)}]\n")
    assert bomb.stat().st_size < 1000
    started, before = time.perf_counter(), _peak_rss_bytes()
    with pytest.raises(ConfigError) as caught:
        config.load(bomb)
    message = str(caught.value)
    assert message.startswith(f"{bomb}: the YAML expands to more than 100,000 values")
    assert "\n" not in message and len(message) < 300
    assert time.perf_counter() - started < 10
    assert _peak_rss_bytes() - before < 200 << 20
    # an alias that contains itself is refused the same way (no endless walk)
    loop = tmp_path / "loop.yaml"
    loop.write_text("run:\n  rounds: 3\ndata:\n  name: &x [*x]\n")
    with pytest.raises(ConfigError, match="expands to more than"):
        config.load(loop)


def test_a_run_that_trains_nothing_for_several_rounds_stops_and_says_why(digits_config, tmp_path):
    """Issue item: a run whose every client is dropped (or late, or rejected) round after
    round ended with exit 0 and the initial model. After `run.max_idle_rounds` such rounds in
    a row it now stops with a RaysimError (exit status 2 from the CLI) naming the rounds and the
    cause; the rounds it ran stay in metrics.jsonl."""
    from raysim.assembly import run

    failing = ("run.rounds=8", "faults.client_failure_rate=1.0", "clients.max_retries=0")
    with pytest.raises(RaysimError, match=r"rounds 1-5 left the model unchanged .*50 dropped"):
        run(digits_config(*failing), tmp_path / "stopped", progress=False, tensorboard=False)
    lines = (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["model_kept"] for line in lines] == [True] * 5
    # 0 turns the stop off: the run ends, having kept the model every round.
    result = run(
        digits_config(*failing, "run.max_idle_rounds=0"),
        tmp_path / "kept",
        progress=False,
        tensorboard=False,
    )
    assert result.state.round == 8
