"""Where the Ray backend trains a round's clients, and how many tasks carry them.

With `clients.per_task: auto` a round's clients train in tasks (spread over the client slots)
or in the server actor (one after another, no task round trip), whichever was measured faster,
and the tasks are packed from the measured seconds per client. Results depend on neither
(updates are reduced per client in client-id order), only speed."""

from __future__ import annotations

import math
import sys
import time

import numpy as np

from raysim.core.clients import chunk_clients
from raysim.core.faults import FaultPlan
from raysim.core.state import RoundInfo, RoundStats


def placement_text(placement: dict) -> str:
    """summary.json's `placement` as the one line a run ends with."""
    nodes = ", ".join(
        f"{n['address']}{' (head)' if n['head'] else ''} {n['client_tasks']}"
        for n in placement["nodes"]
    )
    packing = placement.get("packing")
    packed = ""
    if packing and packing.get("rounds_in_tasks"):
        tasks, clients = packing["tasks_per_round"], packing["clients_per_task"]
        packed = (
            f"; packing: {packing['rule']}, {_span(tasks)} task(s) a round of "
            f"{_span(clients)} client(s)"
        )
    return (
        f"raysim: client tasks per node: {nodes or 'none'}; "
        f"{placement['clients_in_server_actor']} client updates trained in the server actor"
        f"{packed}"
    )


def _span(bounds: list[int]) -> str:
    low, high = bounds
    return f"{low}" if low == high else f"{low}-{high}"


def gpu_slots(clients) -> int:
    """GPUs the run's client tasks can use at once (whole devices; in a Tune trial, its own
    placement group's), 0 when clients ask for none. With `clients.batched` a round takes one
    task per GPU; a fractional `clients.num_gpus` lets Ray put two of them on one device, which
    one line says."""
    import ray

    if not clients.num_gpus:
        return 0
    gpus = ray.cluster_resources().get("GPU", 0.0)
    group = ray.util.get_current_placement_group()
    if group is not None:
        gpus = sum(bundle.get("GPU", 0.0) for bundle in group.bundle_specs)
    count = int(gpus)
    if clients.batched and count > 1 and clients.num_gpus < 1:
        print(
            f"raysim: clients.batched on {count} GPUs packs one client task per GPU, but each "
            f"asks for clients.num_gpus={clients.num_gpus:g}, so Ray may place two on one GPU; "
            f"clients.num_gpus: 1 gives every task a GPU of its own",
            file=sys.stderr,
            flush=True,
        )
    return count


class ClientPlacement:
    """The placement and packing state of a RayBackend (a mixin: `self.ctx` is the run's
    context; `_init_placement` sets the rest)."""

    def _init_placement(self, parallel_slots: int, gpu_slots: int = 0) -> None:
        self.parallel_slots = parallel_slots
        # Batched clients on GPUs: one task per GPU (a task batches all of its share).
        self.gpu_slots = gpu_slots
        self._packed: dict[str, list[int]] = {}  # tasks a round, clients a task: [min, max]
        self._rounds_in_tasks = 0
        self.seconds_per_client: float | None = None  # measured, for automatic packing
        self.rounds_run = 0
        # Where each round trains (trains_in_server) and what each place costs, measured.
        self._placement: dict[int, bool] = {}
        self._clients_of: dict[int, int] = {}
        self._cost: dict[str, float | None] = {"tasks": None, "server": None}
        self._cost_round: dict[bool, int] = {False: 0, True: 0}
        self._last_call: tuple[int, float] | None = None
        self._last_block: tuple[int, float] | None = None  # (its last round, fetched when)
        # Whether the server actor trains (or is about to train) clients in the current call,
        # and whether that place is off for good: a client that kills its process there (a
        # segfault, os._exit, Ray's memory monitor) takes the server with it, while in a task
        # it costs only that client. So after one such loss, or a client exception inside the
        # server, every round trains in tasks.
        self._server_busy = False
        self._server_place_off = False
        clients = self.ctx.config.clients
        if self.ctx.config.run.round_deadline_s is not None and clients.per_task not in (1, "auto"):
            print(
                f"raysim: run.round_deadline_s is set, so each client trains in a task of its "
                f"own (clients.per_task={clients.per_task} is not used): a late task is "
                f"cancelled with all its clients",
                file=sys.stderr,
                flush=True,
            )

    # Where a round's clients train, with `clients.per_task: auto`: in tasks (spread over the
    # client slots) or in the server actor (one after another, no task round trip). Which is
    # faster depends on the machine and the clients (on 2 cores, 10 digits clients of ~0.3 ms:
    # 3.7 ms a round in the actor, 8+ ms in tasks; 100 of them: 24 vs 45 ms; 50 LeNet clients
    # of 64 samples: tasks win), so it is measured: each place is timed on consecutive
    # rounds (the time between the driver's calls, per trained client, the first
    # round after a switch not counted, nor a period with a checkpoint or an evaluation in
    # it: `_untimed_period`), the faster one is used, and the other is timed again
    # (`_retime_every`): after REPROBE_EVERY rounds, or later when the places' measured costs
    # are far apart, so that the re-timing's rounds in the slower place add at most
    # RETIME_SHARE to the rounds between (tiny digits rounds, 3.5x slower in tasks: a
    # re-timing every 50 rounds cost 4 rounds of 15 ms against 5 ms, a sixth of the run).
    # Results do not depend on the place (bit for bit).
    REPROBE_EVERY = 50
    RETIME_SHARE = 0.02
    RETIME_AT_MOST_EVERY = 1000
    # Rounds a place trains before it is timed. Two: a process's first batched call pays
    # torch.func's start (1.5-2 s) and its second is still slow (batched "many" digits rounds
    # in the server actor: 1.77 s, 0.089 s, then 0.03 s); timed on the second, the server
    # looked 3x slower than the tasks and was not tried again for REPROBE_EVERY rounds. (The
    # server actor now pays that start ahead, ServerActor.warm_up_clients, when it is done in
    # time; the second round's slowness stays.)
    SETTLE_ROUNDS = 2

    def _server_eligible(self) -> bool:
        """Whether clients may train in the server actor at all: only with automatic packing
        and when nothing needs a task of its own (injected faults, a round deadline, GPUs)."""
        config = self.ctx.config
        return (
            config.clients.per_task == "auto"
            and FaultPlan.from_config(config) is None
            and config.run.round_deadline_s is None
            and not config.clients.num_gpus
        )

    def trains_in_server(self, round_index: int) -> bool:
        """Where round `round_index`'s clients train (decided once per round: a round may be
        dispatched ahead of its call)."""
        if self._server_place_off:
            return False
        decided = self._placement.get(round_index)
        if decided is None:
            decided = self._placement[round_index] = self._place(round_index)
            self._say_if_moved(round_index, decided)
            for old in [r for r in self._placement if r < round_index - 1 - self.SETTLE_ROUNDS]:
                del self._placement[old]  # (only the last rounds are ever looked at)
                self._clients_of.pop(old, None)
        return decided

    def _say_if_moved(self, round_index: int, in_server: bool) -> None:
        """One line when automatic placement moves clients into the server actor or back
        with the measured seconds per client and how to keep every round in tasks. Each
        direction is said once: the slower place's re-timing now and then would otherwise add
        two lines each time."""
        previous = self._placement.get(round_index - 1, False)
        said = self.__dict__.setdefault("_moves_said", set())
        if in_server == previous or in_server in said:
            return
        said.add(in_server)
        tasks, server = self._cost["tasks"], self._cost["server"]

        def ms(value: float | None) -> str:
            return "not measured" if value is None else f"{value * 1e3:.2f} ms"

        where = (
            "in the server actor (one after another, no task round trip)"
            if in_server
            else "in tasks again"
        )
        print(
            f"raysim: from round {round_index} clients train {where}: clients.per_task: auto, "
            f"the faster place as measured (per client: tasks {ms(tasks)}, server actor "
            f"{ms(server)}); --set clients.per_task=N keeps every round in tasks of N clients",
            file=sys.stderr,
            flush=True,
        )

    def _place(self, round_index: int) -> bool:
        if not self._server_eligible() or round_index < 2:  # round 1 starts the workers
            return False
        tasks, server = self._cost["tasks"], self._cost["server"]
        if tasks is None:
            return False
        if server is None:
            return not self._server_cannot_win(tasks)
        faster = server < tasks
        # the slower place is timed again now and then (clients grow, the cluster's load
        # changes): it trains until a steady round of it has been measured
        if round_index - self._cost_round[not faster] > self._retime_every(tasks, server):
            return faster if not faster and self._server_cannot_win(tasks) else not faster
        return faster

    def _retime_every(self, tasks: float, server: float) -> int:
        """Rounds between two timings of the slower place: REPROBE_EVERY, or more when a
        timing's SETTLE_ROUNDS + 1 rounds there would cost more than RETIME_SHARE of the
        rounds between, at the measured per-client costs; at most RETIME_AT_MOST_EVERY."""
        fast, slow = sorted((tasks, server))
        extra = (self.SETTLE_ROUNDS + 1) * (slow - fast)
        rounds = math.ceil(extra / (self.RETIME_SHARE * max(fast, 1e-9)))
        return min(self.RETIME_AT_MOST_EVERY, max(self.REPROBE_EVERY, rounds))

    def _server_cannot_win(self, tasks_per_client: float) -> bool:
        """Whether timing the server is pointless: it trains a round's clients one after
        another, so a client costs it at least the compute the client took in a task
        (`seconds_per_client`); when that alone is as much as a client's share of a task
        round (the tasks ran in parallel), the server is slower. Probing it anyway cost the
        heavy LeNet rounds of benchmarks/peers three rounds at 1.7-2x the tasks' time."""
        return self.seconds_per_client is not None and self.seconds_per_client >= tasks_per_client

    def _untimed_period(self) -> None:
        """The period from the last round's call (or block fetch) to the next is not timed
        (the driver did something else in it than wait for clients: a checkpoint)."""
        self._last_call = None
        self._last_block = None

    def _record_round_time(self, round_index: int) -> None:
        """Time the round before this call (the period between two calls) for its place,
        when the SETTLE_ROUNDS rounds before it trained in the same place (steady state)."""
        now = time.perf_counter()
        previous, self._last_call = self._last_call, (round_index, now)
        if previous is None or previous[0] != round_index - 1:
            return
        place = self._placement.get(round_index - 1)
        earlier = [
            self._placement.get(round_index - 1 - k) for k in range(1, self.SETTLE_ROUNDS + 1)
        ]
        if place is None or any(e is None or e != place for e in earlier):
            return
        per_client = (now - previous[1]) / max(1, self._clients_of.get(round_index - 1, 1))
        key = "server" if place else "tasks"
        self._cost[key] = (
            per_client if self._cost[key] is None else (0.5 * self._cost[key] + 0.5 * per_client)
        )
        self._cost_round[place] = round_index - 1

    def _record_block_time(
        self, first: int, last: int, infos: list[RoundInfo], timed: bool = True
    ) -> None:
        """Time the server actor by the blocks of rounds it runs ahead (RayBackend): the
        period between the fetches of two consecutive blocks, per client of the later one
        (`infos`, rounds `first`..`last`), whole and without an evaluation (the caller's
        check), when nothing untimed came between (`_untimed_period`: a checkpoint, whose
        writing holds up the driver's next fetch). A block that is not `timed` (it ran while
        the driver wrote a checkpoint) is only the start of the next period."""
        now = time.perf_counter()
        previous, self._last_block = self._last_block, (last, now)
        if previous is None or previous[0] != first - 1 or not timed:
            return
        clients = sum(len(info.trained_ids) for info in infos)
        per_client = (now - previous[1]) / max(1, clients)
        cost = self._cost["server"]
        self._cost["server"] = per_client if cost is None else 0.5 * cost + 0.5 * per_client
        self._cost_round[True] = last

    def _chunks(self, info: RoundInfo) -> list[np.ndarray] | None:
        """The round's tasks (contiguous runs of its clients), or None: train in the server."""
        ids = info.trained_ids
        self._clients_of[info.round_index] = len(ids)
        if self.trains_in_server(info.round_index):
            return None
        chunks = chunk_clients(ids, self.tasks_for(len(ids)))
        self._record_packing(chunks)
        return chunks

    def _record_packing(self, chunks: list[np.ndarray]) -> None:
        """How the rounds trained in tasks were packed (summary.json's placement.packing)."""
        self._rounds_in_tasks += 1
        for key, value in (
            ("tasks_per_round", len(chunks)),
            ("clients_per_task", min(len(c) for c in chunks)),
            ("clients_per_task", max(len(c) for c in chunks)),
        ):
            bounds = self._packed.setdefault(key, [value, value])
            bounds[0], bounds[1] = min(bounds[0], value), max(bounds[1], value)

    def packing(self) -> dict:
        """The packing rule and what it gave: summary.json's placement.packing."""
        return {
            "rule": self.packing_rule(),
            "rounds_in_tasks": self._rounds_in_tasks,
            "tasks_per_round": self._packed.get("tasks_per_round", [0, 0]),
            "clients_per_task": self._packed.get("clients_per_task", [0, 0]),
        }

    def packing_rule(self) -> str:
        """The rule `tasks_for` follows, in words."""
        config = self.ctx.config
        if config.run.round_deadline_s is not None:
            return "one client a task (run.round_deadline_s)"
        per_task = config.clients.per_task
        if per_task != "auto":
            return f"clients.per_task={per_task}"
        if self._batched_on_gpus():
            return f"batched, one task per GPU ({self.gpu_slots} GPU(s))"
        slots = f"at most one task per client slot ({self.parallel_slots} slot(s))"
        return f"{'batched, ' if config.clients.batched else ''}auto, {slots}"

    def _batched_on_gpus(self) -> bool:
        clients = self.ctx.config.clients
        return bool(clients.batched and clients.num_gpus and self.gpu_slots)

    def tasks_for(self, num_clients: int) -> int:
        """How many tasks to split the round's clients into.

        `clients.per_task: auto` packs from measurement: a task should carry at least
        MIN_TASK_SECONDS of training (about Ray's own cost of one more task here), and there
        are never more tasks than free slots. Rounds of a few very small clients thus run in
        one task; anything heavier spreads over every slot (measured on digits, 10 clients of
        ~0.5 ms: 2 tasks 8.3-8.7 ms a round, 1 task 9.5-9.9 ms). Packing never changes results
        (updates are reduced per client in client-id order), only speed.
        """
        if self.ctx.config.run.round_deadline_s is not None:
            # One client per task, whatever clients.per_task says: a late task is cancelled
            # with all its clients, so a hanging client must not take honest clients with it.
            return num_clients
        per_task = self.ctx.config.clients.per_task
        if per_task != "auto":
            return math.ceil(num_clients / per_task)
        # Batched clients on GPUs: one task per GPU, each batching its whole share of the
        # round (several tasks on one GPU would each fill it with a fraction of the clients,
        # and pay a task round trip each). On CPUs a client slot is the device: one task per
        # slot at most, fewer when the round's work is small (below).
        slots = self.gpu_slots if self._batched_on_gpus() else self.parallel_slots
        if self.seconds_per_client is None:  # first rounds: nothing measured yet
            return min(num_clients, slots)
        worth = int(num_clients * self.seconds_per_client / self.MIN_TASK_SECONDS)
        return max(1, min(num_clients, slots, worth))

    MIN_TASK_SECONDS = 0.002

    def _record_client_seconds(self, stats: RoundStats) -> None:
        """The seconds a client's training takes in a task, from a round's stats."""
        self.rounds_run += 1
        if stats.clients_done and stats.tasks and self.rounds_run > 1:  # round 1: start-up
            measured = stats.client_compute_s / stats.clients_done
            previous = self.seconds_per_client
            self.seconds_per_client = (
                measured if previous is None else 0.7 * previous + 0.3 * measured
            )

    def _stop_server_place(self, why: str) -> None:
        """Train every later round in tasks, where a failing client costs only itself."""
        if self._server_place_off:
            return
        self._server_place_off = True
        self._placement.clear()  # (rounds already decided for the server are decided again)
        print(
            f"raysim: the server actor trained clients and {why}; clients train in tasks for "
            f"the rest of the run",
            file=sys.stderr,
            flush=True,
        )

    def _server_lost(self) -> None:
        """The server actor died; if it was training clients, they are why: no more of that."""
        if self._server_busy:
            self._server_busy = False
            self._stop_server_place("died (a client crashed, e.g. a segfault or out of memory)")
