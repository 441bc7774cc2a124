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
        # Plain encoding (no dictionary): what the file holds then decodes to at most ~21x its
        # size (snappy's limit), which lets load_split refuse a file that would decode to more.
        pq.write_table(table, temporary, use_dictionary=False)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


# A split cache file holds 8 bytes per client and per sample; one larger than this is refused.
SPLIT_MAX_BYTES = 16 << 30
# What a file save_split writes decodes to, at most, in bytes per byte of file (plain int64
# values compressed by snappy: ~21x at most), plus 1 MiB for tiny files. A file that declares
# more values is not one it wrote: refused before Arrow allocates them (a parquet bomb: 1 KB of
# run-length-encoded zeros can decode to GBs).
_SPLIT_DECODE_RATIO = 32
_SPLIT_DECODE_SLACK = 1 << 20
_SPLIT_COLUMN_TYPE = pa.large_list(pa.int64())


def _refuse(path: str, problem: str) -> DataError:
    return DataError(
        f"split cache file {path} {problem}; delete it to recompute the split (was it written "
        f"for another dataset, or altered?)"
    )


def load_split(
    path: str | os.PathLike, *, num_clients: int | None = None, num_rows: int | None = None
) -> tuple[ClientSplit, dict]:
    """Read a split written by `save_split`; a missing, truncated or foreign file is a DataError.

    With `num_clients` and `num_rows` (the dataset's rows the split indexes), the split is also
    checked against them: that many clients, every row id in [0, num_rows). A cache file is
    input like any other (a shared folder, an old run, a hand edit): a negative id would
    silently index from the end and train clients on other samples."""
    from raysim.data.files import open_regular_file

    path = os.fspath(path)
    handle, size = open_regular_file(
        path, "split cache file", SPLIT_MAX_BYTES, missing=f"split cache file not found: {path}"
    )
    with handle:
        try:
            parquet = pq.ParquetFile(handle)
            schema = parquet.schema_arrow
            schema_metadata = schema.metadata or {}
            if (
                schema_metadata.get(_FORMAT_KEY) != _FORMAT
                or parquet.metadata.num_rows != 1
                or {"indices", "offsets"} - set(schema.names)
            ):
                raise DataError(
                    f"{path} is not a raysim split cache file (format "
                    f"{_FORMAT.decode()}); delete it to recompute the split"
                )
            for name in ("indices", "offsets"):
                if schema.field(name).type != _SPLIT_COLUMN_TYPE:
                    raise _refuse(
                        path,
                        f"has column '{name}' of type {schema.field(name).type}, not "
                        f"{_SPLIT_COLUMN_TYPE}",
                    )
            footer = parquet.metadata
            values = sum(
                footer.row_group(group).column(column).num_values
                for group in range(footer.num_row_groups)
                for column in range(footer.num_columns)
            )
            if 8 * values > _SPLIT_DECODE_RATIO * size + _SPLIT_DECODE_SLACK:
                raise _refuse(
                    path,
                    f"declares {values:,} values in {size:,} bytes, more than a split "
                    f"cache file holds",
                )
            table = parquet.read(columns=["indices", "offsets"])
        except DataError:
            raise
        except (pa.ArrowException, OSError) as error:
            raise DataError(
                f"split cache file {path} is unreadable (truncated or corrupted? delete "
                f"it to recompute the split): {str(error)[:200]}"
            ) from None
    try:
        metadata = json.loads(schema_metadata.get(_METADATA_KEY, b"{}"))
        if not isinstance(metadata, dict):
            raise ValueError(f"its metadata is a JSON {type(metadata).__name__}, not an object")
        columns = [table.column(name).combine_chunks().flatten() for name in ("indices", "offsets")]
        if any(column.null_count for column in columns):  # would become NaN, then any integer
            raise ValueError("it holds null ids")
        indices, offsets = (
            column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False) for column in columns
        )
        split = ClientSplit(indices=indices, offsets=offsets)
    except (ValueError, TypeError, RecursionError, pa.ArrowException) as error:
        raise DataError(
            f"split cache file {path} is corrupted (delete it to recompute the split): "
            f"{str(error)[:200]}"
        ) from None
    if num_clients is not None and split.num_clients != num_clients:
        raise _refuse(path, f"holds {split.num_clients} clients, not the {num_clients} expected")
    if num_rows is not None and len(split.indices):
        low, high = int(split.indices.min()), int(split.indices.max())
        if low < 0 or high >= num_rows:
            raise _refuse(
                path,
                f"holds row id {low if low < 0 else high}, outside [0, {num_rows}) of the dataset",
            )
    return split, metadata
