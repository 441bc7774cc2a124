"""Finding and opening data files without trusting them: the one way every reader reads a file.

A FIFO, a device or a directory where a data file is expected would block a reader forever or
stream without end, so only regular files are opened (`open_regular_file`), and each format has
a size bound, checked before a byte is read, so that a sparse or absurd file is refused instead
of filling memory. The readers then check each header against what the file can hold before they
allocate. Also here: the checks of `data.root` and of file names a data file gives, and the JSON
reader that LEAF and COCO share.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from raysim.data import torchvision_adapter as tv
from raysim.errors import DataError

_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _regular_file_problem(path: str, what: str, info: os.stat_result) -> DataError | None:
    if stat.S_ISREG(info.st_mode):
        return None
    kind = _FILE_KINDS.get(stat.S_IFMT(info.st_mode), "another kind of file")
    return DataError(f"{path} is not a regular file but {kind} (expected the {what})")


def open_regular_file(
    path: str | os.PathLike, what: str, max_bytes: int | None, *, missing: str | None = None
) -> tuple[Any, int]:
    """(binary handle, size) of `path` if it is a regular file of at most `max_bytes` bytes.

    Anything else is one DataError naming the path: `missing` (or "<what> not found: <path>")
    when it does not exist. The path is checked with stat before it is opened (so a device is
    never opened), then opened non-blocking (a FIFO swapped in meanwhile cannot block the open)
    and checked again on the open descriptor, which is the file that will be read.
    """
    path = os.fspath(path)
    try:
        problem = _regular_file_problem(path, what, os.stat(path))
        if problem is not None:
            raise problem
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise DataError(missing or f"{what} not found: {path}") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = error.strerror if isinstance(error, OSError) and error.strerror else error
        raise DataError(f"cannot read {what} {path}: {reason}") from None
    try:
        info = os.fstat(fd)
        problem = _regular_file_problem(path, what, info)
        if problem is not None:
            raise problem
        if max_bytes is not None and info.st_size > max_bytes:
            raise DataError(
                f"{path}: {info.st_size:,} bytes is more than a {what} may have "
                f"({max_bytes:,} bytes); is this the right file?"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(
    path: str | os.PathLike, what: str, max_bytes: int, *, missing: str | None = None
) -> bytes:
    """The content of a regular file of at most `max_bytes` bytes (see `open_regular_file`)."""
    handle, size = open_regular_file(path, what, max_bytes, missing=missing)
    try:
        with handle:
            # read(n) allocates n bytes up front: ask for the size stat gave (one more byte
            # tells a file that grew meanwhile), never for the bound.
            content = handle.read(size + 1)
    except OSError as error:
        raise DataError(f"cannot read {what} {os.fspath(path)}: {error}") from None
    if len(content) > size:
        raise DataError(f"{os.fspath(path)}: the {what} changed while it was read")
    return content


def path_under(folder: str, name: str, what: str, source: str) -> str:
    """`folder/name` for a file name read from a data file (`source`), refused when it is
    absolute or climbs out of `folder` with '..': a data file names files in its own folder
    and must not make raysim read others. Symbolic links inside the folder are followed (a
    user may link a dataset in from elsewhere); containment is checked on the path as written.
    """
    base = os.path.normpath(folder)
    path = os.path.normpath(os.path.join(base, name))
    if os.path.isabs(name) or os.path.commonpath([base, path]) != base or path == base:
        raise DataError(
            f"{source}: {what} {name[:200]!r} is not a file name inside {folder} (absolute "
            f"paths and '..' are refused)"
        )
    return path


def ascii_uint(text: str) -> int | None:
    """The value of `text` if it is ASCII digits only, else None. str.isdigit alone accepts
    digits such as '²' that int() refuses; beyond 18 digits (more than any count or id a data
    file may hold) the value is clamped to 10**18, since int() refuses more than 4,300 digits
    and each digit would cost time. Callers print `text` itself in their messages."""
    if not text or not (text.isascii() and text.isdigit()):
        return None
    return int(text) if len(text) <= 18 else 10**18


# A JSON data file is at most a few hundred MB (COCO 2014's train annotations: 332 MB); Python
# holds a parsed file in several times its size, so a larger one is refused before it is read.
JSON_MAX_BYTES = 2 << 30


def read_json_file(path: str, kind: str) -> Any:
    """A JSON data file, every failure one DataError naming the file (and line, if known)."""
    content = read_regular_file(path, f"{kind} file", JSON_MAX_BYTES)
    try:
        text = content.decode("utf-8")
        del content
        # As text-mode open() would read it: universal newlines (the error's line numbers)
        return json.loads(text.replace("\r\n", "\n").replace("\r", "\n"))
    except json.JSONDecodeError as error:
        raise DataError(
            f"{path}: invalid JSON at line {error.lineno}, column {error.colno}: {error.msg}"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read {kind} {path}: {error}") from None
    except (ValueError, RecursionError) as error:  # an over-long integer; absurd nesting
        raise DataError(f"{path}: not a {kind} file: {error}") from None


# deflate cannot expand data more than ~1032x; a .gz whose header promises more is a lie
_GZIP_MAX_RATIO = 1100


def resolve_data_path(root: str | None, name: str) -> str:
    """A file name from the config: absolute, or relative to `data.root` (if set)."""
    return name if os.path.isabs(name) or root is None else os.path.join(root, name)


def _require_root(root: str | None, name: str, expected: str, how: str | None = None) -> str:
    """`root` if it is a folder, else one DataError saying what it must hold (`expected`) and
    how to obtain dataset `name`: `how`, or by default the torchvision layout's advice."""
    if root is None:
        raise DataError(
            f"'data.root' must be set for dataset '{name}' (the folder containing {expected}); "
            f"{how or tv.how_to_obtain(name, '<data.root>')}"
        )
    if not os.path.isdir(root):
        raise DataError(
            f"dataset '{name}': data.root {root!r} is not a directory (expected a "
            f"folder containing {expected}); {how or tv.how_to_obtain(name, root)}"
        )
    return root


def _find_file(directory: str, filename: str, name: str, root: str, how: str | None = None) -> str:
    """`filename` or `filename.gz` in `directory`; `how`: how to obtain it (default: the
    torchvision layout's advice for `name`)."""
    candidates = [os.path.join(directory, file) for file in (filename, filename + ".gz")]
    for path in candidates:
        if os.path.isfile(path):
            return path
    for path in candidates:
        if os.path.lexists(path):  # a FIFO, folder, ... there: the reader refuses it by name
            return path
    raise DataError(
        f"dataset '{name}': file not found: {os.path.join(directory, filename)} (or .gz); "
        f"{how or tv.how_to_obtain(name, root)}"
    )
