"""The configured algorithm run asynchronously (`devices.aggregation` fedbuff | fedasync):
which methods can (`async_problem`), and the wrapper that runs them (`AsyncAggregation`).

The schedule itself (who trains when, on which version, the staleness weights) is
raysim.core.schedule.async_events's; docs/SIMULATED_TIME.md describes both.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from raysim.core.algorithm import AlgorithmHooks
from raysim.core.schedule.async_events import WINDOW_PREFIX, AsyncSchedule
from raysim.core.state import ServerState
from raysim.errors import ConfigError, RaysimError

# The wrapped method's hooks AsyncAggregation forwards unchanged, those async_problem refuses,
# and those the wrapper provides itself.
FORWARDED = (
    "labels",
    "update_delta_of",
    "default_codec",
    "configurable_codec",
    "update_layout",
    "shared_mask",
    "check_aggregator",
    "state_restored",
)
REFUSED = (
    "task_reducer",
    "merge_reduced",
    "finish_reduced",
    "uses_client_state",
    "observe_contributions",
    "batched_client_updates",
    "batching_problem",
    "asynchronous_problem",
)
OWN = ("client_payload", "weigh_update")


def async_problem(algorithm: Any, config: Any) -> str | None:
    """Why `algorithm` (with `config`) cannot run asynchronously, or None."""
    hooks = AlgorithmHooks.of(algorithm)
    name = config.algorithm.name
    if hooks.reduces_in_task:
        return (
            f"algorithm '{name}' reduces its clients' updates inside the tasks, so the server "
            "never holds one update to weigh by its staleness"
        )
    if hooks.client_payload is not None:
        return (
            f"algorithm '{name}' sends each client a personal payload, which the version "
            "window does not keep"
        )
    if hooks.uses_client_state:
        return (
            f"algorithm '{name}' keeps per-client state between rounds (personalised); "
            "trainings that overlap in time would write it out of order"
        )
    if hooks.asynchronous_problem is not None:  # the method's own declaration decides
        own = hooks.asynchronous_problem(config)
        if own:
            return f"algorithm '{name}' {own}"
    elif hooks.observe_contributions is not None:
        return (
            f"algorithm '{name}' keeps per-client results beside the aggregate "
            "(observe_contributions): its server step is not a function of the aggregate"
        )
    if hooks.update_delta_of is None:
        return (
            f"algorithm '{name}' sends updates that are not deltas of a server array "
            "(no update_delta_of; FRL's are a vote of rank positions), so a stale one "
            "cannot be weighed or mixed"
        )
    codec = config.codec.name if config.codec.name != "auto" else hooks.default_codec
    if config.devices.aggregation == "fedasync" and codec == "signs":
        return (
            f"algorithm '{name}' sends signs (codec 'signs'), a vote, not a model delta "
            "that FedAsync could mix; use devices.aggregation: fedbuff"
        )
    if config.attack.name != "none":
        return (
            f"attack '{config.attack.name}' colludes within a synchronous round; set "
            "attack.name: none"
        )
    if config.clients.batched:
        return "clients.batched trains a task's clients on one payload; set clients.batched: false"
    return None


def check_async(algorithm: Any, config: Any) -> None:
    problem = async_problem(algorithm, config)
    if problem:
        raise ConfigError(f"devices.aggregation={config.devices.aggregation}: {problem}")


class AsyncAggregation:
    """The configured algorithm run asynchronously (see the module docstring): its state plus
    the version window, each client's payload from its version, each update weighed by its
    staleness (and FedAsync's mix). Built by raysim.core.server.build_algorithm: the server's
    with the run's event schedule; the clients' without one (`schedule` None), since a client
    only trains on the payload of its version. Everything else is the wrapped algorithm's."""

    def __init__(self, inner: Any, schedule: AsyncSchedule | None, config: Any) -> None:
        check_async(inner, config)
        self.inner, self.schedule = inner, schedule
        self.name = config.algorithm.name
        # the wrapped algorithm's declarations and hooks that stay valid asynchronously
        # (AlgorithmHooks reads them from here); every other hook is refused by async_problem
        # or replaced below (FORWARDED, REFUSED, OWN: tests/test_async_time.py checks that
        # they cover AlgorithmHooks)
        hooks = AlgorithmHooks.of(inner)
        self.default_aggregator = inner.default_aggregator
        for name, value in vars(hooks).items():  # (the record's fields, not the algorithm)
            if name in FORWARDED and value is not None:
                setattr(self, name, value)

    def _events(self) -> AsyncSchedule:
        if self.schedule is None:
            raise RuntimeError(
                "a client-side AsyncAggregation has no event schedule: only the server's "
                "(built from its ServerData) weighs updates and keeps versions"
            )
        return self.schedule

    # --- state and the version window ----------------------------------------------------------
    @staticmethod
    def inner_state(state: ServerState) -> ServerState:
        return ServerState(
            state.round,
            {k: v for k, v in state.arrays.items() if not k.startswith(WINDOW_PREFIX)},
        )

    @staticmethod
    def _stored_versions(state: ServerState) -> dict[int, dict[str, np.ndarray]]:
        versions: dict[int, dict[str, np.ndarray]] = {}
        for key, value in state.arrays.items():
            if key.startswith(WINDOW_PREFIX):
                version, name = key[len(WINDOW_PREFIX) :].split(".", 1)
                versions.setdefault(int(version), {})[name] = value
        return versions

    def version_arrays(self, state: ServerState, version: int) -> dict[str, np.ndarray]:
        """The arrays of model `version` (<= state.round). A version missing from the window is
        one whose server step left the model as it was (every update refused): the next stored
        version, or the current state, equals it."""
        if version >= state.round:
            return self.inner_state(state).arrays
        stored = self._stored_versions(state)
        later = [v for v in stored if v >= version]
        if not later:
            return self.inner_state(state).arrays
        return stored[min(later)]

    def init_server(self, ctx: Any) -> ServerState:
        return self.inner.init_server(ctx)  # state 0: no past version yet

    def server_update(self, state: ServerState, aggregate: Any, ctx: Any):
        current = self.inner_state(state)
        returned = self.inner.server_update(current, aggregate, ctx)
        pair = isinstance(returned, tuple) and len(returned) == 2
        if not (pair and isinstance(returned[0], ServerState)):
            return returned  # refused by the server in its one line (Server._checked_update)
        result, diagnostics = returned
        arrays = dict(result.arrays)
        stored = self._stored_versions(state)
        for version in self._events().window(result.round):
            source = current.arrays if version == state.round else stored.get(version)
            if source is None:
                source = self.version_arrays(state, version)
            for name, value in source.items():
                arrays[f"{WINDOW_PREFIX}{version}.{name}"] = value
        return ServerState(result.round, arrays), diagnostics

    # --- what crosses the wire -----------------------------------------------------------------
    def server_payload(self, state: ServerState) -> None:
        return None  # every client receives its own version's payload (client_payload)

    def client_payload(self, state: ServerState, client_ids: np.ndarray, client_classes):
        payloads, by_version = [], {}
        for client_id in np.asarray(client_ids).tolist():
            version = self._events().version_of(state.round, client_id)
            if version not in by_version:
                arrays = self.version_arrays(state, version)
                by_version[version] = self.inner.server_payload(ServerState(version, arrays))
            payloads.append(by_version[version])
        return payloads

    def client_update(self, payload, x, y, client_id, generator, ctx):
        _, own = payload
        return self.inner.client_update(own, x, y, client_id, generator, ctx)

    def weigh_update(self, state: ServerState, round_index: int, client_id: int, vector):
        """The update the server folds: s(tau) x the update (FedBuff); alpha s(tau) x (the
        update + x_tau - x_{t-1}), its model's move from the current one (FedAsync)."""
        schedule = self._events()
        weight = schedule.weight(round_index, client_id)
        if np.issubdtype(np.asarray(vector).dtype, np.integer) and schedule.fedasync:
            raise RaysimError(
                f"devices.aggregation=fedasync mixes models, but algorithm '{self.name}' "
                f"sends integer updates ({np.asarray(vector).dtype}: a vote, not a delta); use "
                "devices.aggregation: fedbuff"
            )
        weighed = weight * np.asarray(vector, dtype=np.float64)
        if schedule.fedasync:
            name = self.update_delta_of
            version = schedule.version_of(round_index, client_id)
            if version < state.round:
                start = self.version_arrays(state, version)[name]
                drift = start.astype(np.float64) - state.arrays[name].astype(np.float64)
                weighed = weighed + weight * drift
        return weighed

    def evaluate(self, state: ServerState, x, y, ctx):
        return self.inner.evaluate(self.inner_state(state), x, y, ctx)
