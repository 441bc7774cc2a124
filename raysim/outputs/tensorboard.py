"""A run's TensorBoard event files (OUT/tensorboard/): every numeric per-round value as a
scalar under its metrics.jsonl name, derived scalars (`tensorboard_scalars`), per-client lists
as histograms, heatmap images, and the config with the final metrics in the HParams tab.

A run in simulated time (`devices:`) also writes OUT/tensorboard/sim_time/: its metrics against
simulated time, tagged `sim_time/NAME` (eval/*, val/*, train_loss, the round's simulated length
and staleness), whose step is the round's simulated end in milliseconds (`sim_time_step`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from raysim.outputs.records import flatten_record, is_number


class TensorBoardLog:
    """The event writer of one run. `purge_step`: on resume, the first round after the
    checkpoint; the events of that round and later ones (written before the stop, computed
    again now) are purged, so no round appears twice. `sim_purge_step`: the same for the
    simulated-time events (the step after the checkpoint round's simulated end)."""

    def __init__(
        self, log_dir: Path, purge_step: int | None = None, sim_purge_step: int | None = None
    ) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _use_native_crc32c()
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        self._log_dir, self._sim_purge_step = Path(log_dir), sim_purge_step
        self._sim_writer = None  # OUT/tensorboard/sim_time/, opened by the first sim record

    def write_record(self, record: dict[str, Any]) -> None:
        """One round's record: its scalars, and its per-client lists as histograms (and, in
        simulated time, its metrics against simulated time)."""
        step = int(record["round"])
        scalars = tensorboard_scalars(record)
        self._add_scalars(scalars, step)
        for key, values in _number_lists(record).items():
            self._writer.add_histogram(key, np.asarray(values), step)
        sim = record.get("sim")
        if isinstance(sim, dict) and is_number(sim.get("end_s")):
            self._write_sim_time(scalars, sim_time_step(sim["end_s"]))

    def _write_sim_time(self, scalars: dict[str, float], step: int) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard import SummaryWriter

        if self._sim_writer is None:
            self._sim_writer = SummaryWriter(
                log_dir=str(self._log_dir / "sim_time"), purge_step=self._sim_purge_step
            )
        chosen = {
            f"sim_time/{key}": value
            for key, value in scalars.items()
            if key.startswith(SIM_TIME_PREFIXES) or key in SIM_TIME_KEYS
        }
        summary = Summary(
            value=[Summary.Value(tag=key, simple_value=value) for key, value in chosen.items()]
        )
        self._sim_writer._get_file_writer().add_summary(summary, step)

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

    def write_heatmap(self, tag: str, matrix: np.ndarray, step: int) -> None:
        self._writer.add_image(tag, heatmap_image(matrix), step, dataformats="HWC")

    def write_hparams(self, identity: dict[str, Any], summary: dict[str, Any]) -> None:
        """The flattened config (`identity`: resume_identity's keys) and the final metrics in
        TensorBoard's HParams tab, so runs can be compared there (lists and None as text,
        which the tab shows as they are)."""
        hparams = {}
        for key, value in identity.items():
            hparams[key] = value if isinstance(value, bool | int | float | str) else str(value)
        metrics = {}
        for block, prefix in (("final", "final"), ("final_val", "final_val")):
            for key, value in (summary.get(block) or {}).items():
                if isinstance(value, int | float) and math.isfinite(value):
                    metrics[f"{prefix}/{key}"] = float(value)
        self._writer.add_hparams(hparams, metrics, run_name=".")

    def close(self) -> None:
        self._writer.close()
        if self._sim_writer is not None:
            self._sim_writer.close()


# What OUT/tensorboard/sim_time/ holds of a round's scalars (tagged sim_time/NAME).
SIM_TIME_PREFIXES = ("eval/", "val/")
SIM_TIME_KEYS = ("train_loss", "sim/round_s", "sim/staleness_mean", "sim/staleness_max")


def sim_time_step(end_s: float) -> int:
    """The TensorBoard step of a round in simulated time: its simulated end in milliseconds
    (TensorBoard steps are whole numbers; two rounds ending within the same millisecond share
    a step)."""
    return int(round(float(end_s) * 1000.0))


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
        for key, value in flatten_record(record).items()
        if key != "round" and is_number(value) and math.isfinite(value)
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
    for key, value in flatten_record(record).items():
        if isinstance(value, list | tuple) and value:
            numbers = [v for v in value if is_number(v)]
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
