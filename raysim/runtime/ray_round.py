"""One round's client tasks, seen from the server actor that submitted them: their updates are
folded in as tasks finish (`ray.wait`), always in client-id order; a failed task's clients are
retried with per-client attempts (raysim.core.faults), and a client out of retries is dropped
for the round; with a deadline, a task that has trained for longer than the deadline since its
own start is cancelled and its client dropped as late; a round waiting for tasks checks that
some node can still run them."""

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
from raysim.runtime.ray_tasks import LOADING

# How often a round waiting for client tasks checks that a node can still run them.
CAPACITY_CHECK_S = 5.0

# The most a timed client task's worker may take to fetch the run's bundle (its first task
# there: raysim.runtime.ray_tasks.LOADING) before the task counts as late.
BUNDLE_LOAD_ALLOWANCE_S = 60.0


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A client that sends nothing this round (out of retries, or `late` for the deadline)."""

    client_id: int
    late: bool = False


# A client task's result: an ObjectRef, or with a deadline the ObjectRefGenerator of a timed
# task (raysim.runtime.ray_tasks._timed_client_task: LOADING, STARTED, then the result).
Task = ray.ObjectRef | ray.ObjectRefGenerator

# submit(client_ids, attempts) -> a new client task for them.
Submit = Callable[[np.ndarray, np.ndarray], Task]


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
        task_refs: list[Task],
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
        self.late_at: dict[Task, float] = {}  # a running timed task: when it is late
        self.compute_s = 0.0  # the tasks' own training time, summed
        self.retries = 0  # tasks submitted again after a failure

    def collect(self, capacity: CapacityWatch, deadline_s: float | None) -> None:
        """Wait for every task, folding updates (and drops) into the server in client-id
        order. With `deadline_s` the tasks are timed ones, and each is late when it has
        trained for `deadline_s` since its own STARTED marker arrived (BUNDLE_LOAD_ALLOWANCE_S
        from LOADING while its worker fetches the run's bundle): then it is cancelled and its
        clients dropped as late. A task still waiting for a CPU slot or its worker is never
        late; it starts when a slot frees, and a hanging task frees its slot at its own
        deadline, so the round still ends in bounded time. (Timed from the dispatch or the
        updates' arrivals, honest clients queued on a loaded machine were cut: 4 of 8 in some
        rounds of a 1 s deadline with no slow client.)"""
        while self.pending:
            # Woken every CAPACITY_CHECK_S to see that some live node can still run a client
            # task (CapacityWatch): losing the last node with CPUs hung a run forever.
            timeout = CAPACITY_CHECK_S
            if self.late_at:
                timeout = min(timeout, max(0.0, min(self.late_at.values()) - time.perf_counter()))
            done, self.pending = ray.wait(self.pending, num_returns=1, timeout=timeout)
            if done:
                capacity.since = None
                self._take(done[0], deadline_s)
            now = time.perf_counter()
            late = [task for task, at in self.late_at.items() if at <= now]
            if late:
                self._cancel_late(late, deadline_s)
            elif not done:
                capacity.check(ray.nodes(), now)
                continue
            self._fold()

    def _take(self, task: Task, deadline_s: float | None = None) -> None:
        """Take what a task sent: a timed task's marker (it stays pending, now timed), or its
        result; a failed task's clients are retried or dropped."""
        client_ids, attempts = self.tasks[task]
        try:
            if isinstance(task, ray.ObjectRefGenerator):
                value = ray.get(next(task))
                if isinstance(value, str):  # LOADING or STARTED, timed from its arrival
                    allowed = BUNDLE_LOAD_ALLOWANCE_S if value == LOADING else deadline_s
                    self.late_at[task] = time.perf_counter() + allowed
                    self.pending.append(task)
                    return
            else:
                value = ray.get(task)
            updates, task_s, node_id = value
        except ray.exceptions.RayTaskError as error:
            self._forget(task)
            if isinstance(error.cause, RaysimError):  # bad input found in the task
                raise error.cause from None  # (e.g. a sum leaving int64): one line
            if not isinstance(error.cause, InjectedClientFailure):
                raise  # an error in the client code itself: a bug, not a fault
            self._failed(client_ids, attempts, error.cause.client_id)
            return
        except (ray.exceptions.RayError, StopIteration):  # the worker died (or its node, or
            self._forget(task)  # an object); StopIteration: a stream ended with no result
            culprit = None
            if self.faults is not None:
                culprit = self.faults.crash_culprit(self.round_index, client_ids, attempts)
            self._failed(client_ids, attempts, culprit)
            return
        self._forget(task)
        self.nodes[node_id] += 1
        self.round_nodes.add(node_id)
        self.finished[int(client_ids[0])] = updates
        self.compute_s += task_s

    def _forget(self, task: Task) -> None:
        del self.tasks[task]
        self.late_at.pop(task, None)

    def _cancel_late(self, late: list[Task], deadline_s: float | None) -> None:
        """Cancel the late tasks, dropping their clients as late; what they sent meanwhile
        (their result, just in time) is taken first."""
        ready, _ = ray.wait(late, num_returns=len(late), timeout=0)
        for task in ready:
            self.pending.remove(task)
            self._take(task, deadline_s)  # a result, a failure, or (unlikely) a marker
        now = time.perf_counter()
        for task in late:
            if task not in self.late_at or self.late_at[task] > now:
                continue  # it sent its result or failed (or is timed anew)
            ray.cancel(task, force=True)  # ends the worker (see ServerActor.__init__)
            self.pending.remove(task)
            client_ids, _ = self.tasks[task]
            self._forget(task)
            self._finish(int(client_ids[0]), [Dropped(int(c), late=True) for c in client_ids])

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
