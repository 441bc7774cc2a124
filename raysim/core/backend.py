"""The Backend protocol: how a run's clients are executed. The round loop (raysim.core.loop)
names no backend; it looks the configured one up in `raysim.registry.backends` ('local': in
this process; 'ray': client tasks and a server actor; or `package.module:Class` of your own).

A backend class provides

    @classmethod
    def start(cls, config, address, prepare) -> backend
        load the dataset where it belongs (the Ray backend loads it in a task, so the features
        go straight into the object store), then call `prepare(dataset, attachments) ->
        RunPlan` once (raysim.assembly.plan: `.split`, the client split, and `.ctx`, the run
        context, built once with the backend's `RuntimeAttachments`; a backend never rewrites
        it) and start the server. The started backend has `.dataset` (features may be left
        out of it), `.split` and `.ctx` (the plan's).

and, started:

    name: str
    run_round(info: RoundInfo, evaluate: bool, next_info: RoundInfo | None) -> RoundStats
        one round: the server's payload to `info.trained_ids`, their training, the server's
        fold of their updates in client-id order, the server update, evaluation when asked.
        `next_info`: the next round's clients, for backends that dispatch ahead.
    restart(state: ServerState | None)   a lost server (ServerLost) comes back at `state`
    get_state() -> ServerState;  set_state(state)
    server_peak_rss_bytes() -> int;  describe() -> str (one line for the run's header)
    task_nodes() -> dict[str, int] | None   client tasks per node id (None: no tasks)
    placement() -> dict | None   where clients trained, summary.json's `placement` (None: one
        place to train, nothing to report)
    shutdown()   release everything started, including a Ray the backend started itself

`check_backend` refuses a class that lacks one of these methods before anything starts, and
`check_started_backend` a started backend that lacks `name`, `dataset`, `split` or `ctx`, so a
plug-in missing a member the round loop uses fails in one line at start, not after its rounds.

Results must not depend on the backend: clients are trained from (seed, round, client id)
alone and updates are folded in client-id order (raysim.core.server.Server does the folding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from raysim.core.state import RoundInfo, RoundStats, ServerState


@dataclasses.dataclass(frozen=True)
class RuntimeAttachments:
    """What a backend brings to the run context, decided before the run is planned, so that
    the plan builds the context once (raysim.assembly.plan) and nothing rewrites it after.

    `client_state`: the explicit client-state store (raysim.runtime.client_state) of an
    algorithm that declares `uses_client_state`, else None. `index_builder`: how a
    nearest-class index's shards are built (raysim.index.build_index's signature; the Ray
    backend's puts shards in actors), None: in-process. `clients_num_gpus` /
    `server_num_gpus`: the GPUs the cluster can grant where it cannot meet the config's
    request (raysim.runtime.ray_cluster.granted_gpus), None: as configured."""

    client_state: Any = None
    index_builder: Any = None
    clients_num_gpus: float | None = None
    server_num_gpus: float | None = None


# prepare(dataset, attachments=None) -> the run's RunPlan (raysim.assembly.plan.plan_with),
# supplied by the assembly; None: the backend brings nothing, RuntimeAttachments() (a method
# with per-client state then needs `client_state=store_for(config, "local")`, else the server
# refuses it in one line).
Prepare = Callable[..., Any]


class Backend(Protocol):
    name: str
    dataset: Any
    split: Any
    ctx: Any

    @classmethod
    def start(cls, config: Any, address: str | None, prepare: Prepare) -> Backend: ...

    def run_round(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None = None
    ) -> RoundStats: ...

    def restart(self, state: ServerState | None) -> None: ...

    def get_state(self) -> ServerState: ...

    def set_state(self, state: ServerState) -> None: ...

    def server_peak_rss_bytes(self) -> int: ...

    def describe(self) -> str: ...

    def task_nodes(self) -> dict[str, int] | None: ...

    def placement(self) -> dict[str, Any] | None: ...

    def shutdown(self) -> None: ...


# Every method the round loop and the assembly call (raysim.core.loop, raysim.assembly).
REQUIRED = (
    "start",
    "run_round",
    "restart",
    "get_state",
    "set_state",
    "server_peak_rss_bytes",
    "describe",
    "task_nodes",
    "placement",
    "shutdown",
)
# Every attribute a started backend must have.
REQUIRED_ATTRIBUTES = ("name", "dataset", "split", "ctx")


def check_backend(backend_class: Any, name: str) -> None:
    """One line naming what a backend plug-in lacks."""
    from raysim.errors import ConfigError

    missing = [m for m in REQUIRED if not callable(getattr(backend_class, m, None))]
    if missing:
        raise ConfigError(
            f"backend '{name}' ({getattr(backend_class, '__name__', backend_class)}) lacks "
            f"{', '.join(missing)} (see raysim.core.backend)"
        )


def start_checked(
    backend_class: Any, name: str, config: Any, address: str | None, prepare: Prepare
) -> Backend:
    """`backend_class.start(config, address, prepare)`, the class checked before
    (`check_backend`) and the started backend after (`check_started_backend`)."""
    check_backend(backend_class, name)
    backend = backend_class.start(config, address, prepare)
    check_started_backend(backend, name)
    return backend


def check_started_backend(backend: Any, name: str) -> None:
    """One line naming the attributes a started backend lacks (it is shut down first)."""
    from raysim.errors import ConfigError

    missing = [a for a in REQUIRED_ATTRIBUTES if not hasattr(backend, a)]
    if missing:
        backend.shutdown()
        raise ConfigError(
            f"backend '{name}' ({type(backend).__name__}) started without "
            f"{', '.join(missing)} (see raysim.core.backend)"
        )
