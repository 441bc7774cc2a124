"""Parquet cache of client splits (the only module that imports pyarrow).

Partitioning a large dataset over a million clients takes seconds to minutes; caching the CSR
arrays under a key derived from everything that determines them lets repeated runs (and every
node of a cluster, from shared storage) reuse the same split. The file is one row with two
int64 list columns, `indices` and `offsets`, and the caller's metadata as JSON in the schema
metadata. Writes are atomic, so a crashed run never leaves a half-written cache entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raysim.data.split import ClientSplit
from raysim.errors import DataError

_FORMAT_KEY = b"raysim.format"
_FORMAT = b"client_split/1"
_METADATA_KEY = b"raysim.metadata"


def _json_default(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, set | frozenset):
        return sorted(value)
    raise TypeError(f"cannot use {type(value).__name__} {value!r} in a split cache key/metadata")


def split_cache_key(**parts: Any) -> str:
    """16 hex chars of sha256 over a canonical JSON of `parts` (dataset, partition, seed, ...)."""
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]


def _list_column(values: np.ndarray) -> pa.Array:
    flat = pa.array(np.ascontiguousarray(values, dtype=np.int64), type=pa.int64())
    return pa.LargeListArray.from_arrays(pa.array([0, len(values)], type=pa.int64()), flat)


def save_split(path: str | os.PathLike, split: ClientSplit, metadata: dict) -> None:
    """Write `split` and `metadata` (JSON-able) to `path` atomically (temp file + os.replace)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    schema_metadata = {
        _FORMAT_KEY: _FORMAT,
        _METADATA_KEY: json.dumps(metadata, sort_keys=True, default=_json_default).encode(),
    }
    table = pa.table(
        {"indices": _list_column(split.indices), "offsets": _list_column(split.offsets)}
    ).replace_schema_metadata(schema_metadata)
    handle, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory
    )
    os.close(handle)
    try:
        pq.write_table(table, temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def load_split(path: str | os.PathLike) -> tuple[ClientSplit, dict]:
    """Read a split written by `save_split`; a missing, truncated or foreign file is a DataError."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"split cache file not found: {path}")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(
            f"split cache file {path} is unreadable (truncated or corrupted? delete "
            f"it to recompute the split): {error}"
        ) from None
    schema_metadata = table.schema.metadata or {}
    if (
        schema_metadata.get(_FORMAT_KEY) != _FORMAT
        or table.num_rows != 1
        or {"indices", "offsets"} - set(table.column_names)
    ):
        raise DataError(
            f"{path} is not a raysim split cache file (format "
            f"{_FORMAT.decode()}); delete it to recompute the split"
        )
    try:
        metadata = json.loads(schema_metadata.get(_METADATA_KEY, b"{}"))
        indices, offsets = (
            table.column(name)
            .combine_chunks()
            .flatten()
            .to_numpy(zero_copy_only=False)
            .astype(np.int64, copy=False)
            for name in ("indices", "offsets")
        )
        split = ClientSplit(indices=indices, offsets=offsets)
    except (ValueError, TypeError, pa.ArrowException) as error:
        raise DataError(
            f"split cache file {path} is corrupted (delete it to recompute the split): {error}"
        ) from None
    return split, metadata
