"""The `devices:` section: simulated device profiles and a simulated clock
(raysim.core.schedule.profiles, raysim.core.schedule.sync_clock; docs/SIMULATED_TIME.md).

With `profiles: none` (the default) nothing of this section is used and a run is exactly what
it was without it. `sampled` draws each client's compute speed and link bandwidths from
log-normal distributions (median, sigma of the log) and its availability from a periodic
on/off window, all from the run seed; `trace` reads them from a CSV file (`trace`)."""

from __future__ import annotations

from dataclasses import dataclass

from raysim.config.limits import MAX_WAIT_S, finite, is_path, require

PROFILE_SOURCES = ("none", "sampled", "trace")
AGGREGATIONS = ("sync", "fedbuff", "fedasync")
MAX_STALENESS = 10_000  # past models the server may keep (the version window)
# Simulated seconds are exact float64 sums; beyond ~1e12 s (30,000 years) a sum of durations
# loses the millisecond, and no study simulates that long.
MAX_SIM_S = 1e12
MAX_RATE = 1e18  # FLOP/s or bytes/s: an exascale device is the most a profile may claim


@dataclass(frozen=True, kw_only=True)
class DevicesConfig:
    profiles: str = "none"  # none | sampled | trace
    trace: str | None = None  # the CSV trace file (profiles: trace)
    trace_period_s: float = 0.0  # availability windows repeat with this period (0: never)
    # sampled profiles: log-normal (median, sigma of the natural log)
    compute_median: float = 1e9  # FLOP/s
    compute_sigma: float = 0.0
    download_median: float = 1.25e6  # bytes/s (10 Mbit/s)
    download_sigma: float = 0.0
    upload_median: float = 6.25e5  # bytes/s (5 Mbit/s)
    upload_sigma: float = 0.0
    # sampled availability: online for `online_fraction` of every `period_s`, at a seeded
    # phase per client (1.0: always online)
    online_fraction: float = 1.0
    period_s: float = 3600.0
    # the work a sample costs; 0: derived from the model, 6 x its parameter count (a forward
    # and a backward pass, 2 + 4 FLOPs per parameter)
    flops_per_sample: float = 0.0
    # bytes sent each way per client; 0: 4 x the parameter count (a dense float32 model)
    payload_bytes: float = 0.0
    # synchronous rounds in simulated time
    deadline_s: float = 0.0  # 0: no deadline
    over_selection: float = 0.0  # sample ceil(K (1 + x)) online clients, keep the first K
    # time-to-accuracy: simulated seconds until eval[target_metric] first reaches target
    target_metric: str = "accuracy"
    target: float | None = None
    # asynchronous aggregation in simulated time (raysim.core.schedule.async_events): sync
    # (rounds as above) | fedbuff (Nguyen et al. 2022) | fedasync (Xie et al. 2019)
    aggregation: str = "sync"
    buffer_size: int = 0  # FedBuff's K: updates per server step; 0: clients.per_round
    concurrency: int = 0  # clients training at once; 0: clients.per_round
    staleness_exponent: float = 0.5  # s(tau) = (1 + tau)^-a, tau in server steps
    mixing: float = 0.6  # FedAsync's alpha: x <- (1 - alpha s) x + alpha s x_client
    max_staleness: int = 100  # the version window: past models the server keeps

    @property
    def asynchronous(self) -> bool:
        return self.aggregation != "sync"

    @property
    def enabled(self) -> bool:
        return self.profiles != "none"

    def check(self, source: str, resolve: bool = True) -> None:
        require(
            source,
            self.profiles in PROFILE_SOURCES,
            "devices.profiles",
            " | ".join(PROFILE_SOURCES),
            self.profiles,
        )
        if self.profiles == "trace":
            require(source, is_path(self.trace), "devices.trace", "a CSV file's path", self.trace)
        for key in ("compute_median", "download_median", "upload_median"):
            value = getattr(self, key)
            require(
                source,
                finite(value) and 0 < value <= MAX_RATE,
                f"devices.{key}",
                f"in (0, {MAX_RATE:g}]",
                value,
            )
        for key in ("compute_sigma", "download_sigma", "upload_sigma"):
            value = getattr(self, key)
            require(
                source, finite(value) and 0 <= value <= 10, f"devices.{key}", "in [0, 10]", value
            )
        require(
            source,
            0 < self.online_fraction <= 1,
            "devices.online_fraction",
            "in (0, 1]",
            self.online_fraction,
        )
        for key, low in (("period_s", 1e-3), ("trace_period_s", 0.0)):
            value = getattr(self, key)
            require(
                source,
                finite(value) and (value >= low) and value <= MAX_SIM_S,
                f"devices.{key}",
                f"seconds in [{low:g}, {MAX_SIM_S:g}]",
                value,
            )
        for key in ("flops_per_sample", "payload_bytes"):
            value = getattr(self, key)
            require(
                source,
                finite(value) and 0 <= value <= MAX_RATE,
                f"devices.{key}",
                f"in [0, {MAX_RATE:g}] (0: derived from the model)",
                value,
            )
        require(
            source,
            finite(self.deadline_s) and 0 <= self.deadline_s <= MAX_WAIT_S * 365,
            "devices.deadline_s",
            "simulated seconds >= 0 (0: none), at most a year",
            self.deadline_s,
        )
        require(
            source,
            finite(self.over_selection) and 0 <= self.over_selection <= 100,
            "devices.over_selection",
            "in [0, 100]",
            self.over_selection,
        )
        require(
            source,
            bool(self.target_metric),
            "devices.target_metric",
            "a metric name",
            self.target_metric,
        )
        require(
            source,
            self.target is None or finite(self.target),
            "devices.target",
            "a finite number or null",
            self.target,
        )
        require(
            source,
            self.aggregation in AGGREGATIONS,
            "devices.aggregation",
            " | ".join(AGGREGATIONS),
            self.aggregation,
        )
        if self.asynchronous:
            require(
                source,
                self.enabled,
                "devices.profiles",
                f"sampled or trace with devices.aggregation={self.aggregation}",
                self.profiles,
            )
            require(
                source,
                self.over_selection == 0,
                "devices.over_selection",
                "0 with asynchronous aggregation (over-selection is for synchronous rounds)",
                self.over_selection,
            )
        require(
            source,
            0 <= self.buffer_size <= 10**9,
            "devices.buffer_size",
            "a whole number in [0, 1e9] (0: clients.per_round)",
            self.buffer_size,
        )
        require(
            source,
            self.aggregation != "fedasync" or self.buffer_size in (0, 1),
            "devices.buffer_size",
            "0 or 1 with devices.aggregation=fedasync (one update a server step)",
            self.buffer_size,
        )
        require(
            source,
            0 <= self.concurrency <= 10**9,
            "devices.concurrency",
            "a whole number in [0, 1e9] (0: clients.per_round)",
            self.concurrency,
        )
        require(
            source,
            finite(self.staleness_exponent) and 0 <= self.staleness_exponent <= 10,
            "devices.staleness_exponent",
            "in [0, 10]",
            self.staleness_exponent,
        )
        require(
            source,
            finite(self.mixing) and 0 < self.mixing <= 1,
            "devices.mixing",
            "in (0, 1]",
            self.mixing,
        )
        require(
            source,
            0 <= self.max_staleness <= MAX_STALENESS,
            "devices.max_staleness",
            f"a whole number in [0, {MAX_STALENESS}]",
            self.max_staleness,
        )
