"""In-process backend: clients run sequentially in the driver. For tests and debugging.

Gives bit-identical results to the Ray backend for the same config and seed.
"""

from __future__ import annotations

import time

from raysim.core.algorithm import RunContext
from raysim.core.backend import RuntimeAttachments
from raysim.core.clients import train_clients
from raysim.core.faults import FaultPlan, InjectedClientFailure
from raysim.core.server import Server, ServerData, build_algorithm
from raysim.core.state import RoundInfo, RoundStats, ServerState
from raysim.data.datasets import Dataset, load_dataset
from raysim.data.partition import ClientSplit
from raysim.errors import ConfigError
from raysim.runtime import client_state, collector
from raysim.runtime.allocator import tune_malloc


class LocalBackend:
    name = "local"

    @classmethod
    def start(cls, config, address: str | None, prepare) -> LocalBackend:
        """Load the data here, split it (`prepare`) and build the server in this process."""
        if address:
            raise ConfigError(
                f"runtime.backend 'local' runs in this process; it cannot join the cluster at "
                f"{address!r} (use runtime.backend: ray)"
            )
        dataset = load_dataset(config)
        # a client-state store in this process, only if the algorithm uses one
        attachments = RuntimeAttachments(client_state=client_state.store_for(config, "local"))
        plan = prepare(dataset, attachments)  # the RunPlan (raysim.assembly.plan), taken whole
        return cls(plan.ctx, dataset, plan.split, plan.schedule)

    def __init__(
        self, ctx: RunContext, dataset: Dataset, split: ClientSplit, schedule=None
    ) -> None:
        """`ctx`: the plan's run context (with its client-state store, if any)."""
        self.ctx = ctx
        tune_malloc(ctx.config.runtime.tune_malloc)  # this process trains the clients
        self.dataset = dataset
        self.split = split
        self.server = Server(ctx, ServerData.of(dataset, split, schedule))
        self.algorithm = build_algorithm(ctx)
        self._run_key = object()  # this run, for the garbage collector's settings (collector)

    def run_round(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None = None
    ) -> RoundStats:
        """One round, in-process (`next_info` is for backends that dispatch ahead)."""
        started = time.perf_counter()
        self.server.start_round(info)
        faults = FaultPlan.from_config(self.ctx.config)
        if faults is not None:
            return self._run_round_with_faults(info, evaluate, started)
        updates = train_clients(
            self.ctx,
            self.algorithm,
            self.server.payload(),
            self.dataset.train_x,
            self.dataset.train_y,
            self.split.indices,
            self.split.offsets,
            info.round_index,
            info.trained_ids,
            self.server.personal_payloads(info.trained_ids),
        )
        clients_s = time.perf_counter() - started
        self.server.add(updates)
        stats = self.server.finish_round(evaluate)
        stats.clients_s = stats.client_compute_s = clients_s
        stats.tasks = 1
        stats.trained_in = "this process"
        collector.after_round(self._run_key)
        return stats

    def _run_round_with_faults(self, info: RoundInfo, evaluate: bool, started: float) -> RoundStats:
        """Clients one at a time, each retried after an injected failure (hard exits are
        simulated as exceptions here) up to clients.max_retries times, then dropped: the same
        attempts, updates and drops as on the Ray backend (raysim.core.faults). No deadline:
        run.round_deadline_s needs the Ray backend, which can cancel a running client."""
        retries = 0
        for client_id in info.trained_ids:
            ids = info.trained_ids[info.trained_ids == client_id]
            for attempt in range(self.ctx.config.clients.max_retries + 1):
                try:
                    updates = train_clients(
                        self.ctx,
                        self.algorithm,
                        self.server.payload(),
                        self.dataset.train_x,
                        self.dataset.train_y,
                        self.split.indices,
                        self.split.offsets,
                        info.round_index,
                        ids,
                        self.server.personal_payloads(ids),
                        attempts=[attempt],
                    )
                except InjectedClientFailure:
                    self.server.record_failure(client_id)
                    continue
                self.server.add(updates)
                break
            else:
                self.server.drop(client_id)
            retries += attempt  # attempts after the first
        clients_s = time.perf_counter() - started
        stats = self.server.finish_round(evaluate)
        stats.clients_s = stats.client_compute_s = clients_s
        stats.tasks = len(info.trained_ids)
        stats.task_retries = retries
        stats.trained_in = "this process"
        return stats

    def restart(self, state: ServerState | None) -> None:
        """A fresh server at `state` (None: the initial state). The local server lives in this
        process, so it is never lost; this is for the protocol's sake."""
        self.server = Server(self.ctx, self.server.data)
        if state is not None:
            self.set_state(state)

    def get_state(self) -> ServerState:
        return client_state.with_store(self.server.get_state(), self.ctx)

    def set_state(self, state: ServerState) -> None:
        self.server.set_state(client_state.without_store(state, self.ctx))

    def server_peak_rss_bytes(self) -> int:
        from raysim.process_memory import peak_rss_bytes

        return peak_rss_bytes()  # the server lives in this process

    def describe(self) -> str:
        return "local backend (clients run sequentially in this process)"

    def task_nodes(self) -> None:
        """No client tasks: every client trains in this process."""
        return None

    def placement(self) -> None:
        """One place to train (this process): no placement to report in the summary."""
        return None

    def shutdown(self) -> None:
        collector.release()
