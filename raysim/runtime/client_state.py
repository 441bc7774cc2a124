"""The explicit client state store: per-client arrays kept between rounds.

Clients are stateless tasks; a method that needs per-client memory (personal BatchNorm or
classifier layers, a local-only model, error feedback) reads and writes it here, keyed by client
id. The local backend keeps the store in-process; the Ray backend keeps it in one actor that
every client task and the server reach through a handle. Either way the store is part of the
run's state: backends fold it into the checkpointed `ServerState` under
`client_state/<client id>/<name>` and restore it from there, so a resumed run continues with the
same personal layers.

An algorithm opts in with the class attribute `uses_client_state = True`; it then finds the
store as `ctx.client_state` (in `client_update` and in `evaluate`). Writes of round t finish
before any client of round t+1 starts (a task returns only after its `put` is acknowledged), so
results stay identical on both backends.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from raysim.core.state import ServerState

PREFIX = "client_state/"


class InProcessClientState:
    """Per-client named arrays in a dict (the local backend; also the Ray actor's body)."""

    def __init__(self) -> None:
        self._states: dict[int, dict[str, np.ndarray]] = {}

    def get(self, client_id: int) -> dict[str, np.ndarray] | None:
        """A copy of the client's arrays, or None if it never stored anything."""
        stored = self._states.get(int(client_id))
        return None if stored is None else {k: v.copy() for k, v in stored.items()}

    def get_many(self, client_ids: Iterable[int]) -> dict[int, dict[str, np.ndarray] | None]:
        return {int(c): self.get(c) for c in client_ids}

    def put(self, client_id: int, arrays: Mapping[str, np.ndarray]) -> None:
        for name in arrays:
            if "/" in name:
                raise ValueError(f"client state names may not contain '/': {name!r}")
        self._states[int(client_id)] = {k: np.array(v, copy=True) for k, v in arrays.items()}

    def client_ids(self) -> list[int]:
        return sorted(self._states)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Every client's arrays as flat `client_state/<id>/<name>` entries (for checkpoints)."""
        return {
            f"{PREFIX}{client}/{name}": value
            for client in sorted(self._states)
            for name, value in sorted(self._states[client].items())
        }

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace the store's contents with a `snapshot`."""
        self._states = {}
        for key, value in arrays.items():
            client, _, name = key.removeprefix(PREFIX).partition("/")
            self._states.setdefault(int(client), {})[name] = np.array(value, copy=True)


class RayClientState:
    """Handle to the store actor; picklable, so it travels to client tasks inside the context."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def get(self, client_id: int) -> dict[str, np.ndarray] | None:
        import ray

        return ray.get(self.actor.get.remote(int(client_id)))

    def get_many(self, client_ids: Iterable[int]) -> dict[int, dict[str, np.ndarray] | None]:
        import ray

        return ray.get(self.actor.get_many.remote([int(c) for c in client_ids]))

    def put(self, client_id: int, arrays: Mapping[str, np.ndarray]) -> None:
        import ray

        # Wait for the acknowledgement: the write must land before the task returns.
        ray.get(self.actor.put.remote(int(client_id), dict(arrays)))

    def client_ids(self) -> list[int]:
        import ray

        return ray.get(self.actor.client_ids.remote())

    def snapshot(self) -> dict[str, np.ndarray]:
        import ray

        return ray.get(self.actor.snapshot.remote())

    def restore(self, arrays: Mapping[str, np.ndarray]) -> None:
        import ray

        ray.get(self.actor.restore.remote(dict(arrays)))

    def shutdown(self) -> None:
        import ray

        ray.kill(self.actor)


def uses_client_state(config) -> bool:
    """Whether the configured algorithm declares `uses_client_state = True`."""
    from raysim import registry
    from raysim.core.algorithm import AlgorithmHooks

    algorithm_class = registry.algorithms.get(config.algorithm.name)
    return bool(AlgorithmHooks.of(algorithm_class).uses_client_state)


def store_for(config, backend: str):
    """A fresh store for an algorithm that uses one (None otherwise): in this process for the
    local backend, a Ray actor for the Ray backend (its clients run in other processes)."""
    if not uses_client_state(config):
        return None
    if backend == "local":
        return InProcessClientState()
    import ray

    actor = ray.remote(num_cpus=0)(InProcessClientState).remote()
    return RayClientState(actor)


def with_store(state: ServerState, ctx) -> ServerState:
    """The server state plus the store's contents (what a checkpoint holds)."""
    store = ctx.client_state
    if store is None:
        return state
    return ServerState(state.round, {**state.arrays, **store.snapshot()})


def without_store(state: ServerState, ctx) -> ServerState:
    """Restore the store from a checkpointed state; returns the server's part of it."""
    store = ctx.client_state
    own = {k: v for k, v in state.arrays.items() if k.startswith(PREFIX)}
    if store is None:
        return state
    store.restore(own)
    return ServerState(state.round, {k: v for k, v in state.arrays.items() if k not in own})
