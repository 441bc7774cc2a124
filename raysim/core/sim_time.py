"""The round loop's side of simulated time (raysim.core.sim_clock): built once when a run has
`devices:` profiles, it names each round's clients, writes the round's `sim` record and keeps
the run's participation and time-to-target. Without `devices:` it is never built and the loop
is exactly what it was."""

from __future__ import annotations

from typing import Any

import numpy as np

from raysim.core.sim_clock import SimClock, SimTally
from raysim.core.state import RoundInfo


class RunClock:
    """A run's clock (a SimClock, or an async_time.AsyncSchedule) and its tally: both clocks
    give each round's clients (`info`) and the round's simulated record (`round`)."""

    def __init__(self, clock: Any, tally: Any) -> None:
        self.clock, self.tally = clock, tally

    def info(self, round_index: int) -> RoundInfo:
        return self.clock.info(round_index)

    def add_record(self, round_index: int, record: dict[str, Any]) -> None:
        sim = self.clock.round(round_index)
        record["sim"] = sim.record()
        self.tally.add(sim, record)

    def summary(self) -> dict[str, Any]:
        return self.tally.summary()


def start(
    config: Any, backend: Any, history: list[dict[str, Any]] | None, first: int
) -> RunClock | None:
    """The run's clock (None without `devices:`), its tally continued over the rounds before a
    resume (the clock recomputes them: their clients follow from the seed). Its `info` names
    each round's clients; the assembly hands it to the round loop and to the server keeper
    (replayed rounds after a lost server take the same clients)."""
    if not config.devices.enabled:
        return None
    sizes, num_clients = np.diff(backend.split.offsets), backend.split.num_clients
    if config.devices.asynchronous:  # FedBuff / FedAsync (raysim.core.async_time)
        from raysim.core.async_time import AsyncSchedule, AsyncTally

        schedule = backend.ctx.sim_schedule  # computed when the run was planned
        if schedule is None:  # a backend plug-in whose context lost the field
            schedule = AsyncSchedule(config, sizes, backend.ctx)
        clock = RunClock(schedule, AsyncTally(config.devices, num_clients))
    else:
        clock = RunClock(
            SimClock(config, sizes, backend.ctx), SimTally(config.devices, num_clients)
        )
    records = {record.get("round"): record for record in history or []}
    for round_index in range(first):
        clock.tally.add(
            clock.clock.round(round_index), records.get(round_index + 1, {"round": round_index + 1})
        )
    return clock
