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

import dataclasses
import os

import numpy as np
import ray

from raysim.core.algorithm import RunContext
from raysim.core.backend import RuntimeAttachments
from raysim.core.faults import ServerLost
from raysim.core.loop import evaluation_due
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
# Rounds run ahead go to the server actor in blocks, one call each, of about BLOCK_SECONDS of
# rounds: a call's round trip costs ~0.4 ms on 2 cores (a sixth of a 3 ms round of 10 digits
# clients), paid once a block. At most MAX_BLOCK_ROUNDS rounds, and no more copies of the state
# (one a round, kept for checkpoints until the driver takes the round) than BLOCK_STATE_BYTES;
# rounds of BLOCK_SECONDS or more run one ahead, as single-round blocks.
BLOCK_SECONDS = 0.02
MAX_BLOCK_ROUNDS = 16
BLOCK_STATE_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass
class RoundsAhead:
    """Rounds queued ahead in the server actor as one call (`ServerActor.run_rounds_ahead`):
    their infos, whether each is evaluated, the call, and its stats once fetched (a list that
    ends early where the block stopped)."""

    infos: list[RoundInfo]
    evaluates: list[bool]
    call: ray.ObjectRef
    stats: list[RoundStats] | None = None
    # False for a block queued behind a checkpoint's state call: it runs while the driver
    # writes, so the wait for it says nothing of its rounds' time (ClientPlacement)
    timed: bool = True

    @property
    def first(self) -> int:
        return self.infos[0].round_index

    @property
    def last(self) -> int:
        return self.infos[-1].round_index

    def holds(self, info: RoundInfo, evaluate: bool) -> bool:
        """Whether the block ran `info`'s round as the loop asks for it: its clients, its
        attacker's, and the evaluation."""
        ran = self.infos[info.round_index - self.first]
        return (
            ran.round_index == info.round_index
            and np.array_equal(ran.client_ids, info.client_ids)
            and np.array_equal(ran.attacker_pool, info.attacker_pool)
            and (ran.attacker_benign is None) == (info.attacker_benign is None)
            and (
                info.attacker_benign is None
                or np.array_equal(ran.attacker_benign, info.attacker_benign)
            )
            and ran.malicious_below == info.malicious_below
            and self.evaluates[info.round_index - self.first] == evaluate
        )


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
            backend = cls(plan.ctx, dataset, plan.split, train_x_ref, plan.schedule, plan.rounds)
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
        rounds=None,
    ) -> None:
        """Ray must be connected (see `connect`); `ctx` is the plan's run context (built with
        this backend's RuntimeAttachments); `train_x_ref` holds the training features;
        `schedule` the plan's asynchronous event schedule (the server's), `rounds` its round
        schedule (the loop's: which clients each round trains), which rounds run ahead follow
        (without it they run one ahead, as the loop names the next round)."""
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
        if clients.batched and self._server_eligible():
            # small rounds may move into the server actor: it pays its first vmapped call's
            # start while the first rounds train in tasks (a call that returns at once)
            self.server.actor.warm_up_clients.remote()
        # Rounds queued ahead in the server actor (blocks, in order), whether rounds may run
        # ahead (None: not asked yet), the state's bytes, the rounds the loop has been handed.
        self._round_schedule = rounds
        self._blocks: list[RoundsAhead] = []
        self._ahead_allowed: bool | None = None
        self._state_nbytes: int | None = None
        self._rounds_done: int | None = None

    def run_round(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None = None
    ) -> RoundStats:
        block = next((b for b in self._blocks if b.first <= info.round_index <= b.last), None)
        if block is None:
            stats = self._run_round_now(info, evaluate, next_info)
        else:
            stats = self._run_round_ahead(block, info, evaluate, next_info)
        self._rounds_done = info.round_index + 1
        if evaluate:  # (an evaluation is not the clients' time either: see get_state)
            self._untimed_period()
        if stats.server_place_failed:
            self._stop_server_place(f"a client failed in it ({stats.server_place_failed})")
        self._record_client_seconds(stats)
        return stats

    def _run_round_now(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None
    ) -> RoundStats:
        """The round as its own call (nothing queued ahead holds it)."""
        self._blocks = []  # (what is queued is for other rounds and runs nothing: see below)
        self._record_round_time(info.round_index)
        chunks = self._chunks(info)
        next_round = None if next_info is None else (next_info, self._chunks(next_info))
        call = self.server.actor.run_round.remote(info, chunks, evaluate, next_round)
        # A small next round trained in the server actor is queued right behind this one,
        # with the rounds after it (a block: _queue_block): the actor runs them while this
        # call returns and the driver logs, instead of waiting a round trip for each of the
        # driver's calls (rounds of a few ms: a quarter of each).
        if next_round is not None and next_round[1] is None and self._runs_ahead():
            self._queue_block(next_info)
        # (the next round's clients may start training in the server during this call)
        self._server_busy = chunks is None or (next_round is not None and next_round[1] is None)
        self._kill_if_asked(info.round_index)
        return self._get(call)

    def _run_round_ahead(
        self, block: RoundsAhead, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None
    ) -> RoundStats:
        """The round from a block queued ahead: the block's stats are fetched at its first
        round (the next block queued first, so the actor always has rounds to run)."""
        self._last_call = None  # (the periods between these calls say nothing: blocks are timed)
        if block.stats is None:
            if block is self._blocks[-1]:
                self._queue_after(block, next_info)
            self._server_busy = True
            self._kill_if_asked(info.round_index)
            block.stats = self._get(block.call)
            if len(block.stats) == len(block.infos) and not any(block.evaluates):
                self._record_block_time(block.first, block.last, block.infos, block.timed)
        position = info.round_index - block.first
        if position >= len(block.stats):
            # The block stopped before this round: the state was elsewhere than at the
            # block's start, or a client failed in the server actor (it then trains no more
            # rounds; what is queued after runs nothing). This round goes as its own call.
            self._ahead_allowed = False
            return self._run_round_now(info, evaluate, next_info)
        if not block.holds(info, evaluate):
            raise RuntimeError(
                f"round {info.round_index} ran ahead with other clients or another evaluation "
                "than the loop asks for (RayBackend._queue_block follows the loop's schedule "
                "and evaluation_due)"
            )
        if info.round_index == block.last:
            self._blocks.remove(block)
        stats = block.stats[position]
        stats.rounds_in_call = len(block.stats)  # (the driver waited for them all at once)
        return stats

    def _queue_after(self, block: RoundsAhead, next_info: RoundInfo | None) -> RoundsAhead | None:
        """Queue the block that follows `block`, when its first round trains in the server
        actor (its info from the run's schedule; without one, the loop's `next_info` when
        that is the round: single-round blocks); returns it (None: none queued)."""
        following = block.last + 1
        if following >= self.ctx.config.run.rounds or not self._runs_ahead():
            return None
        if next_info is not None and next_info.round_index == following:
            upcoming = next_info
        elif self._round_schedule is not None:
            upcoming = self._round_schedule.info(following)
        else:
            return None
        self._clients_of[following] = len(upcoming.trained_ids)
        return self._queue_block(upcoming) if self.trains_in_server(following) else None

    def _queue_block(self, first: RoundInfo) -> RoundsAhead:
        """Queue rounds from `first` on in the server actor as one call (run_rounds_ahead):
        as many as BLOCK_SECONDS of them at the measured time a round takes there (at least
        one; fewer while the state's copies, one a round, would pass BLOCK_STATE_BYTES), each
        trained in the server actor as placed (`trains_in_server`), up to the run's last
        round; each evaluated when the loop will ask for it (`evaluation_due`)."""
        run = self.ctx.config.run
        infos = [first]
        size = self._block_size(first)
        while len(infos) < size and self._round_schedule is not None:
            round_index = infos[-1].round_index + 1
            if round_index >= run.rounds:
                break
            if self._kill_server_at == round_index + 1:
                break  # (test hook: the round the server dies in starts a block, see __init__)
            info = self._round_schedule.info(round_index)
            self._clients_of[round_index] = len(info.trained_ids)
            if not self.trains_in_server(round_index):
                break
            infos.append(info)
        evaluates = [evaluation_due(run, i.round_index) for i in infos]
        keep_from = first.round_index if self._rounds_done is None else self._rounds_done
        call = self.server.actor.run_rounds_ahead.remote(infos, evaluates, keep_from)
        self._blocks.append(RoundsAhead(infos, evaluates, call))
        return self._blocks[-1]

    def _block_size(self, first: RoundInfo) -> int:
        """Rounds a block holds: BLOCK_SECONDS of them at the server actor's measured time a
        client, within MAX_BLOCK_ROUNDS and BLOCK_STATE_BYTES (see _queue_block)."""
        per_client = self._cost["server"]
        if per_client is None:
            return 1
        round_s = per_client * max(1, len(first.trained_ids))
        size = int(BLOCK_SECONDS // max(round_s, 1e-9))
        by_memory = BLOCK_STATE_BYTES // max(1, self._state_nbytes or 1)
        return max(1, min(size, MAX_BLOCK_ROUNDS, by_memory))

    def _kill_if_asked(self, round_index: int) -> None:
        if self._kill_server_at == round_index + 1:  # (test hook: see __init__)
            self._kill_server_at = None
            self.server.kill()

    def _runs_ahead(self) -> bool:
        """Whether rounds trained in the server actor may run ahead: not with a client-
        state store (a round ahead would write round t+1's client state before round t's
        checkpoint), and only for a state small enough that the copy the actor keeps of it
        for a checkpoint of the round before costs less than the round trip saved."""
        if self._ahead_allowed is None:
            self._state_nbytes = self._get(self.server.actor.state_nbytes.remote())
            small = self._state_nbytes <= RUN_AHEAD_STATE_BYTES
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
        self._blocks, self._rounds_done = [], None
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
        # The actor answers after the blocks queued before this call and would then idle while
        # the driver writes the checkpoint (a tiny round's checkpoint every 10 rounds: 0.3-0.5
        # ms a round); the block after them, queued behind this call, trains meanwhile. (At
        # most two blocks wait unfetched, as between checkpoints: a checkpoint every round
        # queues no more.)
        if self._blocks and sum(block.stats is None for block in self._blocks) <= 1:
            queued = self._queue_after(self._blocks[-1], None)
            if queued is not None:
                queued.timed = False
        return client_state.with_store(self._get(call), self.ctx)

    def set_state(self, state: ServerState) -> None:
        state = client_state.without_store(state, self.ctx)
        self._blocks, self._rounds_done = [], state.round
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
