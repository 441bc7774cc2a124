"""Everything a run writes to its output folder, through one `RunOutputs`.

OUT/config.yaml       the resolved config (what `raysim run` accepts to repeat the run), headed
                      by comments: what produced it and its fingerprint (outputs.identity)
OUT/metrics.jsonl     one JSON object per round (outputs.records)
OUT/summary.json      final metrics, totals and throughput, and the environment record
OUT/tensorboard/      TensorBoard event files: every numeric per-round value as a scalar under its
                      metrics.jsonl name (eval/accuracy, bytes_up, time/clients_s, ...), plus
                      derived ones and heatmap images (outputs.tensorboard)
OUT/checkpoints/      round_NNNNNN.npz: the server state (numpy arrays only, loaded without pickle;
                      outputs.checkpoints)
OUT/curves.png        evaluation metrics (test, validation) and training loss per round
                      (with TensorBoard on; TensorBoard's HParams tab gets the config)
OUT/.raysim.lock      while a run (or resume) writes the folder: its pid, host and start time
                      (outputs.run_folder.lock_out_dir); one run at a time owns a folder
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np

from raysim import interrupts
from raysim.config import Config
from raysim.core.state import ServerState
from raysim.outputs.checkpoints import atomic_write_bytes, write_checkpoint
from raysim.outputs.environment import run_environment
from raysim.outputs.identity import config_header, run_identity
from raysim.outputs.records import json_safe, record_line
from raysim.outputs.run_folder import check_out_dir, run_files
from raysim.outputs.tensorboard import TensorBoardLog, sim_time_step


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
        # Each checkpoint carries the config it was written under (resume compares them);
        # the fingerprint in config.yaml's header lets a resume spot an edited config.yaml.
        self.identity = run_identity(config)
        # What produced the run, as comments of config.yaml and in summary.json.
        self.environment = run_environment()
        header = config_header(self.environment, self.identity.fingerprint)
        atomic_write_bytes(self.out_dir / "config.yaml", (header + config.to_yaml()).encode())
        # On resume, metrics.jsonl keeps the rounds up to the checkpoint (rewritten atomically);
        # later rounds are recomputed and appended.
        kept = "".join(record_line(record) for record in history or [])
        atomic_write_bytes(self.out_dir / "metrics.jsonl", kept.encode())
        self._metrics = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self._tensorboard = None
        if tensorboard:
            purge = resumed_round + 1 if history is not None else None
            sim_purge = None
            if history is not None:  # after the checkpoint round's simulated end
                ends = [(r.get("sim") or {}).get("end_s") for r in history]
                sim_purge = sim_time_step(ends[-1]) + 1 if ends and ends[-1] is not None else 0
            self._tensorboard = TensorBoardLog(
                self.out_dir / "tensorboard", purge_step=purge, sim_purge_step=sim_purge
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
                self._metrics.write(record_line(record))
                self._metrics.flush()
                if self._tensorboard is not None:
                    self._tensorboard.write_record(record)
            except BaseException as error:  # surfaced on the next log_round / close
                self._error = error
            finally:
                self._queue.task_done()

    def log_heatmap(self, tag: str, matrix: np.ndarray, step: int) -> None:
        """A matrix as a TensorBoard image (e.g. FLAG/CMDA's pairwise label-distribution KL):
        low values dark blue, high values yellow; small matrices are enlarged (nearest)."""
        if self._tensorboard is None:
            return
        self._tensorboard.write_heatmap(tag, matrix, step)

    def save_checkpoint(self, state: ServerState, extra: dict[str, Any] | None = None) -> Path:
        with interrupts.deferred():  # a checkpoint is written whole (or not at all)
            self.flush()
            # On disk, not only in the page cache, before the checkpoint that relies on them:
            # a resume from this checkpoint needs every record up to its round (resume_records).
            os.fsync(self._metrics.fileno())
            return write_checkpoint(
                self.checkpoint_dir, state, self.identity.config, self.keep_checkpoints, extra
            )

    def write_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Write summary.json with the run's environment record; returns what was written.
        With visual outputs (TensorBoard on): also curves.png and TensorBoard's hparams."""
        summary = {**summary, "environment": self.environment}
        atomic_write_bytes(
            self.out_dir / "summary.json",
            (json.dumps(json_safe(summary), indent=2) + "\n").encode(),
        )
        if self._tensorboard is not None:
            self.flush()  # metrics.jsonl holds every round before the curves are drawn
            write_curves(self.out_dir / "metrics.jsonl", self.out_dir / "curves.png")
            self._tensorboard.write_hparams(self.identity.keys, summary)
        return summary

    def close(self) -> None:
        """Write every queued record, then close the files."""
        with interrupts.deferred():
            self._queue.put(None)
            self._thread.join()
            self._metrics.close()
            if self._tensorboard is not None:
                self._tensorboard.close()
        if self._error is not None:
            raise self._error


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
    atomic_write_bytes(png_path, buffer.getvalue())
