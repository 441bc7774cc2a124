"""Everything a run writes to its output folder.

OUT/config.yaml       the resolved config (what `raysim run` accepts to repeat the run)
OUT/metrics.jsonl     one JSON object per round
OUT/summary.json      final metrics, totals and throughput
OUT/tensorboard/      TensorBoard event files: every numeric per-round value as a scalar under its
                      metrics.jsonl name (eval/accuracy, bytes_up, time/clients_s, ...), plus
                      derived ones (see `tensorboard_scalars`) and heatmap images
OUT/checkpoints/      round_NNNNNN.npz: the server state (numpy arrays only, loaded without pickle)
OUT/curves.png        evaluation metrics (test, validation) and training loss per round
                      (with TensorBoard on; TensorBoard's HParams tab gets the config)
OUT/.raysim.lock      while a run (or resume) writes the folder: its pid, host and start time
                      (`lock_out_dir`); one run at a time owns a folder
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import io
import json
import math
import os
import queue
import re
import shutil
import socket
import stat
import sys
import tempfile
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from raysim import interrupts
from raysim.config import Config
from raysim.core.state import ServerState
from raysim.errors import RaysimError

_META_KEY = "__raysim_meta__"


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temp file and rename, so a crash never leaves a half-written file."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return _json_safe(value.item())
    return value


class RunOutputs:
    def __init__(
        self,
        out_dir: str | Path,
        config: Config,
        tensorboard: bool = True,
        history: list[dict[str, Any]] | None = None,
        resumed_round: int = 0,
        overwrite: bool = False,
    ) -> None:
        """Start a run's outputs. On resume, `history` holds the metrics records to keep (those
        of rounds up to `resumed_round`, the restored checkpoint's); else a new run starts, and
        an earlier run in the folder is removed first only with `overwrite` (else refused, see
        `check_out_dir`), so that the folder never mixes two runs."""
        # Checked again here, not only before the data loaded: deleting is never implied.
        self.out_dir = check_out_dir(out_dir, new_run=history is None, overwrite=overwrite)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if history is None:
            found = run_files(self.out_dir)
            if found:
                print(f"raysim: deleting the earlier run in {self.out_dir} (--overwrite)")
                for path in found:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.checkpoint_dir.mkdir(exist_ok=True)
        self.keep_checkpoints = config.run.keep_checkpoints
        # Each checkpoint carries the config it was written under (resume compares them).
        self.config_dict = config.to_dict()
        # What produced the run, as comments of config.yaml (still a plain, loadable config)
        # and in summary.json; the fingerprint lets a resume spot an edited config.yaml.
        self.environment = run_environment()
        fingerprint = {"config_fingerprint": config_fingerprint(config)}
        header = "".join(
            f"# {key}: {value}\n" for key, value in {**self.environment, **fingerprint}.items()
        )
        _atomic_write_bytes(self.out_dir / "config.yaml", (header + config.to_yaml()).encode())
        # On resume, metrics.jsonl keeps the rounds up to the checkpoint (rewritten atomically);
        # later rounds are recomputed and appended.
        kept = "".join(json.dumps(_json_safe(record)) + "\n" for record in history or [])
        _atomic_write_bytes(self.out_dir / "metrics.jsonl", kept.encode())
        self._metrics = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            _use_native_crc32c()

            # On resume, events of the rounds after the checkpoint (written before the stop,
            # recomputed now) are purged, so no round appears twice.
            purge = resumed_round + 1 if history is not None else None
            self._writer = SummaryWriter(
                log_dir=str(self.out_dir / "tensorboard"), purge_step=purge
            )
        # Round records are written by a background thread: TensorBoard's add_scalar costs
        # ~50 us a value, which would otherwise sit on the critical path of every round.
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._write_records, name="raysim-outputs", daemon=True
        )
        self._thread.start()

    def log_round(self, record: dict[str, Any]) -> None:
        """Queue one round's record for metrics.jsonl and TensorBoard (written in order)."""
        if self._error is not None:
            raise self._error
        with interrupts.deferred():  # a Ctrl-C here could leave the queue's lock held
            self._queue.put(record)

    def flush(self) -> None:
        """Wait until every queued record is written (before a checkpoint, so that
        metrics.jsonl always covers at least the rounds of the newest checkpoint)."""
        with interrupts.deferred():
            self._queue.join()
        if self._error is not None:
            raise self._error

    def _write_records(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                self._queue.task_done()
                return
            try:
                self._metrics.write(json.dumps(_json_safe(record)) + "\n")
                self._metrics.flush()
                if self._writer is not None:
                    step = int(record["round"])
                    self._add_scalars(tensorboard_scalars(record), step)
                    for key, values in _number_lists(record).items():
                        self._writer.add_histogram(key, np.asarray(values), step)
            except BaseException as error:  # surfaced on the next log_round / close
                self._error = error
            finally:
                self._queue.task_done()

    def _add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Every scalar of a round as one TensorBoard event (one Summary holding a value per
        tag, which TensorBoard reads exactly like one event per tag). SummaryWriter.add_scalar
        builds and queues an event per value, ~50 us each: ~1 ms a round of this thread's
        time, which it takes from the round loop's thread (they share the GIL)."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(
            value=[Summary.Value(tag=key, simple_value=value) for key, value in scalars.items()]
        )
        self._writer._get_file_writer().add_summary(summary, step)

    def log_heatmap(self, tag: str, matrix: np.ndarray, step: int) -> None:
        """A matrix as a TensorBoard image (e.g. FLAG/CMDA's pairwise label-distribution KL):
        low values dark blue, high values yellow; small matrices are enlarged (nearest)."""
        if self._writer is None:
            return
        self._writer.add_image(tag, heatmap_image(matrix), step, dataformats="HWC")

    def save_checkpoint(self, state: ServerState, extra: dict[str, Any] | None = None) -> Path:
        with interrupts.deferred():  # a checkpoint is written whole (or not at all)
            return self._save_checkpoint(state, extra)

    def _save_checkpoint(self, state: ServerState, extra: dict[str, Any] | None) -> Path:
        self.flush()
        # On disk, not only in the page cache, before the checkpoint that relies on them: a
        # resume from this checkpoint needs every record up to its round (resume_records).
        os.fsync(self._metrics.fileno())
        path = self.checkpoint_dir / f"round_{state.round:06d}.npz"
        meta = json.dumps({"round": state.round, "config": self.config_dict, **(extra or {})})
        arrays = dict(state.arrays)
        arrays[_META_KEY] = np.frombuffer(meta.encode(), dtype=np.uint8)

        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        _atomic_write_bytes(path, buffer.getvalue())
        checkpoints = checkpoint_paths(self.checkpoint_dir)
        for old in checkpoints[: -self.keep_checkpoints]:
            old.unlink()
        return path

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json with the run's environment record; returns what was written.
        With visual outputs (TensorBoard on): also curves.png and TensorBoard's hparams."""
        summary = {**summary, "environment": self.environment}
        _atomic_write_bytes(
            self.out_dir / "summary.json",
            (json.dumps(_json_safe(summary), indent=2) + "\n").encode(),
        )
        if self._writer is not None:
            self.flush()  # metrics.jsonl holds every round before the curves are drawn
            write_curves(self.out_dir / "metrics.jsonl", self.out_dir / "curves.png")
            self._write_hparams(summary)
        return summary

    def _write_hparams(self, summary: dict[str, Any]) -> None:
        """The flattened config and the final metrics in TensorBoard's HParams tab, so runs
        can be compared there (lists and None as text, which the tab shows as they are)."""
        hparams = {}
        for key, value in resume_identity(self.config_dict).items():
            hparams[key] = value if isinstance(value, bool | int | float | str) else str(value)
        metrics = {}
        for block, prefix in (("final", "final"), ("final_val", "final_val")):
            for key, value in (summary.get(block) or {}).items():
                if isinstance(value, int | float) and math.isfinite(value):
                    metrics[f"{prefix}/{key}"] = float(value)
        self._writer.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        """Write every queued record, then close the files."""
        with interrupts.deferred():
            self._queue.put(None)
            self._thread.join()
            self._metrics.close()
            if self._writer is not None:
                self._writer.close()
        if self._error is not None:
            raise self._error


_CHECKPOINT_NAME = re.compile(r"round_(\d+)\.npz")


def resume_records(path: Path, checkpoint_round: int) -> list[dict[str, Any]]:
    """The metrics records a resume from the checkpoint of `checkpoint_round` keeps: those of
    rounds 1..checkpoint_round, each exactly once, whole, in order (they are fsynced before
    each checkpoint). What follows them (rounds computed again after the resume) may be
    damaged: a torn or unreadable line there is cut off with a line saying so. Anything wrong
    up to the checkpoint's round is refused in one line naming the file and the first missing
    or bad round: the run is never silently shortened."""
    last = checkpoint_round

    def refuse(problem: str) -> RaysimError:
        return RaysimError(
            f"cannot resume: {path} {problem}; a resume from the checkpoint of round {last} "
            f"needs the records of rounds 1-{last} exactly once and in order"
        )

    if not path.is_file():
        raise refuse("is missing")
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # after the final newline
    history: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        expected = len(history) + 1
        try:
            record = json.loads(line)
            round_index = record["round"]
            if isinstance(round_index, bool) or not isinstance(round_index, int):
                raise TypeError(f"round {round_index!r}")
        except (ValueError, KeyError, TypeError):
            if expected > last:  # past the checkpoint: recomputed, so cut off here
                print(
                    f"raysim: {path} line {number}, after the records of rounds 1-{last}, is "
                    f"cut or unreadable; dropping it and the {len(lines) - number} line(s) "
                    "after it (their rounds are computed again)",
                    file=sys.stderr,
                    flush=True,
                )
                break
            raise refuse(
                f"line {number} is not a whole record (round {expected} expected)"
            ) from None
        if round_index < expected:
            raise refuse(f"line {number} holds round {round_index} a second time")
        if round_index > last and expected > last:
            continue  # a round after the checkpoint: computed again
        if round_index != expected:
            raise refuse(f"lacks round {expected} (line {number} holds round {round_index})")
        history.append(record)
    if len(history) < last:
        raise refuse(f"ends after round {len(history)}: it lacks round {len(history) + 1}")
    return history


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


# What may differ between the config a run was written with and the one it resumes with: the
# round count (`--resume DIR --set run.rounds=N` extends a run) and where it runs (`runtime`:
# backend, Ray address, CPUs; results do not depend on them). Any other change would make a
# silent hybrid of two runs.
RESUMABLE_KEYS = ("run.rounds", "runtime.")


def resume_identity(config: Config | dict[str, Any]) -> dict[str, Any]:
    """The config's keys (flattened, `section.key`) that a resume must not change."""
    raw = config.to_dict() if isinstance(config, Config) else config
    raw = json.loads(json.dumps(raw, default=str))  # as stored in checkpoint metadata
    flat = {
        f"{section}.{key}": value
        for section, values in raw.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }
    return {
        key: value
        for key, value in flat.items()
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS)
    }


def config_fingerprint(config: Config | dict[str, Any]) -> str:
    """A short hash of `resume_identity(config)`."""
    text = json.dumps(resume_identity(config), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_changes(old: dict[str, Any], new: Config) -> list[str]:
    """`key: old -> new` for every key a resume must not change that differs."""
    before, after = resume_identity(old), resume_identity(new)
    return [
        f"{key}: {before.get(key, '(unset)')!r} -> {after.get(key, '(unset)')!r}"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]


def written_fingerprint(config_path: Path) -> str | None:
    """The config fingerprint in the header of a run's config.yaml (None: not there)."""
    for line in config_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# config_fingerprint: "):
            return line.removeprefix("# config_fingerprint: ").strip()
    return None


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


def run_environment() -> dict[str, Any]:
    """What produced a run: versions, the git commit of a raysim checkout, the host, the time."""
    import datetime
    import os
    import platform
    import subprocess

    import raysim

    versions = {"raysim": raysim.__version__, "python": platform.python_version()}
    for name in ("torch", "ray", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - an environment record never fails a run
            versions[name] = None
    commit = None
    source = Path(raysim.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        commit = head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout (an installed wheel) or no git
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        pass
    return {
        **versions,
        "git_commit": commit,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    """Read a checkpoint written by `save_checkpoint` (no pickle is ever loaded)."""
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


def write_curves(metrics_path: Path, png_path: Path) -> None:
    """curves.png of a run: each evaluated metric on the test split (solid) and the validation
    split (dashed) against the round, and the clients' training loss. Drawn with matplotlib's
    file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line]
    evaluated = [r for r in records if "eval" in r]
    names = sorted({k for r in evaluated for k in r["eval"] if not k.startswith("loss")})
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4), dpi=100)
    for index, name in enumerate(names):
        colour = f"C{index % 10}"
        for block, style, label in (("eval", "-", "test"), ("val", "--", "validation")):
            points = [(r["round"], r[block][name]) for r in evaluated if name in r.get(block, {})]
            if points:
                rounds, values = zip(*points, strict=True)
                left.plot(rounds, values, style, color=colour, label=f"{label} {name}")
    left.set_xlabel("round")
    left.set_ylabel("metric")
    left.set_title("evaluation")
    if names:
        left.legend(fontsize=8)
    losses = [(r["round"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
    if losses:
        rounds, values = zip(*losses, strict=True)
        right.plot(rounds, values, color="C0")
    right.set_xlabel("round")
    right.set_ylabel("mean client training loss")
    right.set_title("training")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    _atomic_write_bytes(png_path, buffer.getvalue())


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`, in C (google-crc32c)."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _use_native_crc32c() -> None:
    """Make TensorBoard's event writer checksum records in C.

    Without TensorFlow, tensorboard computes every record's CRC-32C in pure Python, ~90 ns a
    byte: ~70 us for one round's scalars, run on a thread that holds the GIL the round loop
    needs. google-crc32c gives the same values (checked in tests/test_tensorboard.py) ~300x
    faster. tensorboard reads the function from its record_writer module's globals, so that
    global is replaced (idempotent; nothing else changes)."""
    from tensorboard.summary.writer import record_writer

    record_writer.masked_crc32c = _masked_crc32c


def tensorboard_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars of one round record: every finite number under its flattened name
    (`time/clients_s`, `eval/accuracy`, ... so new keys appear without changes here), plus:

    clients/loss_mean        the round's sample-weighted mean training loss (= train_loss)
    clients/failure_rate     clients_failed / (clients_done + clients_failed)
    comm/bytes_up_per_client, comm/bytes_down_per_client
    time/round_s             the round's wall time (= wall_s), beside its split in time/*
    NAME/min, /median, /mean, /max   for every list of per-client numbers in the record (e.g.
                             a future `client_losses`), also written as a histogram NAME
    """
    scalars = {
        key: float(value)
        for key, value in _flatten(record).items()
        if key != "round"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }
    if "train_loss" in scalars:
        scalars["clients/loss_mean"] = scalars["train_loss"]
    done, failed = record.get("clients_done") or 0, record.get("clients_failed") or 0
    if done + failed:
        scalars["clients/failure_rate"] = failed / (done + failed)
    # down: sent to every sampled client; up: counted for the clients whose update arrived
    for direction, count in (("down", record.get("clients") or 0), ("up", done)):
        if count and f"bytes_{direction}" in scalars:
            scalars[f"comm/bytes_{direction}_per_client"] = scalars[f"bytes_{direction}"] / count
    if "wall_s" in scalars:
        scalars["time/round_s"] = scalars["wall_s"]
    for key, values in _number_lists(record).items():
        scalars[f"{key}/min"] = float(np.min(values))
        scalars[f"{key}/median"] = float(np.median(values))
        scalars[f"{key}/mean"] = float(np.mean(values))
        scalars[f"{key}/max"] = float(np.max(values))
    return scalars


def _number_lists(record: dict[str, Any]) -> dict[str, list[float]]:
    """Non-empty lists of finite numbers in a record (per-client values), by flattened name."""
    lists = {}
    for key, value in _flatten(record).items():
        if isinstance(value, list | tuple) and value:
            numbers = [v for v in value if isinstance(v, int | float) and not isinstance(v, bool)]
            finite = [float(v) for v in numbers if math.isfinite(v)]
            if len(numbers) == len(value) and finite:
                lists[key] = finite
    return lists


def heatmap_image(matrix: np.ndarray, min_pixels: int = 256) -> np.ndarray:
    """An (H, W, 3) uint8 image of a 2-D matrix, scaled to its own min..max."""
    values = np.asarray(matrix, dtype=np.float64)
    if values.ndim != 2 or not values.size:
        raise ValueError(f"a heatmap needs a non-empty 2-D matrix, got shape {values.shape}")
    finite = np.isfinite(values)
    low = values[finite].min() if finite.any() else 0.0
    high = values[finite].max() if finite.any() else 1.0
    t = np.where(finite, (values - low) / (high - low) if high > low else 0.0, 0.0)
    # dark blue (0.07, 0.04, 0.33) -> teal -> yellow (0.99, 0.91, 0.14), like viridis' ends
    stops = np.array([[0.07, 0.04, 0.33], [0.13, 0.57, 0.55], [0.99, 0.91, 0.14]])
    position = t * (len(stops) - 1)
    index = np.minimum(position.astype(int), len(stops) - 2)
    fraction = (position - index)[..., None]
    rgb = stops[index] * (1 - fraction) + stops[index + 1] * fraction
    scale = max(1, min_pixels // max(values.shape))
    rgb = np.repeat(np.repeat(rgb, scale, axis=0), scale, axis=1)
    return (rgb * 255).round().astype(np.uint8)


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat
