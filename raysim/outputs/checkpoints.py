"""A run's checkpoints: OUT/checkpoints/round_NNNNNN.npz, the server state as numpy arrays
plus a JSON metadata member (the round, the config it was written under, what the loop adds),
written whole or not at all and read back without pickle; and the atomic file writes every
file of a run folder goes through."""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from raysim.core.state import ServerState
from raysim.errors import RaysimError

_META_KEY = "__raysim_meta__"
_CHECKPOINT_NAME = re.compile(r"round_(\d+)\.npz")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file and rename, so a crash never leaves a half-written file."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_checkpoint(
    checkpoint_dir: Path,
    state: ServerState,
    config_dict: dict[str, Any],
    keep: int,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `state` as round_<N>.npz in `checkpoint_dir` with its metadata (the round, the
    config it was written under, `extra`), then delete all but the newest `keep`."""
    path = checkpoint_dir / f"round_{state.round:06d}.npz"
    meta = json.dumps({"round": state.round, "config": config_dict, **(extra or {})})
    arrays = dict(state.arrays)
    arrays[_META_KEY] = np.frombuffer(meta.encode(), dtype=np.uint8)

    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    atomic_write_bytes(path, buffer.getvalue())
    checkpoints = checkpoint_paths(checkpoint_dir)
    for old in checkpoints[:-keep]:
        old.unlink()
    return path


def checkpoint_paths(checkpoint_dir: str | Path) -> list[Path]:
    """A run's checkpoint files (round_<N>.npz), oldest first by their round number: names
    are zero-padded to 6 digits, so a string sort would put round 1,000,000 before 999,999.
    Only regular files: reading a FIFO of that name would hang the resume."""
    found = []
    for path in Path(checkpoint_dir).glob("round_*.npz"):
        match = _CHECKPOINT_NAME.fullmatch(path.name)
        if match and stat.S_ISREG(path.lstat().st_mode):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def checkpoint_round(path: Path) -> int:
    """The round a checkpoint's file name says it holds."""
    return int(_CHECKPOINT_NAME.fullmatch(path.name).group(1))


def checkpoint_metadata(path: str | Path) -> dict[str, Any]:
    """A checkpoint's metadata alone (its arrays are not read)."""
    path = Path(path)
    try:
        _check_members(path)
        with np.load(path, allow_pickle=False) as archive:
            if _META_KEY not in archive.files:
                raise RaysimError(f"checkpoint {path} has no raysim metadata")
            raw = archive[_META_KEY]
        meta = json.loads(raw.tobytes().decode())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise RaysimError(f"checkpoint {path} is unreadable: {error}") from None
    return meta


def _check_members(path: Path) -> None:
    """Before any array is read: every member of the archive is an uncompressed .npy whose
    header asks for exactly the bytes the member holds. So reading it needs no more memory
    than the file's size (a 1 KB member whose header claims 10^12 entries, or a deflate bomb,
    would otherwise be allocated in full)."""
    if not stat.S_ISREG(path.stat().st_mode):
        raise RaysimError(f"checkpoint {path} is not a regular file")
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            where = f"checkpoint {path}, member {info.filename!r}"
            if info.compress_type != zipfile.ZIP_STORED:
                raise RaysimError(f"{where} is compressed (raysim writes them stored)")
            if not info.filename.endswith(".npy"):
                raise RaysimError(f"{where} is not a .npy array")
            with archive.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = {
                    (1, 0): np.lib.format.read_array_header_1_0,
                    (2, 0): np.lib.format.read_array_header_2_0,
                }.get(version)
                if read_header is None:
                    raise RaysimError(f"{where} has .npy format version {version}")
                shape, _, dtype = read_header(member)
                header_bytes = member.tell()
            if dtype.hasobject:
                raise RaysimError(f"{where} holds Python objects (no pickle is ever loaded)")
            count = math.prod(shape)
            if count * dtype.itemsize != info.file_size - header_bytes:
                raise RaysimError(
                    f"{where} declares {dtype}{list(shape)} ({count * dtype.itemsize} bytes) "
                    f"but holds {info.file_size - header_bytes} bytes"
                )


def load_checkpoint(path: str | Path) -> tuple[ServerState, dict[str, Any]]:
    """Read a checkpoint written by `write_checkpoint` (no pickle is ever loaded)."""
    path = Path(path)
    try:
        _check_members(path)
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise RaysimError(f"checkpoint {path} is unreadable or truncated: {error}") from None
    if _META_KEY not in arrays:
        raise RaysimError(f"checkpoint {path} has no raysim metadata")
    try:
        meta = json.loads(arrays.pop(_META_KEY).tobytes().decode())
        round_index = int(meta["round"])
    except (ValueError, KeyError, TypeError) as error:  # incl. JSON and UTF-8 decode errors
        raise RaysimError(f"checkpoint {path} has unreadable raysim metadata: {error!r}") from None
    match = _CHECKPOINT_NAME.fullmatch(path.name)
    if match and int(match.group(1)) != round_index:  # renamed or forged: trust neither
        raise RaysimError(
            f"checkpoint {path} holds round {round_index} but its name says round "
            f"{int(match.group(1))}"
        )
    return ServerState(round_index, arrays), meta


def check_state(state: ServerState, template: ServerState) -> str | None:
    """Why a restored state cannot continue this run, None if it can: it holds every array of
    the run's initial state (`template`) with its shape and dtype, and all its float arrays are
    finite. Arrays the initial state lacks are allowed (the client state store's
    `client_state/...` entries grow as clients write; a plug-in may add slots lazily)."""
    missing = sorted(set(template.arrays) - set(state.arrays))
    if missing:
        return f"it lacks array(s) {', '.join(missing)}"
    for name, expected in template.arrays.items():
        value = np.asarray(state.arrays[name])
        expected = np.asarray(expected)
        if value.shape != expected.shape or value.dtype != expected.dtype:
            return (
                f"array '{name}' is {value.dtype}{list(value.shape)} where this run's is "
                f"{expected.dtype}{list(expected.shape)}"
            )
    for name, value in state.arrays.items():
        value = np.asarray(value)
        if np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
            return f"array '{name}' holds non-finite values"
    return None
