"""Each client's simulated device: compute speed (FLOP/s), download and upload bandwidth
(bytes/s) and availability (on/off windows in simulated seconds), drawn from the run seed
(`devices.profiles: sampled`) or read from a CSV trace (`devices.profiles: trace`); the format
and how FedScale's traces map onto it are in docs/SIMULATED_TIME.md. Nothing here reads a
clock: profiles are plain arrays, a function of the config (and the trace file) alone."""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raysim.errors import RaysimError
from raysim.seeds import profiles_rng

# A trace is input: bounded before it is read, so a wrong path (a device, a huge log) fails in
# one line instead of filling memory.
MAX_TRACE_BYTES = 256 * 2**20
MAX_TRACE_ROWS = 2_000_000
MAX_WINDOWS_PER_ROW = 10_000
TRACE_HEADER = ("client", "flops_per_s", "download_bps", "upload_bps", "online")
_MAX_RATE = 1e18


@dataclass(frozen=True)
class Profiles:
    """Per-client devices (arrays indexed by client id) and availability windows.

    Windows are flat arrays (`win_client`, `win_start`, `win_end`) of half-open intervals
    [start, end) in simulated seconds; with `period` > 0 they repeat every `period` seconds
    (each window then lies within [0, period]). A client with no window is always online."""

    flops: np.ndarray
    download: np.ndarray
    upload: np.ndarray
    win_client: np.ndarray
    win_start: np.ndarray
    win_end: np.ndarray
    period: float

    @property
    def num_clients(self) -> int:
        return len(self.flops)

    def online(self, t: float) -> np.ndarray:
        """Which clients are online at simulated time `t` (bool per client)."""
        restricted = np.zeros(self.num_clients, dtype=bool)
        restricted[self.win_client] = True
        tt = math.fmod(t, self.period) if self.period else t
        inside = (self.win_start <= tt) & (tt < self.win_end)
        online = ~restricted
        online[self.win_client[inside]] = True
        return online

    def next_online(self, t: float) -> float:
        """The earliest time >= t at which some client is online (inf: none ever is)."""
        if len(self.win_client) == 0 or self.online(t).any():
            return t
        tt = math.fmod(t, self.period) if self.period else t
        wait = np.where(self.win_start > tt, self.win_start - tt, np.inf)
        if self.period:
            wait = np.minimum(wait, self.period - tt + self.win_start)
        return t + float(wait.min())

    def online_until(self, client: int, t: float) -> float:
        """When client `client`, online at `t`, next goes offline (inf: never)."""
        rows = np.flatnonzero(self.win_client == client)
        if len(rows) == 0:
            return math.inf
        starts, ends = self.win_start[rows], self.win_end[rows]
        base = t - math.fmod(t, self.period) if self.period else 0.0
        now = t
        for _ in range(len(rows) + 2):  # windows touching at the period's end continue
            tt = now - base
            inside = np.flatnonzero((starts <= tt) & (tt < ends))
            if len(inside) == 0:
                return now
            end = base + float(ends[inside].max())
            if not self.period or ends[inside].max() < self.period:
                return end
            base, now = base + self.period, end
        return math.inf  # online through a whole period: always online


def sampled_profiles(devices, seed: int, num_clients: int) -> Profiles:
    """Log-normal speeds and bandwidths and a periodic window at a seeded phase per client."""
    rng = profiles_rng(seed)

    def lognormal(median: float, sigma: float) -> np.ndarray:
        return median * np.exp(sigma * rng.standard_normal(num_clients))

    flops = lognormal(devices.compute_median, devices.compute_sigma)
    down = lognormal(devices.download_median, devices.download_sigma)
    up = lognormal(devices.upload_median, devices.upload_sigma)
    phase = rng.uniform(0.0, devices.period_s, num_clients)
    empty = np.zeros(0)
    if devices.online_fraction >= 1.0:
        return Profiles(flops, down, up, empty.astype(np.int64), empty, empty, 0.0)
    period, on = devices.period_s, devices.online_fraction * devices.period_s
    ids = np.arange(num_clients, dtype=np.int64)
    end = phase + on
    wraps = end > period  # the window runs past the period's end: split in two
    win_client = np.concatenate([ids, ids[wraps]])
    win_start = np.concatenate([phase, np.zeros(int(wraps.sum()))])
    win_end = np.concatenate([np.minimum(end, period), end[wraps] - period])
    return Profiles(flops, down, up, win_client, win_start, win_end, period)


def read_trace(path: str | Path, num_clients: int, period: float) -> Profiles:
    """Profiles from a CSV trace (docs/SIMULATED_TIME.md); client i of the run gets the row
    of trace client i mod (rows). Refused in one line naming file:line when malformed."""
    path = Path(path)
    try:
        info = os.stat(path)
    except OSError as error:
        raise RaysimError(f"devices.trace: cannot read {path}: {error.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise RaysimError(f"devices.trace: {path} is not a regular file")
    if info.st_size > MAX_TRACE_BYTES:
        raise RaysimError(
            f"devices.trace: {path} has {info.st_size:,} bytes, more than {MAX_TRACE_BYTES:,}"
        )
    with open(path, "rb") as handle:
        raw = handle.read(MAX_TRACE_BYTES + 1)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise RaysimError(f"{path}:{line}: not UTF-8 text") from None
    rows: dict[int, tuple[float, float, float, list[tuple[float, float]]]] = {}
    header_seen = False
    for number, line in enumerate(text.splitlines(), start=1):
        if number > MAX_TRACE_ROWS:
            raise RaysimError(f"{path}:{number}: more than {MAX_TRACE_ROWS:,} lines")
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        if not header_seen:
            if tuple(fields) != TRACE_HEADER:
                raise RaysimError(
                    f"{path}:{number}: the header must be {','.join(TRACE_HEADER)}, "
                    f"got {line[:80]!r}"
                )
            header_seen = True
            continue
        client, values = _trace_row(fields, period, f"{path}:{number}")
        if client in rows:
            raise RaysimError(f"{path}:{number}: client {client} appears twice")
        rows[client] = values
    if not rows:
        raise RaysimError(f"{path}: no client rows (header {','.join(TRACE_HEADER)} and rows)")
    if sorted(rows) != list(range(len(rows))):
        missing = next(i for i in range(len(rows)) if i not in rows)
        raise RaysimError(
            f"{path}: clients must be numbered 0..{len(rows) - 1}; {missing} is missing"
        )
    source = np.arange(num_clients) % len(rows)
    flops = np.array([rows[i][0] for i in source])
    down = np.array([rows[i][1] for i in source])
    up = np.array([rows[i][2] for i in source])
    win = [(c, s, e) for c, i in enumerate(source) for s, e in rows[int(i)][3]]
    win_client = np.array([w[0] for w in win], dtype=np.int64)
    return Profiles(
        flops,
        down,
        up,
        win_client,
        np.array([w[1] for w in win], dtype=np.float64),
        np.array([w[2] for w in win], dtype=np.float64),
        period,
    )


def _trace_row(fields: list[str], period: float, where: str):
    if len(fields) != len(TRACE_HEADER):
        raise RaysimError(f"{where}: expected {len(TRACE_HEADER)} fields, got {len(fields)}")
    try:
        client = int(fields[0])
    except ValueError:
        raise RaysimError(f"{where}: client must be a whole number, got {fields[0]!r}") from None
    if client < 0:
        raise RaysimError(f"{where}: client must be >= 0, got {client}")
    rates = []
    for name, value in zip(TRACE_HEADER[1:4], fields[1:4], strict=True):
        try:
            rate = float(value)
        except ValueError:
            raise RaysimError(f"{where}: {name} must be a number, got {value!r}") from None
        if not (math.isfinite(rate) and 0 < rate <= _MAX_RATE):
            raise RaysimError(f"{where}: {name} must be in (0, {_MAX_RATE:g}], got {value!r}")
        rates.append(rate)
    windows = []
    parts = [p for p in fields[4].split(";") if p.strip()]
    if len(parts) > MAX_WINDOWS_PER_ROW:
        raise RaysimError(f"{where}: more than {MAX_WINDOWS_PER_ROW:,} online windows")
    for part in parts:
        try:
            start_text, end_text = part.split("-")
            start, end = float(start_text), float(end_text)
        except ValueError:
            raise RaysimError(
                f"{where}: online windows are start-end seconds separated by ';', got {part!r}"
            ) from None
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
            raise RaysimError(f"{where}: window {part!r} must have 0 <= start < end, finite")
        if period and end > period:
            raise RaysimError(
                f"{where}: window {part!r} ends after devices.trace_period_s={period:g}"
            )
        windows.append((start, end))
    return client, (rates[0], rates[1], rates[2], windows)
