"""THE round loop. Every algorithm and both backends go through this one function; what it
needs is assembled before it starts (raysim.assembly: the data, the plan, the backend, the
outputs, the server-recovery wrapper).

for each round:
    sample clients (seeded by run seed and round)
    backend.run_round: send the payload, train clients, aggregate, update the server,
                       evaluate when due
    log the round (metrics.jsonl, TensorBoard, progress bar)
    checkpoint when due
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from raysim import interrupts
from raysim.config import RunConfig
from raysim.core.faults import CapacityLost
from raysim.core.run_record import RunTally, add_outcome, idle_reason, round_record
from raysim.core.schedule import RoundSchedule
from raysim.core.state import ServerState
from raysim.errors import RaysimError
from raysim.progress import Progress


def _test_kill_hook() -> int | None:
    """RAYSIM_TEST_KILL_AFTER_ROUND=r makes the driver SIGKILL itself after round r (tests)."""
    value = os.environ.get("RAYSIM_TEST_KILL_AFTER_ROUND")
    return int(value) if value else None


def evaluation_due(run: RunConfig, round_index: int) -> bool:
    """Whether the loop evaluates after round `round_index` (0-based): every `run.eval_every`
    rounds, the rounds of `run.eval_at`, and the last. (A backend that runs rounds ahead asks
    the same rule: raysim.runtime.ray_backend.)"""
    return (
        round_index == run.rounds - 1
        or (round_index + 1) % run.eval_every == 0
        or round_index + 1 in run.eval_at
    )


def run_rounds(
    run: RunConfig,
    backend: Any,
    outputs: Any,
    server: Any,
    *,
    schedule: RoundSchedule,
    first_round: int,
    history: list[dict[str, Any]] | None,
    on_round: Callable[[dict[str, Any]], None] | None,
    progress: bool,
) -> tuple[ServerState, RunTally, float]:
    """Rounds `first_round`..`run.rounds - 1` on the started `backend` (`run`: the config's
    `run:` section, all the loop reads of it: rounds, evaluation and checkpoint cadence, the
    idle-round bound), each logged to
    `outputs` (raysim.outputs.RunOutputs) and checkpointed when due; calls on the server go
    through `server.call(fn, rounds_done)` (raysim.assembly.recovery: a lost server is
    restarted). `schedule` (raysim.core.schedule) names each round's clients and, with
    `devices:`, writes each round's `sim` record. Returns the final state, the run's tally and
    the loop's wall time. `progress`: the loop's progress bar (raysim.progress: a bar on a
    terminal, a line every 10 s in a log).
    A CapacityLost carries the rounds finished (`rounds_done`) out to the caller."""
    rounds = run.rounds
    tally = RunTally(history)
    kill_after = _test_kill_hook()
    next_info = None
    idle: list[dict[str, Any]] = []  # records of the latest rounds in a row that trained nothing
    bar = Progress(rounds, first_round) if progress else None
    started = time.perf_counter()
    try:
        for round_index in range(first_round, rounds):
            round_started = time.perf_counter()
            info = next_info or schedule.info(round_index)
            # The next round's clients are known now (sampling depends on seed and round only),
            # so a backend may dispatch them as soon as this round's model exists.
            last = round_index == rounds - 1
            next_info = None if last else schedule.info(round_index + 1)
            evaluate = evaluation_due(run, round_index)
            server.new_round()
            try:
                stats = server.call(
                    lambda: backend.run_round(info, evaluate, next_info),  # noqa: B023
                    round_index,
                )
            except CapacityLost as error:
                error.rounds_done = round_index
                raise
            round_s = time.perf_counter() - round_started
            record = round_record(round_index, info, stats, round_s, time.perf_counter() - started)
            if server.restarts_in_round:  # the server died during this round and was restarted
                record["server_restarts"] = server.restarts_in_round
                record["replayed_rounds"] = server.replayed_in_round
            add_outcome(record, stats)
            schedule.add_record(round_index, record)
            tally.add(record, stats)
            for line in stats.rejected:
                print(f"raysim: {line}", file=sys.stderr, flush=True)
            outputs.log_round(record)
            if on_round is not None:
                on_round(record)
            every = run.checkpoint_every
            # SIGTERM: stop here, this round checkpointed (raysim.interrupts)
            stopping = interrupts.stop_requested() and not last
            if last or stopping or (every and (round_index + 1) % every == 0):
                state = server.call(backend.get_state, round_index + 1)
                outputs.save_checkpoint(state, backend.ctx.data_shape())
            if stopping:
                raise interrupts.Terminated
            idle = idle + [record] if not stats.model_updated else []
            if run.max_idle_rounds and len(idle) >= run.max_idle_rounds:
                raise RaysimError(idle_reason(idle, run.max_idle_rounds))
            if kill_after == round_index + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # test hook: a driver killed mid-run
            if bar is not None:
                bar.update(tally.latest(), stats.trained_in)
    finally:
        if bar is not None:
            bar.close()
    wall_s = time.perf_counter() - started
    tally.sim = schedule.summary()
    return server.call(backend.get_state, rounds), tally, wall_s
