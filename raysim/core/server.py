"""The server: global state, aggregation of one round's updates, server update, evaluation.

This class is backend-agnostic. The local backend calls it in-process; the Ray backend wraps it
in an actor (runtime/ray_backend.py). Updates must be added in client-id order (the backends
guarantee it), which is what makes every backend and packing give bit-identical results.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np

from raysim import registry
from raysim.core.aggregators import LinearAccumulator
from raysim.core.algorithm import RunContext
from raysim.core.payload import encoded_nbytes
from raysim.core.state import ClientUpdate, RoundStats, ServerState


def build_algorithm(ctx: RunContext):
    algorithm = ctx.config.algorithm
    return registry.algorithms.build(algorithm.name, **algorithm.options)


class Server:
    def __init__(self, ctx: RunContext, test_x: np.ndarray, test_y: np.ndarray) -> None:
        self.ctx = ctx
        self.algorithm = build_algorithm(ctx)
        aggregator = ctx.config.aggregator
        self.aggregator = registry.aggregators.build(aggregator.name, **aggregator.options)
        self.state = self.algorithm.init_server(ctx)
        self.test_x, self.test_y = test_x, test_y
        self._payload_cache: tuple[int, object, int] | None = None

    # --- payload -------------------------------------------------------------------------------
    def payload(self):
        """The round's broadcast payload (computed once per state) and its encoded size."""
        if self._payload_cache is None or self._payload_cache[0] != self.state.round:
            payload = self.algorithm.server_payload(self.state)
            self._payload_cache = (self.state.round, payload, encoded_nbytes(payload))
        return self._payload_cache[1]

    def payload_nbytes(self) -> int:
        self.payload()
        return self._payload_cache[2]  # type: ignore[index]

    # --- one round -----------------------------------------------------------------------------
    def start_round(self, num_clients: int) -> None:
        self._stats = RoundStats(bytes_down=self.payload_nbytes() * num_clients)
        self._accumulator = LinearAccumulator() if self.aggregator.linear else None
        self._updates: list[ClientUpdate] = []
        self._loss_sum = 0.0
        self._loss_weight = 0.0
        self._norm_sum = 0.0
        self._aggregate_s = 0.0

    def add(self, updates: Iterable[ClientUpdate]) -> None:
        """Fold in updates, in client-id order. Linear aggregators keep O(model) memory."""
        started = time.perf_counter()
        stats = self._stats
        for update in updates:
            stats.clients_done += 1
            stats.bytes_up += update.bytes_up
            loss = update.metrics.get("loss", math.nan)
            if not math.isnan(loss) and update.num_samples:
                self._loss_sum += loss * update.num_samples
                self._loss_weight += update.num_samples
            self._norm_sum += float(np.linalg.norm(update.vector))
            if self._accumulator is not None:
                self._accumulator.add(update.vector, self.aggregator.weight(update))
            else:
                self._updates.append(update)
        self._aggregate_s += time.perf_counter() - started

    def finish_round(self, evaluate: bool) -> RoundStats:
        started = time.perf_counter()
        stats = self._stats
        if self._accumulator is not None:
            aggregate = self._accumulator.result()
        else:
            aggregate = self.aggregator.aggregate(self._updates)
        self.state = self.algorithm.server_update(self.state, aggregate, self.ctx)
        self._updates = []
        stats.aggregate_s = self._aggregate_s + time.perf_counter() - started
        if self._loss_weight:
            stats.train_loss = self._loss_sum / self._loss_weight
        if stats.clients_done:
            stats.update_norm_mean = self._norm_sum / stats.clients_done
        if evaluate:
            started = time.perf_counter()
            stats.eval = self.evaluate()
            stats.evaluate_s = time.perf_counter() - started
        return stats

    def evaluate(self) -> dict[str, float]:
        return self.algorithm.evaluate(self.state, self.test_x, self.test_y, self.ctx)

    # --- state ---------------------------------------------------------------------------------
    def get_state(self) -> ServerState:
        return self.state

    def set_state(self, state: ServerState) -> None:
        self.state = state
        self._payload_cache = None
