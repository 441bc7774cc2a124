"""Parquet split cache: exact round trip, metadata, atomic writes, corrupted files."""

from __future__ import annotations

import re

import numpy as np
import pytest

from raysim.data.partition import ClientSplit, dirichlet_split
from raysim.data.store import load_split, save_split, split_cache_key
from raysim.errors import DataError


@pytest.fixture
def split() -> ClientSplit:
    labels = np.random.default_rng(0).integers(0, 10, size=5000)
    return dirichlet_split(labels, 40, seed=1, alpha=0.3)


def test_round_trip_is_exact_and_keeps_metadata(tmp_path, split):
    path = tmp_path / "cache" / "split.parquet"
    metadata = {"dataset": "synthetic", "num_clients": 40, "alpha": 0.3, "nested": {"a": [1, 2]}}
    save_split(path, split, metadata)
    loaded, loaded_metadata = load_split(path)
    assert loaded.indices.dtype == np.int64 and loaded.offsets.dtype == np.int64
    np.testing.assert_array_equal(loaded.indices, split.indices)
    np.testing.assert_array_equal(loaded.offsets, split.offsets)
    assert loaded_metadata == metadata
    assert [p.name for p in path.parent.iterdir()] == ["split.parquet"]  # no temp file left


def test_save_replaces_an_existing_file(tmp_path, split):
    path = tmp_path / "split.parquet"
    save_split(path, split, {"version": 1})
    smaller = ClientSplit(np.array([2, 0, 1], dtype=np.int64), np.array([0, 1, 3], dtype=np.int64))
    save_split(str(path), smaller, {"version": 2})
    loaded, metadata = load_split(str(path))
    np.testing.assert_array_equal(loaded.indices, [2, 0, 1])
    assert loaded.num_clients == 2 and metadata == {"version": 2}


def test_truncated_or_foreign_file_is_a_data_error(tmp_path, split):
    path = tmp_path / "split.parquet"
    save_split(path, split, {})
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])
    with pytest.raises(DataError, match=rf"{re.escape(str(path))} is unreadable"):
        load_split(path)
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=re.escape(str(path))):
        load_split(path)
    with pytest.raises(DataError, match="not found"):
        load_split(tmp_path / "missing.parquet")


def test_parquet_without_split_format_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "other.parquet"
    pq.write_table(pa.table({"indices": [1, 2, 3]}), path)
    with pytest.raises(DataError, match="not a raysim split cache file"):
        load_split(path)


def test_cache_key_is_canonical():
    key = split_cache_key(dataset="digits", seed=0, partition={"name": "iid", "num_clients": 10})
    assert re.fullmatch(r"[0-9a-f]{16}", key)
    same = split_cache_key(
        partition={"num_clients": 10, "name": "iid"}, seed=np.int64(0), dataset="digits"
    )
    assert key == same
    assert key != split_cache_key(
        dataset="digits", seed=1, partition={"name": "iid", "num_clients": 10}
    )
