"""Synchronous rounds in simulated time (`devices:`; docs/SIMULATED_TIME.md).

Before a round trains anything, its clients' fates are decided from their device profiles
(raysim.core.schedule.profiles): at the round's simulated start, ceil(K (1 + over_selection))
clients are drawn among those online (K = clients.per_round); each one's simulated duration
is its download, its compute (samples x local epochs x the cost of a sample, over its FLOP/s)
and its upload; a client whose availability window closes before it would finish is dropped
(offline mid-round); one slower than `devices.deadline_s` is late; of the rest, the first K to
finish are kept. Only the kept clients train, so an offline or late client is never trained
and the same clients make each round on any backend and packing: the run stays a function
of the seed alone. The round ends when the K-th kept client finishes (or at the deadline, when
fewer than K make it) and the next one starts there. Nothing sleeps.

The plan of round r depends on the rounds before it (the clock), so it is computed in order
and kept; a resumed or replayed run recomputes it from round 0, which trains nothing."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.core.schedule.profiles import Profiles, read_trace, sampled_profiles
from raysim.core.schedule.sampling import info_of
from raysim.core.state import RoundInfo
from raysim.errors import RaysimError
from raysim.seeds import sim_sampling_rng

MAX_ATTEMPTS = 10_000  # draws of one round before a deadline no client meets is refused


@dataclass(frozen=True)
class SimRound:
    """One round's simulated facts (its metrics.jsonl record's `sim`)."""

    start_s: float
    end_s: float
    kept: np.ndarray  # ascending: the clients that train
    selected: int  # drawn among the online clients
    late: int  # slower than the deadline
    offline: int  # went offline before finishing
    extra: int  # on time, but after the first K (over-selection)
    durations: np.ndarray  # of the kept clients, in the order of `kept`
    attempts: int = 1  # draws until some client made it (the late / offline of all of them)

    def record(self) -> dict[str, Any]:
        return {
            "start_s": self.start_s,
            "end_s": self.end_s,
            "round_s": self.end_s - self.start_s,
            "selected": self.selected,
            "kept": len(self.kept),
            "late": self.late,
            "offline": self.offline,
            "over_selected": self.extra,
            "attempts": self.attempts,
        }


def model_costs(ctx: Any) -> tuple[float, float]:
    """(FLOPs per training sample, payload bytes each way) derived from the model's parameter
    count, counted on the meta device (no memory, no random draws): 6 FLOPs per parameter per
    sample (forward 2, backward 4), 4 bytes per parameter (dense float32)."""
    import torch

    from raysim.models.vector import _build

    with torch.device("meta"):
        model = _build(ctx)
    count = sum(parameter.numel() for parameter in model.parameters())
    return 6.0 * count, 4.0 * count


class SimClock:
    """The simulated clock of a run: round r's clients and times, computed in order."""

    def __init__(self, config: Any, num_samples: np.ndarray, ctx: Any, per_round: int) -> None:
        devices = config.devices
        self.config, self.devices, self.per_round = config, devices, per_round
        self.num_samples = np.asarray(num_samples, dtype=np.float64)
        n = len(self.num_samples)
        if config.attack.name != "none" and config.attack.redraw_majority:
            raise RaysimError(
                "devices: attack.redraw_majority cannot be honoured in simulated time (the "
                "round's clients follow the device profiles); set attack.redraw_majority: false"
            )
        if devices.profiles == "trace":
            self.profiles: Profiles = read_trace(devices.trace, n, devices.trace_period_s)
        else:
            self.profiles = sampled_profiles(devices, config.run.seed, n)
        flops, payload = (0.0, 0.0)
        if not (devices.flops_per_sample and devices.payload_bytes):
            flops, payload = model_costs(ctx)
        self.flops_per_sample = devices.flops_per_sample or flops
        self.payload_bytes = devices.payload_bytes or payload
        # every client's simulated seconds of a round (download + compute + upload): a
        # function of its profile and its work only, computed once (elementwise, so a client's
        # value is the same whichever clients it is computed with)
        p = self.profiles
        work = self.num_samples * config.clients.local_epochs
        compute = work * self.flops_per_sample / p.flops
        self.durations = self.payload_bytes / p.download + compute + self.payload_bytes / p.upload
        self.rounds: list[SimRound] = []

    def round(self, round_index: int) -> SimRound:
        while len(self.rounds) <= round_index:
            start = self.rounds[-1].end_s if self.rounds else 0.0
            self.rounds.append(self._round_with_clients(len(self.rounds), start))
        return self.rounds[round_index]

    def _round_with_clients(self, round_index: int, start: float) -> SimRound:
        """A round in which some client makes it: an attempt in which none does (all late or
        offline) costs its simulated time and is drawn again, so a round always updates the
        model and the server never sees an empty round."""
        first = start
        late = offline = 0
        for attempt in range(MAX_ATTEMPTS):
            sim = self._plan(round_index, start, attempt)
            late, offline = late + sim.late, offline + sim.offline
            if len(sim.kept):
                return dataclasses.replace(
                    sim, start_s=first, late=late, offline=offline, attempts=attempt + 1
                )
            start = (
                sim.end_s
                if sim.end_s > start
                else self.profiles.next_online(np.nextafter(start, math.inf))
            )
        raise RaysimError(
            f"devices: in round {round_index + 1} no client finished in {MAX_ATTEMPTS} "
            f"attempts (devices.deadline_s={self.devices.deadline_s:g}: slower than every "
            "sampled client, or they all go offline first); raise devices.deadline_s"
        )

    def info(self, round_index: int) -> RoundInfo:
        """Round `round_index`'s RoundInfo: its kept clients (and the attacker's pool)."""
        ids = self.round(round_index).kept
        return info_of(self.config, len(self.num_samples), round_index, ids)

    def _plan(self, round_index: int, start: float, attempt: int) -> SimRound:
        devices, k = self.devices, self.per_round
        start = self.profiles.next_online(start)
        if math.isinf(start):
            raise RaysimError(
                f"devices: no client is ever online after round {round_index} (the trace's "
                "windows have ended; set devices.trace_period_s to repeat them)"
            )
        online = np.flatnonzero(self.profiles.online(start))
        rng = sim_sampling_rng(self.config.run.seed, round_index, attempt)
        wanted = min(len(online), math.ceil(k * (1.0 + devices.over_selection) - 1e-9))
        chosen = np.sort(rng.choice(online, size=wanted, replace=False)).astype(np.int64)
        took = self.durations[chosen]
        until = np.array([self.profiles.online_until(int(c), start) for c in chosen])
        offline = until < start + took
        deadline = devices.deadline_s or math.inf
        late = ~offline & (took > deadline)
        on_time = np.flatnonzero(~offline & ~late)
        # the first K to finish (ties by client id: `chosen` is ascending and the sort stable)
        first = on_time[np.argsort(took[on_time], kind="stable")][:k]
        kept = np.sort(first)
        if len(first) == k:
            end = start + float(took[first].max())
        elif devices.deadline_s:
            end = start + deadline
        else:  # the server learns of a drop when the client goes offline
            events = np.where(offline, until, start + took)
            end = float(events.max()) if len(events) else start
        return SimRound(
            start,
            end,
            chosen[kept],
            int(wanted),
            int(late.sum()),
            int(offline.sum()),
            int(len(on_time) - len(first)),
            took[kept],
        )


class SimTally:
    """Participation counts and time-to-target over a run (summary.json's `sim`)."""

    def __init__(self, devices: Any, num_clients: int) -> None:
        self.devices = devices
        self.participation = np.zeros(num_clients, dtype=np.int64)
        self.time_to_target: float | None = None
        self.target_round: int | None = None
        self.end_s = 0.0
        self.late = self.offline = 0

    def add(self, sim: SimRound, record: dict[str, Any]) -> None:
        np.add.at(self.participation, sim.kept, 1)
        self.end_s = sim.end_s
        self.late += sim.late
        self.offline += sim.offline
        value = (record.get("eval") or {}).get(self.devices.target_metric)
        target = self.devices.target
        if self.time_to_target is None and target is not None and value is not None:
            if value >= target:
                self.time_to_target, self.target_round = sim.end_s, record["round"]

    def summary(self) -> dict[str, Any]:
        counts = self.participation
        return {
            "sim_time_s": self.end_s,
            "target_metric": self.devices.target_metric,
            "target": self.devices.target,
            "time_to_target_s": self.time_to_target,
            "target_round": self.target_round,
            "clients_late": self.late,
            "clients_offline": self.offline,
            "participation": {
                "clients_ever": int((counts > 0).sum()),
                "min": int(counts.min()) if len(counts) else 0,
                "median": float(np.median(counts)) if len(counts) else 0.0,
                "max": int(counts.max()) if len(counts) else 0,
                # every client's count (left out beyond 100,000 clients)
                **({"per_client": counts.tolist()} if len(counts) <= 100_000 else {}),
            },
        }
