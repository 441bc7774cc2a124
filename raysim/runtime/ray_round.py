"""One round's client tasks, seen from the server actor that submitted them: their updates are
folded in as tasks finish (`ray.wait`), always in client-id order; a failed task's clients are
retried with per-client attempts (raysim.core.faults), and a client out of retries is dropped
for the round; at the round's deadline the tasks still running are cancelled and their clients
dropped as late; a round waiting for tasks checks that some node can still run them."""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import ray

from raysim.core.faults import CapacityWatch, FaultPlan, InjectedClientFailure
from raysim.core.server import Server
from raysim.errors import RaysimError

# How often a round waiting for client tasks checks that a node can still run them.
CAPACITY_CHECK_S = 5.0

# The most a round's deadline is extended while that round starts client workers.
WORKER_START_ALLOWANCE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A client that sends nothing this round (out of retries, or `late` for the deadline)."""

    client_id: int
    late: bool = False


# submit(client_ids, attempts) -> the reference of a new client task for them.
Submit = Callable[[np.ndarray, np.ndarray], ray.ObjectRef]


class RoundTasks:
    """The pending client tasks of one round and what has come back of them.

    A "slot" is a contiguous run of the round's clients (ascending ids) whose result is
    pending, keyed by its first client id. Results are folded in key order = client-id
    order; a failed task's slot is split into smaller slots that are resubmitted.
    """

    def __init__(
        self,
        server: Server,
        submit: Submit,
        round_index: int,
        task_refs: list[ray.ObjectRef],
        chunks: list[np.ndarray],
        *,
        max_retries: int,
        faults: FaultPlan | None,
        nodes: Counter[str],
    ) -> None:
        self.server = server
        self._new_task = submit
        self.round_index = round_index
        self.max_retries = max_retries
        self.faults = faults
        self.nodes = nodes  # client tasks per node id, counted as they finish
        self.round_nodes: set[str] = set()  # the nodes this round's tasks finished on
        self.tasks = {
            ref: (chunk, np.zeros(len(chunk), dtype=np.int64))
            for ref, chunk in zip(task_refs, chunks, strict=True)
        }
        self.keys = [int(chunk[0]) for chunk in chunks]
        heapq.heapify(self.keys)
        self.live = set(self.keys)
        self.finished: dict[int, list] = {}
        self.pending = list(task_refs)
        self.compute_s = 0.0  # the tasks' own training time, summed
        self.retries = 0  # tasks submitted again after a failure

    def collect(
        self,
        capacity: CapacityWatch,
        deadline_s: float | None,
        deadline_from: float,
        starting_workers: bool,
    ) -> bool:
        """Wait for every task, folding updates (and drops) into the server in client-id
        order. `deadline_s` counts from `deadline_from`, plus WORKER_START_ALLOWANCE_S while
        the round starts workers (`starting_workers`) until the first update arrives. True if
        tasks were cancelled at the deadline (their workers ended: the next round starts
        replacements)."""
        deadline = None if deadline_s is None else deadline_from + deadline_s
        starting_workers = starting_workers and deadline is not None
        if starting_workers:
            deadline += WORKER_START_ALLOWANCE_S
        cancelled = False
        while self.pending:
            # Woken every CAPACITY_CHECK_S to see that some live node can still run a client
            # task (CapacityWatch): losing the last node with CPUs hung a run forever.
            timeout = CAPACITY_CHECK_S
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.perf_counter()))
            done, self.pending = ray.wait(self.pending, num_returns=1, timeout=timeout)
            if not done and (deadline is None or time.perf_counter() < deadline):
                capacity.check(ray.nodes(), time.perf_counter())
                continue
            capacity.since = None
            if not done:  # the round's deadline passed: cancel what runs, drop its clients
                self._cancel_pending()
                cancelled = True
            elif self._take(done[0]) and deadline is not None:
                # A worker is up (the start allowance ends), and every update gives the
                # clients still pending deadline_s more: clients queued behind others
                # for a slot are not late, a hanging one is once nothing else arrives
                # (a fixed cut lost honest clients queued on a loaded machine).
                following = time.perf_counter() + deadline_s
                deadline = (min if starting_workers else max)(deadline, following)
                starting_workers = False
            self._fold()
        return cancelled

    def _take(self, ref: ray.ObjectRef) -> bool:
        """Take a finished task's result; True if it brought updates, False if it failed (its
        clients are retried or dropped)."""
        client_ids, attempts = self.tasks.pop(ref)
        try:
            updates, task_s, node_id = ray.get(ref)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, RaysimError):  # bad input found in the task
                raise error.cause from None  # (e.g. a sum leaving int64): one line
            if not isinstance(error.cause, InjectedClientFailure):
                raise  # an error in the client code itself: a bug, not a fault
            self._failed(client_ids, attempts, error.cause.client_id)
            return False
        except ray.exceptions.RayError:  # the worker died (or its node, or an object)
            culprit = None
            if self.faults is not None:
                culprit = self.faults.crash_culprit(self.round_index, client_ids, attempts)
            self._failed(client_ids, attempts, culprit)
            return False
        self.nodes[node_id] += 1
        self.round_nodes.add(node_id)
        self.finished[int(client_ids[0])] = updates
        self.compute_s += task_s
        return True

    def _cancel_pending(self) -> None:
        for ref in self.pending:
            ray.cancel(ref, force=True)  # ends the worker (see ServerActor.__init__)
            client_ids, _ = self.tasks.pop(ref)
            self._finish(int(client_ids[0]), [Dropped(int(c), late=True) for c in client_ids])
        self.pending = []

    def _fold(self) -> None:
        while self.keys and self.keys[0] in self.finished:  # fold in client-id order
            key = heapq.heappop(self.keys)
            self.live.discard(key)
            for entry in self.finished.pop(key):
                if isinstance(entry, Dropped):
                    self.server.drop(entry.client_id, late=entry.late)
                else:
                    self.server.add([entry])

    def _open(self, key: int) -> None:
        if key not in self.live:
            self.live.add(key)
            heapq.heappush(self.keys, key)

    def _submit(self, client_ids: np.ndarray, attempts: np.ndarray) -> None:
        ref = self._new_task(client_ids, attempts)
        self.tasks[ref] = (client_ids, attempts)
        self.pending.append(ref)
        self.retries += 1
        self._open(int(client_ids[0]))

    def _finish(self, key: int, entries: list) -> None:
        self._open(key)
        self.finished[key] = entries

    def _failed(self, client_ids: np.ndarray, attempts: np.ndarray, culprit: int | None) -> None:
        """The task of `client_ids` failed, caused by `culprit` (None: unknown)."""
        if culprit is not None:
            position = int(np.searchsorted(client_ids, culprit))
            if position >= len(client_ids) or client_ids[position] != culprit:
                culprit = None  # not one of this task's clients: nobody to blame
        if culprit is None and len(client_ids) > 1:
            # Nobody to blame: each client alone again, at the same attempt; the one that
            # fails again is then blamed (a task of one client is its own culprit).
            for position in range(len(client_ids)):
                self._submit(client_ids[position : position + 1], attempts[position : position + 1])
            return
        if culprit is None:
            position, culprit = 0, int(client_ids[0])
        self.server.record_failure(culprit)
        attempts = attempts.copy()
        attempts[position] += 1
        if position:  # the clients before it trained fine: again, at the same attempts
            self._submit(client_ids[:position], attempts[:position])
        rest, rest_attempts = client_ids[position:], attempts[position:]
        if attempts[position] > self.max_retries:  # out of retries: dropped this round
            self._finish(culprit, [Dropped(culprit)])
            rest, rest_attempts = rest[1:], rest_attempts[1:]
        if len(rest):
            self._submit(rest, rest_attempts)
