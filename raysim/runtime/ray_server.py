"""The server actor: raysim.core.server.Server in a Ray actor, which dispatches a round's
client tasks itself (their results come straight back to it, the owner) and folds in their
updates (raysim.runtime.ray_round), or trains a small round's clients in its own process; and
the driver's handle on it, which turns the actor's death into ServerLost and replaces it.

Per round the actor puts the global payload once and every client task reads it from there
(zero-copy for numpy arrays), or, when it is small, passes it by value in the task spec."""

from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import ray

from raysim.core.algorithm import RunContext
from raysim.core.clients import chunk_clients
from raysim.core.faults import CapacityWatch, FaultPlan, ServerLost
from raysim.core.server import Server, ServerData
from raysim.core.state import RoundInfo, RoundStats, ServerState, clients_in
from raysim.models.devices import task_num_gpus
from raysim.process_memory import peak_rss_bytes
from raysim.runtime import collector
from raysim.runtime.allocator import tune_malloc
from raysim.runtime.ray_errors import one_line_error
from raysim.runtime.ray_metrics import RoundMetrics
from raysim.runtime.ray_round import RoundTasks
from raysim.runtime.ray_tasks import (
    _client_task,
    _timed_client_task,
    train_with_bundle,
    warm_up_training,
)

# Payloads up to Ray's default inline size (100 KiB) go inside the task spec by value, which is
# cheaper than a put (~1 ms here); larger ones are put in the object store once per round.
INLINE_PAYLOAD_BYTES = 100 * 1024


def spread_allowed() -> bool:
    """Whether client tasks may be spread over the nodes (`runtime.spread_tasks`): not inside
    a placement group (a Tune trial), whose bundles already say where its tasks run; one line
    says so."""
    if ray.util.get_current_placement_group() is None:
        return True
    print(
        "raysim: runtime.spread_tasks is not used inside a placement group (a Tune trial): "
        "the trial's tasks run on its own resources",
        file=sys.stderr,
        flush=True,
    )
    return False


@ray.remote(num_cpus=0)
class ServerActor:
    """Holds the global state; dispatches a round's client tasks and folds in their updates.

    The actor submits the tasks itself, so their results come straight back to it (the owner)
    and a round costs the driver a single actor call.
    """

    def __init__(
        self,
        ctx: RunContext,
        run_ref: list,
        data: ServerData,
    ) -> None:
        tune_malloc(ctx.config.runtime.tune_malloc)  # it folds updates and may train clients
        self.server = Server(ctx, data)
        self.run_ref = run_ref
        clients = ctx.config.clients
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        num_gpus = task_num_gpus(clients.num_gpus, cluster_gpus, notice=False)  # driver tells
        self.deadline_s = ctx.config.run.round_deadline_s
        # Ray's own retries are off: a failed task comes back to run_round, which retries its
        # clients with per-client attempts (raysim.core.faults) so results stay deterministic.
        # With a deadline the tasks are timed ones (a streaming generator that reports when its
        # training starts: each task's lateness counts from there, raysim.runtime.ray_round); a
        # late one is cancelled with force, which ends its worker (a plain cancel raises
        # KeyboardInterrupt anywhere in the task, even inside a module's first import, and
        # leaves a broken worker for later tasks).
        task = _client_task if self.deadline_s is None else _timed_client_task
        options = {}
        if ctx.config.runtime.spread_tasks and spread_allowed():
            # (no strategy named otherwise: an explicit one, even "DEFAULT", would take the
            # tasks out of a Tune trial's placement group, where they would wait forever)
            options["scheduling_strategy"] = "SPREAD"
        self.task = task.options(
            num_cpus=clients.num_cpus,
            num_gpus=num_gpus,
            max_retries=0,
            retry_exceptions=False,
            **options,
        )
        self.capacity = CapacityWatch(clients.num_cpus, num_gpus)
        self.faults = FaultPlan.from_config(ctx.config)
        self.max_retries = clients.max_retries
        # Tasks for a round whose clients failed inside this actor (_run_round_here).
        self.fallback_tasks = int(ray.cluster_resources().get("CPU", 1.0) // clients.num_cpus)
        self._publish_payload()
        self._prefetched: tuple[int, float, list, list] | None = None
        # A small next round's training, started on a thread (see _run_round_here).
        self._prefetched_here: tuple[int, Future] | None = None
        # The states before the rounds run ahead (run_rounds_ahead), by round, for
        # get_state(as_of): dropped once the driver has taken their rounds.
        self._kept: dict[int, ServerState] = {}
        self._trainer: ThreadPoolExecutor | None = None
        self._warming: Future | None = None  # warm_up_clients' work, until it is waited for
        self.metrics = RoundMetrics(ctx.config.run.name)  # Ray dashboard: rounds, updates, bytes
        self.nodes: Counter[str] = Counter()  # client tasks per node id
        self.clients_here = 0  # client updates trained in this actor (no task)
        # A client failed in this actor: no later round queued ahead trains here.
        self.clients_failed_here = False

    def warm_up_clients(self) -> None:
        """Start, on the trainer thread, what the first round trained in this actor would pay
        before its clients train (raysim.runtime.ray_tasks.warm_up_training): the driver asks
        for it when small rounds may move here, and the first rounds train in tasks
        meanwhile. Returns at once."""
        if self._trainer is None:
            self._trainer = ThreadPoolExecutor(1, thread_name_prefix="raysim-clients")
        self._warming = self._trainer.submit(warm_up_training, self.run_ref[0])

    def _warmed_up(self) -> None:
        """Wait for warm_up_clients' work, if any is under way: it reads the clients' model,
        which training here and the evaluation (eval mode, new weights) also use."""
        if self._warming is not None:
            self._warming.result()
            self._warming = None

    def _publish_payload(self) -> None:
        payload = self.server.payload()
        small = self.server.payload_nbytes() <= INLINE_PAYLOAD_BYTES
        self.payload_arg = payload if small else ray.put(payload)

    def _submit(self, round_index: int, client_ids: np.ndarray, attempts=None):
        return self.task.remote(
            self.run_ref,
            self.payload_arg,
            round_index,
            client_ids,
            self.server.personal_payloads(client_ids),
            attempts if attempts is not None and np.any(attempts) else None,
        )

    def _dispatch(self, info: RoundInfo, chunks: list[np.ndarray]) -> tuple:
        refs = [self._submit(info.round_index, chunk) for chunk in chunks]
        return info.round_index, time.perf_counter(), refs, chunks

    def run_round(
        self,
        info: RoundInfo,
        chunks: list[np.ndarray],
        evaluate: bool,
        next_round: tuple[RoundInfo, list[np.ndarray]] | None = None,
    ) -> RoundStats:
        """One round; with `next_round`, that round's tasks are dispatched as soon as this
        round's payload exists, so they train while the driver logs and calls back (clients
        of round t+1 depend only on the payload after round t, which is final here)."""
        if chunks is None or (
            self._prefetched_here is not None and self._prefetched_here[0] == info.round_index
        ):
            return self._run_round_here(info, evaluate, next_round)
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] == info.round_index:
            _, started, task_refs, chunks = prefetched
        else:
            _, started, task_refs, chunks = self._dispatch(info, chunks)
        self.server.start_round(info)
        tasks = RoundTasks(
            self.server,
            functools.partial(self._submit, info.round_index),
            info.round_index,
            task_refs,
            chunks,
            max_retries=self.max_retries,
            faults=self.faults,
            nodes=self.nodes,
        )
        tasks.collect(self.capacity, self.deadline_s)
        # Wall time until the last update was folded in (folding overlaps with training).
        clients_s = time.perf_counter() - started
        stats = self._finish_round(
            evaluate, clients_s, tasks.compute_s, len(task_refs), tasks.retries
        )
        nodes = len(tasks.round_nodes)
        stats.trained_in = f"{len(task_refs)} tasks on {nodes} node{'s' if nodes != 1 else ''}"
        if next_round is not None and next_round[1] is not None:
            self._prefetched = self._dispatch(*next_round)
        return stats

    def _finish_round(
        self, evaluate: bool, clients_s: float, compute_s: float, tasks: int, retries: int = 0
    ) -> RoundStats:
        """The server's end of the round, its timings, the dashboard's metrics, and the payload
        the next round's clients get."""
        if evaluate:
            self._warmed_up()
        stats = self.server.finish_round(evaluate)
        stats.clients_s = clients_s
        stats.client_compute_s = compute_s
        stats.tasks = tasks
        stats.task_retries = retries
        self.metrics.record(stats)
        self._publish_payload()
        collector.after_round(self.run_ref[0].hex())  # this actor's process: one run
        return stats

    def _train_here(self, info: RoundInfo, payload, personal) -> tuple[list, float]:
        """Train a round's clients in this process with the code and bundle a task uses (the
        same updates, bit for bit); returns the updates and the seconds it took."""
        return train_with_bundle(
            self.run_ref[0], payload, info.round_index, info.trained_ids, personal
        )

    def _run_round_here(
        self, info: RoundInfo, evaluate: bool, next_round: tuple | None
    ) -> RoundStats:
        """A round too small to be worth a task (RayBackend.trains_in_server): its clients
        train in this process, then are folded in client-id order. When the next round is
        small too, its clients start training on a thread as soon as this round's model
        exists (their inputs are final then), so they train while this call returns and the
        driver logs: the actor's counterpart of dispatching the next round's tasks early."""
        prefetched, self._prefetched_here = self._prefetched_here, None
        self._warmed_up()
        self.server.start_round(info)
        try:
            if prefetched is not None and prefetched[0] == info.round_index:
                updates, compute_s = prefetched[1].result()
            else:
                updates, compute_s = self._train_here(
                    info, self.server.payload(), self.server.personal_payloads(info.trained_ids)
                )
        except Exception as error:  # noqa: BLE001 - a client's, not the server's: see below
            # A client's exception here would end the run, while a task's failure costs its
            # client only: the round's clients train again as tasks, under the task path's
            # rules (retries, drops), and the driver trains no later round here. Nothing was
            # folded in yet, so the round is computed as if it had been dispatched as tasks.
            self.clients_failed_here = True
            ids = info.trained_ids
            chunks = chunk_clients(ids, max(1, min(len(ids), self.fallback_tasks)))
            stats = self.run_round(info, chunks, evaluate, None)
            stats.server_place_failed = f"{type(error).__name__}: {error}"[:200]
            return stats
        self.server.add(updates)
        self.clients_here += clients_in(updates)
        stats = self._finish_round(evaluate, compute_s, compute_s, 0)  # 0 tasks: trained here
        stats.trained_in = "the server actor"
        if next_round is not None:
            next_info, next_chunks = next_round
            if next_chunks is not None:
                self._prefetched = self._dispatch(next_info, next_chunks)
            elif self.server.ctx.client_state is None:  # (a store written ahead would leak
                # round t+1's client state into a checkpoint of round t)
                if self._trainer is None:
                    self._trainer = ThreadPoolExecutor(1, thread_name_prefix="raysim-clients")
                personal = self.server.personal_payloads(next_info.trained_ids)
                future = self._trainer.submit(
                    self._train_here, next_info, self.server.payload(), personal
                )
                self._prefetched_here = (next_info.round_index, future)
        return stats

    def run_rounds_ahead(
        self, infos: list[RoundInfo], evaluates: list[bool], keep_from: int
    ) -> list[RoundStats]:
        """Small rounds the driver queued behind the ones before them (RayBackend runs them
        a block ahead: the actor runs them one after another while the driver logs the rounds
        before, and one call's round trip serves the block). Each round runs only on the state
        the round before ended with (otherwise it and the rest run nothing: the list of stats
        ends before it), trains here, evaluates when `evaluates` says (the loop's rule), and
        keeps a copy of the state before it for `get_state` (a checkpoint of the round
        before, taken when the driver gets there, e.g. when the run stops there on SIGTERM).
        Copies of rounds before `keep_from`, which the driver has taken, are dropped. A round
        whose clients failed here trained in tasks instead (`_run_round_here`); the block ends
        after it, and no later block runs anything (the driver trains no more rounds here)."""
        for round_done in [r for r in self._kept if r < keep_from]:
            del self._kept[round_done]
        done: list[RoundStats] = []
        for info, evaluate in zip(infos, evaluates, strict=True):
            state = self.server.get_state()
            if state.round != info.round_index or self.clients_failed_here:
                break
            self._kept[state.round] = state.copy()
            stats = self._run_round_here(info, evaluate, None)
            done.append(stats)
            if stats.server_place_failed:
                break
        return done

    def get_state(self, as_of: int | None = None) -> ServerState:
        """The state after round `as_of` (None: the current one): the copy kept before a
        round run ahead (run_rounds_ahead) when the driver has not taken that round yet."""
        state = self.server.get_state()
        if as_of is None or state.round == as_of:
            return state
        if as_of in self._kept:
            return self._kept[as_of]
        raise RuntimeError(f"the server holds round {state.round}'s state, not round {as_of}'s")

    def set_state(self, state: ServerState) -> None:
        self.server.set_state(state)
        self._prefetched = None  # dispatched against the old payload
        self._prefetched_here = None
        self._kept.clear()
        self._publish_payload()

    def state_nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.server.get_state().arrays.values())

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes()

    def task_nodes(self) -> dict[str, int]:
        return dict(self.nodes)

    def clients_in_actor(self) -> int:
        return self.clients_here


class ServerHandle:
    """The driver's side of the server actor: starts it (with `args`, the actor's arguments,
    kept for a replacement), gets its calls' results, and replaces it when it was lost."""

    def __init__(self, args: tuple, num_gpus: float) -> None:
        self._args, self._num_gpus = args, num_gpus
        self.actor = self._start()

    def _start(self):
        return ServerActor.options(num_gpus=self._num_gpus).remote(*self._args)

    def get(self, call: ray.ObjectRef):
        """The result of a server actor call; ServerLost if the actor (or an index shard
        actor it calls) died: killed, crashed, its node lost, or ended by Ray's memory monitor
        (OutOfMemoryError). The round loop then calls `restart` and replays rounds. An
        exception the server's own code raised propagates as it is."""
        try:
            return ray.get(call)
        except ray.exceptions.RayTaskError as error:
            one_line = one_line_error(error)  # the user's input, as on the local backend
            if one_line is not None:
                raise one_line from None
            cause = error.cause
            if isinstance(cause, ray.exceptions.RayError) and not isinstance(
                cause, ray.exceptions.RayTaskError
            ):
                raise ServerLost(f"an actor of the server failed: {cause}") from error
            raise
        except ray.exceptions.RayError as error:
            raise ServerLost(f"the server actor failed: {error}") from error

    def replace(self) -> None:
        """A new actor in place of the lost one, started as the first was: the run's initial
        state (init_server is deterministic given the run seed), until `set_state`."""
        try:
            ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - it is already gone
            pass
        self.actor = self._start()

    def kill(self) -> None:
        ray.kill(self.actor)
