"""The schedule wing: which clients train in each round, and, with `devices:`, when, in
simulated time. One contract for the round loop, built once per run by `build`:

    schedule.info(round) -> RoundInfo       the round's clients (and the attacker's pool)
    schedule.add_record(round, record)      the round's `sim` record (nothing without devices:)
    schedule.summary() -> dict | None       summary.json's `sim` (None without devices:)

Three schedules stand behind it, one per file:

- `sampling.py`: no `devices:`: the seed's sample of K = `clients.per_round` clients (read
  once, by `clients_per_round` here, and handed to whichever schedule is built);
- `sync_clock.py`: synchronous rounds on device profiles (`profiles.py`): the online clients
  drawn, their simulated durations, deadlines and over-selection, and their tally;
- `async_events.py`: FedBuff / FedAsync: the event simulation, computed from the seed and the
  profiles before anything trains, and its tally.

The loop and the replays after a lost server follow the one schedule the assembly built.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from raysim.core.schedule.sampling import malicious_below, round_info
from raysim.core.schedule.sync_clock import SimClock, SimTally
from raysim.core.state import RoundInfo


def clients_per_round(config: Any) -> int:
    """K, the clients a synchronous round trains (and the default of FedBuff's buffer and of
    the clients training at once asynchronously): the one place the config's
    `clients.per_round` is read; `build` hands it to the schedule it builds."""
    return int(config.clients.per_round)


class RoundSchedule:
    """A run's schedule: `info` names each round's clients; with simulated time, `clock` (a
    SimClock or an AsyncSchedule) gives each round's simulated record and `tally` sums them."""

    def __init__(self, info, clock: Any = None, tally: Any = None) -> None:
        self._info, self.clock, self.tally = info, clock, tally

    def info(self, round_index: int) -> RoundInfo:
        return self._info(round_index)

    def add_record(self, round_index: int, record: dict[str, Any]) -> None:
        if self.clock is None:
            return
        sim = self.clock.round(round_index)
        record["sim"] = sim.record()
        self.tally.add(sim, record)

    def summary(self) -> dict[str, Any] | None:
        return None if self.tally is None else self.tally.summary()

    def resume_at(self, first: int, history: list[dict[str, Any]] | None) -> None:
        """A run resumed at round `first`: the simulated-time tally continues over the rounds
        before it (the clock recomputes them: their clients follow from the seed), their
        records from `history` (metrics.jsonl's)."""
        if self.clock is None:
            return
        records = {record.get("round"): record for record in history or []}
        for round_index in range(first):
            self.tally.add(
                self.clock.round(round_index),
                records.get(round_index + 1, {"round": round_index + 1}),
            )


def build(config: Any, sizes: np.ndarray, ctx: Any) -> RoundSchedule:
    """The run's schedule for clients of `sizes` samples: the seed's sample without
    `devices:`, else the simulated clock and its tally (`resume_at` continues the tally over
    the rounds before a resume); an asynchronous run's `clock` is its whole event simulation
    (async_events.AsyncSchedule, computed here before anything trains)."""
    num_clients, per_round = len(sizes), clients_per_round(config)
    if not config.devices.enabled:
        return RoundSchedule(functools.partial(round_info, config, num_clients, per_round))
    tally = SimTally(config.devices, num_clients)
    clock = SimClock(config, sizes, ctx, per_round)  # the profiles and the durations
    if config.devices.asynchronous:  # FedBuff / FedAsync
        from raysim.core.schedule.async_events import AsyncSchedule, AsyncTally

        clock, tally = AsyncSchedule(config, clock), AsyncTally(tally)
    return RoundSchedule(clock.info, clock, tally)


__all__ = ["RoundSchedule", "build", "clients_per_round", "malicious_below", "round_info"]
