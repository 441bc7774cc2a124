"""A researcher's own partitioner: one file outside the repo, registered by name, used by a run."""

from __future__ import annotations

import sys
import textwrap

import numpy as np
import pytest

from raysim import config, registry
from raysim.assembly import plan_run, run
from raysim.assembly.plan import partition_for_run
from raysim.data.datasets import load_dataset
from raysim.errors import ConfigError

PLUGIN = '''
"""Every client gets a contiguous block of `block` training rows (the rest belong to no one)."""

import numpy as np

from raysim.data.partition import ClientSplit, PartitionResult
from raysim.errors import ConfigError

CALLS = []


def blocks(dataset, num_clients, seed, *, block: int = 10):
    CALLS.append((dataset.name, num_clients, seed, block))
    if block < 1 or block * num_clients > len(dataset.train_y):
        raise ConfigError(
            f"'partition.block' must be in [1, {len(dataset.train_y) // num_clients}], got {block}"
        )
    rows = block * num_clients
    return ClientSplit(
        np.arange(rows, dtype=np.int64), np.arange(0, rows + 1, block, dtype=np.int64)
    )


def blocks_with_validation(dataset, num_clients, seed, *, block: int = 10):
    """The same, plus client c's validation rows: test rows c, c + num_clients, ..."""
    owner = np.arange(len(dataset.test_y)) % num_clients
    order = np.argsort(owner, kind="stable").astype(np.int64)
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum(np.bincount(owner, minlength=num_clients), out=offsets[1:])
    train = blocks(dataset, num_clients, seed, block=block)
    return PartitionResult(train, ClientSplit(order, offsets))
'''

SMALL = [
    "runtime.backend=local",
    "partition.num_clients=10",
    "clients.per_round=3",
    "clients.local_epochs=1",
    "run.rounds=2",
    "run.checkpoint_every=0",
    "model.hidden=[16]",
]


@pytest.fixture
def blockpart(tmp_path, monkeypatch):
    """blockpart.py in tmp_path (outside the repo) on sys.path, registered as 'blocks' and
    'blocks_val'; unregistered and unimported afterwards."""
    (tmp_path / "blockpart.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.partitioners.register("blocks", "blockpart:blocks")
    registry.partitioners.register("blocks_val", "blockpart:blocks_with_validation")
    try:
        import blockpart

        yield blockpart
    finally:
        for name in ("blocks", "blocks_val"):  # the registry has no unregister (tests only)
            registry.partitioners.unregister(name)
        sys.modules.pop("blockpart", None)


def _config(digits_config_path, *overrides):
    return config.load(digits_config_path, [*SMALL, *overrides])


def test_a_run_uses_a_partitioner_from_the_researchers_own_file(
    blockpart, digits_config_path, tmp_path
):
    # fedavg_digits.yaml sets dirichlet's alpha: replacing the partitioner drops it
    cfg = _config(digits_config_path, "partition.name=blocks", "partition.block=12")
    assert cfg.partition.name == "blocks" and dict(cfg.partition.options) == {"block": 12}
    result = run(cfg, tmp_path / "out", progress=False, tensorboard=False)
    assert result.summary["num_clients"] == 10 and result.summary["rounds"] == 2
    assert result.summary["clients_done"] == 2 * 3
    assert blockpart.CALLS and all(call[1::2] == (10, 12) for call in blockpart.CALLS)
    split = plan_run(cfg, load_dataset(cfg)).split
    np.testing.assert_array_equal(split.sizes, np.full(10, 12))
    np.testing.assert_array_equal(split.indices, np.arange(120))


def test_plugin_options_are_checked_when_the_config_is_read(blockpart, digits_config_path):
    with pytest.raises(ConfigError) as caught:
        _config(digits_config_path, "partition.name=blocks", "partition.blok=3")
    message = str(caught.value)
    assert message == (
        "--set partition.blok=3: "
        "unknown option 'partition.blok' for partitioner 'blocks' (did you mean 'block'?); "
        "valid options: block"
    )
    expected = r"^--set partition\.block=big: 'partition\.block' expects int, got 'big'$"
    with pytest.raises(ConfigError, match=expected):
        _config(digits_config_path, "partition.name=blocks", "partition.block=big")
    # an explicitly set option of the old partitioner is not dropped: it is refused
    with pytest.raises(ConfigError, match=r"unknown option 'partition\.alpha'.*valid options"):
        _config(digits_config_path, "partition.name=blocks", "partition.alpha=0.3")


def test_a_plugins_own_value_check_is_one_config_error(blockpart, digits_config_path):
    cfg = _config(digits_config_path, "partition.name=blocks", "partition.block=1000")
    with pytest.raises(ConfigError, match=r"^'partition\.block' must be in \[1, \d+\], got 1000$"):
        plan_run(cfg, load_dataset(cfg))


def test_a_plugins_validation_split_reaches_the_run_context(blockpart, digits_config_path):
    cfg = _config(digits_config_path, "partition.name=blocks_val", "partition.block=5")
    dataset = load_dataset(cfg)
    plan = plan_run(cfg, dataset)
    validation = plan.ctx.client_validation
    assert validation is not None and validation.num_clients == 10
    np.testing.assert_array_equal(
        validation.client_indices(1), np.arange(1, len(dataset.test_y), 10)
    )
    assert len(blockpart.CALLS) == 1  # the plan partitions once for the split and the context
    np.testing.assert_array_equal(plan.split.sizes, np.full(10, 5))


def test_split_cache_keeps_validation_and_changes_with_an_option(
    blockpart, digits_config_path, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    base = ("partition.name=blocks_val", f"partition.cache_dir={cache}")
    dataset = load_dataset(_config(digits_config_path, *base))
    first = partition_for_run(_config(digits_config_path, *base, "partition.block=5"), dataset)
    assert len(list(cache.glob("split_*.parquet"))) == 2  # training + validation
    calls = len(blockpart.CALLS)
    again = partition_for_run(_config(digits_config_path, *base, "partition.block=5"), dataset)
    assert len(blockpart.CALLS) == calls  # read from the cache
    for a, b in ((first.train, again.train), (first.validation, again.validation)):
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.offsets, b.offsets)
    partition_for_run(_config(digits_config_path, *base, "partition.block=6"), dataset)
    assert len(blockpart.CALLS) == calls + 1 and len(list(cache.glob("split_*.parquet"))) == 4


def test_builtin_partitioners_refuse_label_shapes_they_cannot_split(digits_config_path):
    cfg = _config(digits_config_path, "partition.name=kmodes")
    with pytest.raises(
        ConfigError, match=r"^partition 'kmodes' clusters multi-hot .*single-label$"
    ):
        plan_run(cfg, load_dataset(cfg))
    cfg = _config(digits_config_path, "partition.name=natural")
    with pytest.raises(ConfigError, match=r"^partition 'natural': dataset 'digits' has no natural"):
        plan_run(cfg, load_dataset(cfg))
