"""Ray custom metrics of a run (rounds, client updates, bytes), shown in the Ray dashboard.

The server actor records one round at a time through `RoundMetrics.record`; Ray exports the
values through each node's metrics agent (Prometheus format, `ray metrics launch-prometheus`
and the dashboard's Metrics tab read them). Every series carries the run's name as the `run`
tag, so concurrent runs (e.g. the trials of a `raysim tune` sweep) stay apart.

Exported names (Prometheus adds the `ray_` prefix, and `_total` to counters):
raysim_rounds, raysim_client_updates, raysim_clients_failed, raysim_bytes_up, raysim_bytes_down
(counters) and raysim_round_seconds, raysim_train_loss (gauges).
"""

from __future__ import annotations

import math

from raysim.core.state import RoundStats

_COUNTERS = {
    "raysim_rounds": "rounds finished",
    "raysim_client_updates": "client updates folded into the global model",
    "raysim_clients_failed": "client updates lost to failed tasks",
    "raysim_bytes_up": "bytes sent by clients to the server (as encoded)",
    "raysim_bytes_down": "bytes sent by the server to clients (as encoded)",
}
_GAUGES = {
    "raysim_round_seconds": "wall time of the last round's client phase, seconds",
    "raysim_train_loss": "sample-weighted mean training loss of the last round's clients",
}


class RoundMetrics:
    """Counters and gauges of one run; a no-op where Ray's metrics are unavailable."""

    def __init__(self, run_name: str) -> None:
        self.tags = {"run": run_name}
        self._metrics: dict[str, object] = {}
        try:
            from ray.util import metrics

            for name, description in _COUNTERS.items():
                self._metrics[name] = metrics.Counter(name, description, tag_keys=("run",))
            for name, description in _GAUGES.items():
                self._metrics[name] = metrics.Gauge(name, description, tag_keys=("run",))
        except Exception:  # noqa: BLE001 - metrics are a convenience, never a failure
            self._metrics = {}

    def record(self, stats: RoundStats) -> None:
        """Add one round's totals (counters only accept positive increments)."""
        if not self._metrics:
            return
        increments = {
            "raysim_rounds": 1,
            "raysim_client_updates": stats.clients_done,
            "raysim_clients_failed": stats.clients_failed,
            "raysim_bytes_up": stats.bytes_up,
            "raysim_bytes_down": stats.bytes_down,
        }
        for name, value in increments.items():
            if value > 0:
                self._metrics[name].inc(value, tags=self.tags)
        self._metrics["raysim_round_seconds"].set(stats.clients_s, tags=self.tags)
        if math.isfinite(stats.train_loss):
            self._metrics["raysim_train_loss"].set(stats.train_loss, tags=self.tags)
