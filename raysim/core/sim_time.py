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
    def __init__(self, config: Any, backend: Any) -> None:
        split = backend.split
        self.clock = SimClock(config, np.diff(split.offsets), backend.ctx)
        self.tally = SimTally(config.devices, split.num_clients)

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
    if config.devices.asynchronous:  # FedBuff / FedAsync (raysim.core.async_time)
        from raysim.core.async_time import AsyncRunClock

        clock = AsyncRunClock(config, backend)
    else:
        clock = RunClock(config, backend)
    records = {record.get("round"): record for record in history or []}
    for round_index in range(first):
        clock.tally.add(
            clock.clock.round(round_index), records.get(round_index + 1, {"round": round_index + 1})
        )
    return clock
