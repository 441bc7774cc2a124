"""Who may write a run's output folder: its path checked (it can be a folder; a new run does
not mix with an earlier one), and the lock that makes one run at a time its writer
(OUT/.raysim.lock, `lock_out_dir`)."""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from raysim.config.paths import RAYIGNORE, keep_out_of_uploads
from raysim.errors import RaysimError

LOCK_NAME = ".raysim.lock"


class OutDirLock:
    """The lock of a run's output folder, held from before its data loads to its end.

    `fcntl.flock` on an open descriptor: the kernel drops it when the holder exits, however it
    ends (SIGKILL included), so a lock file whose holder is gone is stale by construction and
    the next run takes it over. The file holds who holds it (pid, host, start time) for the
    message that refuses a second run."""

    def __init__(self, out_dir: Path, path: Path, fd: int, created_dir: bool) -> None:
        self.out_dir, self.path, self._fd, self._created_dir = out_dir, path, fd, created_dir

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlinked while still held: a run that opened the old file meanwhile finds it gone
        # after locking it and opens the new one (`lock_out_dir`).
        with contextlib.suppress(OSError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = None
        if self._created_dir:  # a run refused before writing anything leaves no empty folder
            with contextlib.suppress(OSError):
                # (the upload marker written with the lock is not the run's output)
                if [entry.name for entry in self.out_dir.iterdir()] == [RAYIGNORE]:
                    (self.out_dir / RAYIGNORE).unlink()
                self.out_dir.rmdir()

    def __enter__(self) -> OutDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder_text(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode())
        return f"pid {int(holder['pid'])} on {holder['host']} since {holder['started_at']}"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""


def lock_out_dir(out_dir: str | Path) -> OutDirLock:
    """Make this process the one run that writes `out_dir` (created if needed), or refuse in
    one line naming the run that holds it. A lock left by a run that is no longer running is
    taken over, with a line saying so."""
    out_dir = check_out_dir(out_dir)
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        # Writable? Checked by writing, before Ray or the data start (permission bits do not
        # tell a read-only mount, and bind root): found later it was a 23-87 line traceback.
        probe, probe_path = tempfile.mkstemp(prefix=".raysim-write-check-", dir=out_dir)
        os.close(probe)
        os.unlink(probe_path)
        keep_out_of_uploads(out_dir)
    except OSError as error:
        raise RaysimError(
            f"output folder {out_dir} is not writable: {error.strerror or error} "
            f"({error.filename or out_dir}); choose another --out"
        ) from None
    path = out_dir / LOCK_NAME
    for _ in range(100):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as error:  # a symlink planted as the lock, a read-only folder
            raise RaysimError(f"output folder {out_dir}: cannot open {path}: {error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder_text(fd) or "its holder did not say who it is"
            os.close(fd)
            raise RaysimError(
                f"output folder {out_dir} is in use by another run ({holder}; lock file "
                f"{path}); wait for it to end, or choose another --out"
            ) from None
        try:
            current = os.stat(path, follow_symlinks=False)
            locked = os.fstat(fd)
            same = (current.st_dev, current.st_ino) == (locked.st_dev, locked.st_ino)
        except FileNotFoundError:
            same = False
        if not same:  # its holder ended and removed it between our open and our lock: again
            os.close(fd)
            continue
        stale = _holder_text(fd)
        if stale:
            print(
                f"raysim: taking over the lock of {out_dir}: the run that held it ({stale}) "
                "is no longer running",
                file=sys.stderr,
                flush=True,
            )
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.fsync(fd)
        return OutDirLock(out_dir, path, fd, created)
    raise RaysimError(f"output folder {out_dir}: could not take its lock {path}")


# What a run writes into its folder (see the module docstring): a folder holding any of these
# holds a run.
RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints", "tensorboard")


def run_files(out_dir: Path) -> list[Path]:
    """The files and folders of a run in `out_dir` (none: it holds no run)."""
    return [out_dir / name for name in RUN_FILES if (out_dir / name).exists()]


def check_out_dir(out_dir: str | Path, *, new_run: bool = False, overwrite: bool = False) -> Path:
    """An output folder path that can be a folder (one line naming the file in the way). For a
    `new_run`, a folder holding another run is refused unless `overwrite` (the new run then
    deletes it once its data has loaded): writing into it would mix two runs' records."""
    out_dir = Path(out_dir)
    for path in (out_dir, *out_dir.parents):
        if path.exists() and not path.is_dir():
            raise RaysimError(f"output folder {out_dir}: {path} is a file, not a folder")
    if new_run and not overwrite:
        found = run_files(out_dir)
        if found:
            raise RaysimError(
                f"output folder {out_dir} holds another run ({', '.join(p.name for p in found)}); "
                f"continue it with: raysim run --resume {out_dir}; or start over with "
                "--overwrite, which deletes that run; or choose another --out"
            )
    return out_dir
