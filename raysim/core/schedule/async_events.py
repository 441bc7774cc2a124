"""Asynchronous aggregation in simulated time: FedBuff and FedAsync (`devices.aggregation`;
docs/SIMULATED_TIME.md).

A client's simulated duration depends only on its device profile and its work (samples x
epochs x the cost of a sample, payload bytes over its links), never on model values, so the
whole asynchronous schedule is a function of the seed and the profiles and is computed before
anything trains (`AsyncSchedule`):

- `concurrency` C clients train at once. At simulated time 0, C clients are drawn among those
  online; whenever one finishes, goes offline mid-training or passes `deadline_s` (a timeout
  in asynchronous time), its slot is given to a client drawn among the idle online ones (not
  training, no update waiting in the buffer), which starts on the server's current model.
- Events are processed in simulated-time order, ties broken by client id. A finished client's
  update enters the buffer; when the buffer holds K updates (`buffer_size`; FedAsync: K = 1)
  the server takes one step and its model version goes up by one.
- One loop round = one server step. Its clients are those whose updates land in it, each
  trained on the model version it started from; its staleness tau = (the step) - (that
  version), in server steps.

The server step weighs every update by s(tau) = (1 + tau)^-a (`staleness_exponent` a, the
polynomial staleness function of Xie et al. 2019, which Nguyen et al. 2022 use with a = 0.5):

- FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation",
  AISTATS 2022): the aggregate of the step is the configured aggregator over s(tau_i) Delta_i
  (`aggregator.name: mean` gives the paper's (1/K) sum_i s(tau_i) Delta_i; the default
  weighted mean weighs by samples, sum_i n_i s(tau_i) Delta_i / sum_i n_i), applied by the
  algorithm's server step (FedAvg's server optimizer: x <- x + server.lr x aggregate).
- FedAsync (Xie et al., "Asynchronous Federated Optimization", 2019): K = 1 and the server
  mixes x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new with alpha_t = alpha s(tau) (`mixing`),
  x_new = x_tau + Delta the client's model; the update handed to the server step is
  alpha s(tau) (Delta + x_tau - x_{t-1}), which FedAvg's server step (sgd, server.lr = 1)
  turns into exactly that mix.

The server keeps a bounded window of past models (`max_staleness`): version v is kept in the
server state (arrays `async.v<v>.<name>`, so checkpoints and resumes carry it) for as long as
a client that started on it has not landed. A config whose schedule lands an update staler
than the bound within its rounds is refused in one line before anything trains.

raysim.core.async_aggregation's `AsyncAggregation` wraps the configured algorithm: each client
receives the payload of its version (a personal payload, raysim.core.algorithm's
`client_payload`), the server weighs each update (`weigh_update`) and keeps the window
(`server_update`). Every method whose server step is a function of the aggregate can run so;
the others are refused in one line (`async_problem` there).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.core.schedule.sync_clock import SimClock, SimTally
from raysim.core.state import RoundInfo
from raysim.errors import RaysimError
from raysim.seeds import async_sampling_rng

WINDOW_PREFIX = "async.v"  # server state arrays of past model versions: async.v<v>.<name>
MAX_WAITS = 10_000  # jumps to the next availability window before a stalled schedule is refused
_FINISH, _OFFLINE, _LATE = 0, 1, 2


def staleness_weight(staleness: np.ndarray | int, exponent: float) -> np.ndarray:
    """s(tau) = (1 + tau)^-a: 1 for a fresh update, smaller the more server steps it missed."""
    return (1.0 + np.asarray(staleness, dtype=np.float64)) ** -float(exponent)


@dataclass(frozen=True)
class AsyncStep:
    """One server step of the asynchronous schedule (its metrics.jsonl record's `sim`)."""

    index: int
    start_s: float
    end_s: float
    kept: np.ndarray  # ascending: the clients whose updates land in this step
    versions: np.ndarray  # the model version each of them trained on
    durations: np.ndarray  # their simulated training durations
    started: int  # clients dispatched during the step
    late: int  # given up at devices.deadline_s during the step
    offline: int  # went offline mid-training during the step
    in_flight: int  # training when the step was taken

    @property
    def staleness(self) -> np.ndarray:
        return self.index - self.versions

    def record(self) -> dict[str, Any]:
        staleness = self.staleness
        return {
            "start_s": self.start_s,
            "end_s": self.end_s,
            "round_s": self.end_s - self.start_s,
            "kept": len(self.kept),
            "started": self.started,
            "late": self.late,
            "offline": self.offline,
            "in_flight": self.in_flight,
            "staleness": staleness.tolist(),  # per landed client, in client-id order
            "staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "staleness_max": int(staleness.max()) if len(staleness) else 0,
        }


class AsyncSchedule:
    """The whole asynchronous schedule of a run, computed from the seed and the profiles: its
    server steps (which clients land in each, on which version) and the version window."""

    def __init__(self, config: Any, clock: SimClock) -> None:
        """The schedule of `config`'s run on `clock`'s profiles and client durations (its
        `per_round` K is the default of the buffer and of the clients training at once)."""
        self.config = config
        devices = config.devices
        self.exponent = devices.staleness_exponent
        self.fedasync = devices.aggregation == "fedasync"
        self.mixing = devices.mixing if self.fedasync else 1.0
        self.bound = devices.max_staleness
        self.flops_per_sample, self.payload_bytes = clock.flops_per_sample, clock.payload_bytes
        n = len(clock.num_samples)
        k = 1 if self.fedasync else int(devices.buffer_size or clock.per_round)
        c = int(devices.concurrency or clock.per_round)
        if k > n:
            raise RaysimError(
                f"devices.buffer_size: {k} updates a server step, but the run has {n} clients "
                "(each client has at most one update in the buffer)"
            )
        self.buffer, self.concurrency = k, c
        self.steps = self._simulate(clock, config.run.rounds, k, c)
        self._index = [
            {int(cl): int(v) for cl, v in zip(s.kept, s.versions, strict=True)} for s in self.steps
        ]
        self._check_bound(config.run.rounds)
        # version v stays in the window (for states v+1 .. keep_until[v]) while a client that
        # started on it has not landed; landings staler than the bound (beyond the run's
        # rounds: none within them) keep nothing
        self.keep_until: dict[int, int] = {}
        for step in self.steps:
            for v in step.versions.tolist():
                if step.index - v <= self.bound:
                    self.keep_until[v] = max(self.keep_until.get(v, -1), step.index)

    def _check_bound(self, rounds: int) -> None:
        for step in self.steps[:rounds]:
            if len(step.kept) and int(step.staleness.max()) > self.bound:
                i = int(np.argmax(step.staleness))
                raise RaysimError(
                    f"devices.max_staleness={self.bound}: in round {step.index + 1} client "
                    f"{int(step.kept[i])}'s update is {int(step.staleness[i])} server steps "
                    f"stale (it started on version {int(step.versions[i])}); raise "
                    "devices.max_staleness (the server keeps that many past models) or lower "
                    "devices.concurrency"
                )

    # --- the event simulation ------------------------------------------------------------------
    def _simulate(self, clock: SimClock, rounds: int, k: int, c: int) -> list[AsyncStep]:
        config, profiles = self.config, clock.profiles
        deadline = config.devices.deadline_s or math.inf
        n = profiles.num_clients
        rng = async_sampling_rng(config.run.seed)
        busy = np.zeros(n, dtype=bool)  # training, or its update waiting in the buffer
        heap: list[tuple[float, int, int, int, float]] = []  # (time, client, kind, version, d)
        buffer: list[tuple[int, int, float]] = []  # (client, version, duration)
        steps: list[AsyncStep] = []
        counts = {"started": 0, "late": 0, "offline": 0}
        state = {"free": c, "version": 0, "start": 0.0}

        def fill(t: float) -> None:
            if not state["free"]:
                return
            idle = np.flatnonzero(profiles.online(t) & ~busy)
            m = min(state["free"], len(idle))
            if not m:
                return
            chosen = np.sort(rng.choice(idle, size=m, replace=False)).astype(np.int64)
            took = clock.durations[chosen]
            for client, d in zip(chosen.tolist(), took.tolist(), strict=True):
                until = profiles.online_until(client, t)
                busy[client] = True
                state["free"] -= 1
                counts["started"] += 1
                if until < t + d:  # offline before it finishes: the server hears at `until`
                    heapq.heappush(heap, (until, client, _OFFLINE, state["version"], d))
                elif d > deadline:  # given up at the deadline
                    heapq.heappush(heap, (t + deadline, client, _LATE, state["version"], d))
                else:
                    heapq.heappush(heap, (t + d, client, _FINISH, state["version"], d))

        # Beyond the run's rounds the schedule continues until every client that started on
        # a version before the last one has landed (or the bound is passed), so the window a
        # checkpoint holds is the one a longer (resumed) run needs.
        horizon = rounds + self.bound + 1
        t, waits = 0.0, 0
        fill(t)
        while len(steps) < horizon:
            if (
                len(steps) >= rounds
                and not any(entry[3] < rounds for entry in heap)
                and not any(v < rounds for _, v, _ in buffer)
            ):
                break
            if not heap:  # nothing training: wait for an idle client to come online
                waits += 1
                following = _next_idle_online(profiles, ~busy, t)
                if math.isinf(following) or waits > MAX_WAITS:
                    if len(steps) >= rounds:
                        break
                    raise RaysimError(
                        f"devices: after round {len(steps)} no idle client comes online "
                        f"(simulated time {t:g} s; {int(busy.sum())} of {n} clients have an "
                        "update waiting); add clients, lower devices.buffer_size or set "
                        "devices.trace_period_s to repeat the trace's windows"
                    )
                t = max(following, np.nextafter(t, math.inf)) if following <= t else following
                fill(t)
                continue
            waits = 0
            t, client, kind, version, d = heapq.heappop(heap)
            state["free"] += 1
            if kind == _FINISH:
                buffer.append((client, version, d))
                if len(buffer) == k:
                    buffer.sort()
                    steps.append(
                        AsyncStep(
                            len(steps),
                            state["start"],
                            t,
                            np.array([b[0] for b in buffer], dtype=np.int64),
                            np.array([b[1] for b in buffer], dtype=np.int64),
                            np.array([b[2] for b in buffer], dtype=np.float64),
                            counts["started"],
                            counts["late"],
                            counts["offline"],
                            len(heap),
                        )
                    )
                    for b in buffer:
                        busy[b[0]] = False
                    buffer = []
                    counts = {"started": 0, "late": 0, "offline": 0}
                    state["version"] += 1
                    state["start"] = t
            else:
                busy[client] = False
                counts["late" if kind == _LATE else "offline"] += 1
            fill(t)
        if len(steps) < rounds:  # (the loop above raises first; a guard)
            raise RaysimError(f"devices: the asynchronous schedule ended after {len(steps)} rounds")
        return steps

    # --- what the round loop and the server read -----------------------------------------------
    def step(self, round_index: int) -> AsyncStep:
        return self.steps[round_index]

    round = step  # the name SimClock's rounds have (raysim.core.schedule)

    def info(self, round_index: int) -> RoundInfo:
        return RoundInfo(round_index, self.steps[round_index].kept)

    def version_of(self, round_index: int, client_id: int) -> int:
        try:
            return self._index[round_index][int(client_id)]
        except (IndexError, KeyError):
            raise RaysimError(
                f"devices: client {client_id} has no update in round {round_index + 1} of the "
                "asynchronous schedule"
            ) from None

    def window(self, state_round: int) -> list[int]:
        """The past versions the server keeps at state `state_round` (the current one aside)."""
        return sorted(v for v, until in self.keep_until.items() if v < state_round <= until)

    def weight(self, round_index: int, client_id: int) -> float:
        tau = round_index - self.version_of(round_index, client_id)
        return float(self.mixing * staleness_weight(tau, self.exponent))


def _next_idle_online(profiles: Any, idle: np.ndarray, t: float) -> float:
    """The earliest time >= t at which an `idle` client is online (inf: none ever is)."""
    restricted = np.zeros(profiles.num_clients, dtype=bool)
    restricted[profiles.win_client] = True
    if (idle & ~restricted).any():
        return t
    rows = idle[profiles.win_client]
    starts, ends = profiles.win_start[rows], profiles.win_end[rows]
    if not len(starts):
        return math.inf
    period = profiles.period
    tt = math.fmod(t, period) if period else t
    if ((starts <= tt) & (tt < ends)).any():
        return t
    wait = np.where(starts > tt, starts - tt, np.inf)
    if period:
        wait = np.minimum(wait, period - tt + starts)
    following = t + float(wait.min())
    if math.isinf(following):
        return following
    # land inside the window despite rounding (fmod of the sum may fall a few ulps short)
    for _ in range(64):
        if (profiles.online(following) & idle).any():
            return following
        following = np.nextafter(following, math.inf) + math.ulp(following) * 4
    return following


class AsyncTally:
    """summary.json's `sim` for an asynchronous run: the synchronous tally's facts plus the
    staleness distribution and every client's update count."""

    def __init__(self, base: SimTally) -> None:
        self.base = base  # the synchronous tally's facts
        self.staleness: list[int] = []
        self.started = 0

    def add(self, step: AsyncStep, record: dict[str, Any]) -> None:
        self.base.add(step, record)
        self.staleness.extend(step.staleness.tolist())
        self.started += step.started

    def summary(self) -> dict[str, Any]:
        summary = self.base.summary()
        values = np.asarray(self.staleness, dtype=np.int64)
        summary["aggregation"] = self.base.devices.aggregation
        summary["clients_started"] = self.started
        summary["staleness"] = {
            "mean": float(values.mean()) if len(values) else 0.0,
            "median": float(np.median(values)) if len(values) else 0.0,
            "max": int(values.max()) if len(values) else 0,
            # counts[tau]: updates that landed tau server steps after the version they used
            "counts": np.bincount(values).tolist() if len(values) else [],
        }
        return summary
