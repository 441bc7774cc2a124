"""Ray backend: stateless client tasks, one server actor, data in the object store.

Per run, the training arrays and the CSR split (indices + offsets) are put in the object store
once; per round the server actor puts the global payload once and every client task reads it
from there (zero-copy for numpy arrays). A task trains several clients one after another
(`clients.per_task`), which amortises Ray's per-task cost. The actor receives the tasks' result
references and folds updates in as tasks finish (`ray.wait`), holding back any task that
finishes before an earlier one so the reduction is always in client-id order.

`RayBackend` composes the parts, one module each: the cluster connection (ray_cluster), the
remote functions the workers run (ray_tasks), the server actor and the driver's handle on it
(ray_server), one round's tasks with their retries, deadline and faults (ray_round), and where
a round's clients train (ray_placement).
"""

from __future__ import annotations

import os

import ray

from raysim.core.algorithm import RunContext
from raysim.core.backend import RuntimeAttachments
from raysim.core.faults import ServerLost
from raysim.core.server import ServerData, build_algorithm
from raysim.core.state import RoundInfo, RoundStats, ServerState
from raysim.data.datasets import Dataset
from raysim.data.partition import ClientSplit
from raysim.runtime import client_state
from raysim.runtime.ray_cluster import (
    alive_nodes,
    check_resources_fit,
    client_slots,
    connect,
    disconnect,
    granted_gpus,
    ship_plugins_by_value,
)
from raysim.runtime.ray_placement import ClientPlacement, gpu_slots
from raysim.runtime.ray_server import ServerHandle
from raysim.runtime.ray_tasks import load_dataset_in_cluster, put_run_bundle


def build_index_with_actors(backend: str, num_rows: int, dim: int, *, shards: int = 1, **kw):
    """raysim.index.build_index with shards as Ray actors when there are several."""
    from raysim.index import build_index

    return build_index(backend, num_rows, dim, shards=shards, use_ray=shards > 1, **kw)


# A state up to this size is copied once a round run ahead in the server actor (for a
# checkpoint of the round before): well under a millisecond, less than the round trip saved.
RUN_AHEAD_STATE_BYTES = 4 * 1024 * 1024


class RayBackend(ClientPlacement):
    name = "ray"

    @classmethod
    def start(cls, config, address: str | None, prepare) -> RayBackend:
        """Connect to (or start) Ray, load the data in a task, split it (`prepare`), start the
        server actor. A Ray this call started is shut down by `shutdown`."""
        started_ray = connect(config.runtime, address)
        if not started_ray:
            ship_plugins_by_value()
        try:
            check_resources_fit(config)
            dataset, train_x_ref = load_dataset_in_cluster(config)
            clients_gpus, server_gpus = granted_gpus(
                config, ray.cluster_resources().get("GPU", 0.0)
            )
            attachments = RuntimeAttachments(
                # a store actor only if the algorithm uses one
                client_state=client_state.store_for(config, "ray"),
                # index shards beyond the first become actors (FedAwS's nearest-class index)
                index_builder=build_index_with_actors,
                clients_num_gpus=clients_gpus,
                server_num_gpus=server_gpus,
            )
            plan = prepare(dataset, attachments)  # the RunPlan (raysim.assembly.plan), whole
            backend = cls(plan.ctx, dataset, plan.split, train_x_ref, plan.schedule)
        except BaseException:
            if started_ray:
                disconnect()
            raise
        backend.started_ray = started_ray
        return backend

    def __init__(
        self,
        ctx: RunContext,
        dataset: Dataset,
        split: ClientSplit,
        train_x_ref: ray.ObjectRef,
        schedule=None,
    ) -> None:
        """Ray must be connected (see `connect`); `ctx` is the plan's run context (built with
        this backend's RuntimeAttachments); `train_x_ref` holds the training features."""
        self.ctx = ctx
        self.dataset, self.split = dataset, split
        self.started_ray = False
        run_ref = put_run_bundle(ctx, build_algorithm(ctx), train_x_ref, dataset, split)
        # The server's data in the object store once (a restarted actor reads it again).
        server_args = (ctx, [run_ref], ray.put(ServerData.of(dataset, split, schedule)))
        # (server.num_gpus as granted: granted_gpus, in the plan's config)
        self.server = ServerHandle(server_args, ctx.config.server.num_gpus)
        self.restarts = 0
        # Test hook: RAYSIM_TEST_KILL_SERVER_AT_ROUND=r kills the server actor once, while it
        # runs round r (1-based), as a crashed server would die.
        kill_at = os.environ.get("RAYSIM_TEST_KILL_SERVER_AT_ROUND")
        self._kill_server_at = int(kill_at) if kill_at else None
        clients = ctx.config.clients
        self._init_placement(client_slots(clients.num_cpus), gpu_slots(clients))
        # A round queued ahead in the server actor (round index, its call), whether rounds
        # may be (None: not asked yet), and the rounds the loop has been handed.
        self._ahead: tuple[int, ray.ObjectRef] | None = None
        self._ahead_allowed: bool | None = None
        self._rounds_done: int | None = None

    def run_round(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None = None
    ) -> RoundStats:
        self._record_round_time(info.round_index)
        chunks = self._chunks(info)
        next_round = None if next_info is None else (next_info, self._chunks(next_info))
        ahead, self._ahead = self._ahead, None
        actor = self.server.actor
        if ahead is not None and ahead[0] == info.round_index:
            call = ahead[1]  # queued behind the round before; evaluated now if asked
            evaluation = actor.evaluation.remote() if evaluate else None
        else:
            call = actor.run_round.remote(info, chunks, evaluate, next_round)
            evaluation = None
        # A small next round trained in the server actor is queued right behind this one:
        # the actor runs it while this call returns and the driver logs, instead of waiting
        # a round trip for the driver's next call (rounds of a few ms: a quarter of each).
        if next_round is not None and next_round[1] is None and self._runs_ahead():
            self._ahead = (next_info.round_index, actor.run_round_ahead.remote(next_info))
        # (the next round's clients may start training in the server during this call)
        self._server_busy = chunks is None or (next_round is not None and next_round[1] is None)
        if self._kill_server_at == info.round_index + 1:
            self._kill_server_at = None
            self.server.kill()
        stats = self._get(call)
        if stats is None:  # the round ahead found the state elsewhere than at its start
            self._ahead, self._ahead_allowed = None, False  # (what is queued runs nothing)
            stats = self._get(actor.run_round.remote(info, chunks, evaluate, next_round))
            evaluation = None
        if evaluation is not None:
            evaluated = self._get(evaluation)
            stats.eval, stats.val, stats.evaluate_s = (
                evaluated.eval,
                evaluated.val,
                evaluated.evaluate_s,
            )
        self._rounds_done = info.round_index + 1
        if evaluate:  # (an evaluation is not the clients' time either: see get_state)
            self._untimed_period()
        if stats.server_place_failed:
            self._stop_server_place(f"a client failed in it ({stats.server_place_failed})")
        self._record_client_seconds(stats)
        return stats

    def _runs_ahead(self) -> bool:
        """Whether rounds trained in the server actor may run one ahead: not with a client-
        state store (the round ahead would write round t+1's client state before round t's
        checkpoint), and only for a state small enough that the copy the actor keeps of it
        for a checkpoint of the round before costs less than the round trip saved."""
        if self._ahead_allowed is None:
            small = self._get(self.server.actor.state_nbytes.remote()) <= RUN_AHEAD_STATE_BYTES
            self._ahead_allowed = small and self.ctx.client_state is None
        return self._ahead_allowed

    def _get(self, call: ray.ObjectRef):
        """The result of a server actor call (ServerHandle.get: ServerLost if it died)."""
        try:
            return self.server.get(call)
        except ServerLost:
            self._server_lost()
            raise

    def restart(self, state: ServerState | None) -> None:
        """Replace a lost server actor by a new one holding `state` (a checkpointed state,
        client state store included), or, with None, the run's initial state: a new actor
        starts there (init_server is deterministic given the run seed), and the store empty.
        Actors the old server created (FedAwS's index shards) died with it; the algorithm
        rebuilds them from the restored state."""
        self.restarts += 1
        self._ahead, self._rounds_done = None, None
        self.server.replace()
        if state is not None:
            self.set_state(state)
        elif self.ctx.client_state is not None:
            self.ctx.client_state.restore({})

    def get_state(self) -> ServerState:
        """The state after the last round this backend returned (the actor may be a round
        ahead: run_round)."""
        # The driver's checkpoint between two rounds is not the clients' time: the period
        # around it is not timed for placement (a 10 ms checkpoint every 10 rounds made the
        # server actor look slower and sent the round after it to tasks, at 2x its time).
        self._untimed_period()
        call = self.server.actor.get_state.remote(self._rounds_done)
        return client_state.with_store(self._get(call), self.ctx)

    def set_state(self, state: ServerState) -> None:
        state = client_state.without_store(state, self.ctx)
        self._ahead, self._rounds_done = None, state.round
        self._get(self.server.actor.set_state.remote(state))

    def server_peak_rss_bytes(self) -> int:
        return self._get(self.server.actor.peak_rss_bytes.remote())

    def task_nodes(self) -> dict[str, int]:
        """How many client tasks ran on each node (by Ray node id) so far (since the server
        actor's last restart)."""
        return self._get(self.server.actor.task_nodes.remote())

    def placement(self) -> dict:
        """Where clients trained (summary.json's `placement`): client tasks on every live
        node, by address with the head marked (a node with 0 tasks is listed too: idle), and
        the clients trained in the server actor (`clients.per_task: auto`, ray_placement)."""
        counts = self.task_nodes()
        nodes = []
        for node in ray.nodes():
            node_id = node.get("NodeID", "")
            if not node.get("Alive") and node_id not in counts:
                continue
            nodes.append(
                {
                    "address": f"{node.get('NodeManagerAddress', '?')}:"
                    f"{node.get('NodeManagerPort', '?')}",
                    "name": node.get("NodeName"),
                    # Ray gives its head node this resource, and no other node
                    "head": "node:__internal_head__" in node.get("Resources", {}),
                    "node_id": node_id,
                    "client_tasks": counts.get(node_id, 0),
                }
            )
        nodes.sort(key=lambda n: (not n["head"], n["address"]))
        in_actor = self._get(self.server.actor.clients_in_actor.remote())
        return {"nodes": nodes, "clients_in_server_actor": in_actor, "packing": self.packing()}

    def describe(self) -> str:
        resources = ray.cluster_resources()
        nodes = len(alive_nodes())
        return (
            f"ray backend: {nodes} node(s), {resources.get('CPU', 0):g} CPUs, "
            f"{resources.get('GPU', 0):g} GPUs; {self.parallel_slots} client slots"
        )

    def shutdown(self) -> None:
        try:
            self.server.kill()
            if self.ctx.client_state is not None:
                self.ctx.client_state.shutdown()
        finally:
            if self.started_ray:
                disconnect()
