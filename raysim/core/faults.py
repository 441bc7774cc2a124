"""Injected client faults and the attempt scheme that keeps runs deterministic under them.

The fault plan decides, for every (faults.seed, round, client id, attempt), through numpy's
SeedSequence, whether that attempt at training the client fails (a hard worker exit or an
exception) and whether it is a straggler (sleeps `straggler_delay_s` first). Nothing depends on
which task or worker trains the client, so the same clients fail at the same attempts for any
packing of clients into tasks, any number of workers, and either backend. A task meets the plan
for all its clients before it trains any (raysim.core.clients.train_clients), so a failed task
leaves nothing half-done (no client-state store write is repeated by a retry).

Attempts. Every client of a round starts at attempt 0; its counter advances only when that
client's own training failed (the server learns the culprit from the exception, or, for a
worker that died, from the plan: the first client of the task doomed at its current attempt;
a crash nobody explains is narrowed down by retrying the task's clients one per task). After a
failure at attempt `clients.max_retries` the client is dropped for the round. So whether a
client's update arrives, and which attempt produced it, is a function of (seed, round, client)
alone; and a retried client trains exactly as at its first attempt (its RNG derives from
(run seed, round, client), not the attempt), so the round's aggregate is the same as without
retries minus the dropped clients.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from raysim.errors import RaysimError
from raysim.seeds import fault_rng

EXCEPTION, EXIT = "exception", "exit"


class InjectedClientFailure(RuntimeError):
    """An injected failure of one client's training (an exception, or a hard exit simulated as
    one where the process must not die, e.g. the local backend)."""

    def __init__(self, client_id: int, round_index: int, attempt: int, kind: str = EXCEPTION):
        super().__init__(
            f"injected {kind} of client {client_id} in round {round_index + 1} (attempt {attempt})"
        )
        self.client_id, self.round_index, self.attempt, self.kind = (
            int(client_id),
            int(round_index),
            int(attempt),
            kind,
        )

    def __reduce__(self):  # picklable with its fields (crosses Ray's process boundary)
        return type(self), (self.client_id, self.round_index, self.attempt, self.kind)


class CapacityLost(RaysimError):
    """No node of the cluster could run a client task for LOST_CAPACITY_S: the round loop
    checkpoints the last finished round and stops with one line (raysim.runtime.ray_round)."""

    # The rounds finished when it was raised: set by the round loop (raysim.core.loop).
    rounds_done: int | None = None


# How long a round waits while no live node has the resources of one client task (its CPUs,
# its GPUs) before the run stops: long enough for a node to restart or an autoscaler to add one.
LOST_CAPACITY_S = 120.0


class CapacityWatch:
    """Time without a node that can run a client task; CapacityLost once it passes limit_s."""

    def __init__(self, cpus: float, gpus: float, limit_s: float = LOST_CAPACITY_S) -> None:
        self.cpus, self.gpus, self.limit_s = float(cpus), float(gpus), float(limit_s)
        self.since: float | None = None

    def check(self, nodes: list[dict], now: float) -> None:
        """`nodes`: ray.nodes()'s entries (Alive, Resources: the node's total resources)."""
        alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
        if any(r.get("CPU", 0.0) >= self.cpus and r.get("GPU", 0.0) >= self.gpus for r in alive):
            self.since = None
            return
        self.since = now if self.since is None else self.since
        if now - self.since < self.limit_s:
            return
        needs = f"{self.cpus:g} CPU" + (f" and {self.gpus:g} GPU" if self.gpus else "")
        most = max((r.get("CPU", 0.0) for r in alive), default=0.0)
        raise CapacityLost(
            f"no live node of the Ray cluster can run a client task (it needs {needs}; "
            f"{len(alive)} live node(s), the most CPUs on one: {most:g}) for "
            f"{self.limit_s:g} s: add a node with CPUs (or lower clients.num_cpus) and resume"
        )


class ServerLost(Exception):
    """The server (the Ray server actor, or an index shard it owns) died; the round loop
    restarts it from the newest checkpoint and replays the missing rounds."""


@dataclass(frozen=True)
class FaultPlan:
    failure_rate: float
    hard_exit_fraction: float
    straggler_rate: float
    straggler_delay_s: float
    seed: int

    @classmethod
    def from_config(cls, config) -> FaultPlan | None:
        """The run's plan, or None when no fault is configured."""
        faults = config.faults
        straggles = faults.straggler_rate > 0 and faults.straggler_delay_s > 0
        if faults.client_failure_rate <= 0 and not straggles:
            return None
        return cls(
            faults.client_failure_rate,
            faults.hard_exit_fraction,
            faults.straggler_rate if straggles else 0.0,
            faults.straggler_delay_s,
            faults.seed,
        )

    def _draws(self, round_index: int, client_id: int, attempt: int) -> np.ndarray:
        return fault_rng(self.seed, round_index, client_id, attempt).random(3)

    def failure(self, round_index: int, client_id: int, attempt: int) -> str | None:
        """EXIT, EXCEPTION or None: what happens to this attempt at training the client."""
        if self.failure_rate <= 0:
            return None
        fail, hard, _ = self._draws(round_index, client_id, attempt)
        if fail >= self.failure_rate:
            return None
        return EXIT if hard < self.hard_exit_fraction else EXCEPTION

    def straggles(self, round_index: int, client_id: int, attempt: int) -> bool:
        if self.straggler_rate <= 0:
            return False
        return bool(self._draws(round_index, client_id, attempt)[2] < self.straggler_rate)

    def inject(self, round_index: int, client_id: int, attempt: int, hard_exits: bool) -> None:
        """Called before a client trains: sleep if it straggles, then fail if it is doomed
        (`hard_exits`: a doomed EXIT really ends the process, as a crashed Ray worker)."""
        if self.straggles(round_index, client_id, attempt):
            time.sleep(self.straggler_delay_s)
        kind = self.failure(round_index, client_id, attempt)
        if kind is None:
            return
        if kind == EXIT and hard_exits:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(70)  # no cleanup, no exception: the worker process is gone
        raise InjectedClientFailure(client_id, round_index, attempt, kind)

    def crash_culprit(
        self, round_index: int, client_ids: np.ndarray, attempts: np.ndarray
    ) -> int | None:
        """Which client of a task whose worker died did it: the first one the plan dooms at
        its current attempt, if that doom is a hard exit (else the crash is not ours)."""
        for client_id, attempt in zip(client_ids, attempts, strict=True):
            kind = self.failure(round_index, int(client_id), int(attempt))
            if kind is not None:
                return int(client_id) if kind == EXIT else None
        return None
