"""Everything a run writes to its output folder.

OUT/config.yaml       the resolved config (what `raysim run` accepts to repeat the run)
OUT/metrics.jsonl     one JSON object per round
OUT/summary.json      final metrics, totals and throughput
OUT/tensorboard/      TensorBoard event files (every numeric per-round value as a scalar)
OUT/checkpoints/      round_NNNNNN.npz: the server state (numpy arrays only, loaded without pickle)
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

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
    ) -> None:
        """Start a run's outputs; `history` (on resume) = the metrics records to keep."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.checkpoint_dir.mkdir(exist_ok=True)
        if history is None:
            # A new run in a folder that holds an older one replaces it (its checkpoints must
            # not be mistaken for this run's when resuming).
            old = sorted(self.checkpoint_dir.glob("round_*.npz"))
            if old:
                print(f"raysim: replacing the previous run in {self.out_dir}", flush=True)
            for path in old:
                path.unlink()
        self.keep_checkpoints = config.run.keep_checkpoints
        _atomic_write_bytes(self.out_dir / "config.yaml", config.to_yaml().encode())
        # On resume, metrics.jsonl keeps the rounds up to the checkpoint (rewritten atomically);
        # later rounds are recomputed and appended.
        kept = "".join(json.dumps(_json_safe(record)) + "\n" for record in history or [])
        _atomic_write_bytes(self.out_dir / "metrics.jsonl", kept.encode())
        self._metrics = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
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
        self._queue.put(record)

    def flush(self) -> None:
        """Wait until every queued record is written (before a checkpoint, so that
        metrics.jsonl always covers at least the rounds of the newest checkpoint)."""
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
                    for key, value in _flatten(record).items():
                        if (
                            key != "round"
                            and isinstance(value, int | float)
                            and math.isfinite(value)
                        ):
                            self._writer.add_scalar(key, value, step)
            except BaseException as error:  # surfaced on the next log_round / close
                self._error = error
            finally:
                self._queue.task_done()

    def save_checkpoint(self, state: ServerState, extra: dict[str, Any] | None = None) -> Path:
        self.flush()
        path = self.checkpoint_dir / f"round_{state.round:06d}.npz"
        meta = json.dumps({"round": state.round, **(extra or {})})
        arrays = dict(state.arrays)
        arrays[_META_KEY] = np.frombuffer(meta.encode(), dtype=np.uint8)
        import io

        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        _atomic_write_bytes(path, buffer.getvalue())
        checkpoints = sorted(self.checkpoint_dir.glob("round_*.npz"))
        for old in checkpoints[: -self.keep_checkpoints]:
            old.unlink()
        return path

    def write_summary(self, summary: dict[str, Any]) -> None:
        _atomic_write_bytes(
            self.out_dir / "summary.json",
            (json.dumps(_json_safe(summary), indent=2) + "\n").encode(),
        )

    def close(self) -> None:
        """Write every queued record, then close the files."""
        self._queue.put(None)
        self._thread.join()
        self._metrics.close()
        if self._writer is not None:
            self._writer.close()
        if self._error is not None:
            raise self._error


def peak_rss_bytes() -> int:
    """Peak resident memory of this process so far (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_checkpoint(path: str | Path) -> tuple[ServerState, dict[str, Any]]:
    """Read a checkpoint written by `save_checkpoint` (no pickle is ever loaded)."""
    path = Path(path)
    try:
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
    return ServerState(round_index, arrays), meta


def _flatten(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat
