"""Ray backend: stateless client tasks, one server actor, data in the object store.

Per run, the training arrays and the CSR split (indices + offsets) are put in the object store
once; per round the server actor puts the global payload once and every client task reads it
from there (zero-copy for numpy arrays). A task trains several clients one after another
(`clients.per_task`), which amortises Ray's per-task cost. The actor receives the tasks' result
references and folds updates in as tasks finish (`ray.wait`), holding back any task that
finishes before an earlier one so the reduction is always in client-id order.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import math
import os
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import ray

from raysim import registry
from raysim.config import RuntimeConfig
from raysim.core.algorithm import RunContext
from raysim.core.clients import chunk_clients, single_class_of_clients, train_clients
from raysim.core.faults import CapacityWatch, FaultPlan, InjectedClientFailure, ServerLost
from raysim.core.server import Server, build_algorithm
from raysim.core.state import RoundInfo, RoundStats, ServerState
from raysim.data.datasets import Dataset
from raysim.data.partition import ClientSplit
from raysim.errors import RaysimError
from raysim.outputs.environment import peak_rss_bytes
from raysim.plugins import modules_to_ship
from raysim.runtime import client_state
from raysim.runtime.devices import task_num_gpus
from raysim.runtime.ray_metrics import RoundMetrics

# Task results up to this size travel inline to their owner (the server actor) instead of
# through the shared-memory object store: a round of small client updates (e.g. 10 x 38 KB)
# then costs ~1 ms less. Only applied when raysim starts Ray itself.
INLINE_RESULT_BYTES = 1 << 20
# Payloads up to Ray's default inline size (100 KiB) go inside the task spec by value, which is
# cheaper than a put (~1 ms here); larger ones are put in the object store once per round.
INLINE_PAYLOAD_BYTES = 100 * 1024


def disconnect() -> None:
    ray.shutdown()
    end_loopback_only()


def end_loopback_only() -> None:
    """Undo `loopback_only`: a later Ray of this process (a cluster it joins) is not local."""
    if _RESTORE_LOCAL_ONLY:
        from ray._private import ray_constants

        previous = _RESTORE_LOCAL_ONLY.pop()
        os.environ.pop(LOCAL_ONLY_ENV, None)
        ray_constants.ENABLE_RAY_CLUSTER = previous


def connect(
    runtime: RuntimeConfig, address: str | None = None, include_dashboard: bool = True
) -> bool:
    """Join `address` (or runtime.address), or start a local Ray. True if we started it.

    The user's plug-in modules (named by import path in the config or registered from their
    code; raysim.plugins) go to every worker of the job as `runtime_env` py_modules, on a
    local Ray and on a cluster alike. Resolve the config's plug-ins before connecting."""
    if ray.is_initialized():
        return False
    # RAY_ADDRESS is how `ray job submit` and users point drivers at a cluster: join it (a
    # cluster raysim did not start never gets raysim's _system_config).
    address = address or runtime.address or os.environ.get("RAY_ADDRESS") or None
    runtime_env = plugin_runtime_env()
    if address:
        check_reachable(address)
        try:
            context = ray.init(
                address=address, logging_level=logging.WARNING, runtime_env=runtime_env
            )
        except (ConnectionError, TimeoutError) as error:
            raise RaysimError(_unreachable(address, error)) from None
    else:
        loopback_only(runtime)
        context = ray.init(
            num_cpus=runtime.num_cpus,
            include_dashboard=include_dashboard,
            dashboard_host=runtime.dashboard_host,
            logging_level=logging.WARNING,
            runtime_env=runtime_env,
            _system_config={"max_direct_call_object_size": INLINE_RESULT_BYTES},
        )
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", flush=True)
    check_token_file()
    return True


# Ray's switch for a local-only Ray (its default on macOS and Windows): the node's address is
# the loopback one, and every server Ray starts (GCS, raylet, object manager, workers, the
# dashboard agent, the runtime-env agent, the Prometheus metrics endpoints) binds to it. On
# Linux Ray binds them to the machine's routable address; `_node_ip_address="127.0.0.1"` is
# mapped back to that address (services.resolve_ip_for_localhost), and the metrics endpoints
# answered anyone with the run's name, losses and the host's process list. Ray offers no
# other setting for this.
LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only(runtime: RuntimeConfig) -> bool:
    """Make the Ray that raysim is about to start on this machine listen on 127.0.0.1 only,
    unless the user asked otherwise (the variable set, or a dashboard_host that is not a
    loopback address). True if it will."""
    if os.environ.get(LOCAL_ONLY_ENV) is not None:
        return os.environ[LOCAL_ONLY_ENV] == "0"
    if runtime.dashboard_host not in ("127.0.0.1", "localhost", "::1"):
        return False
    os.environ[LOCAL_ONLY_ENV] = "0"  # for Ray's processes (they read it when they start)
    from ray._private import ray_constants

    _RESTORE_LOCAL_ONLY.append(ray_constants.ENABLE_RAY_CLUSTER)
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process read it when ray was imported
    return True


_RESTORE_LOCAL_ONLY: list[bool] = []  # what disconnect() puts back


def check_token_file() -> None:
    """One line if Ray's token file (~/.ray/auth_token) can be read by others: whoever reads
    it may use the cluster (Ray writes it 0644)."""
    import stat

    path = Path.home() / ".ray" / "auth_token"
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        print(
            f"raysim: warning: Ray's token file {path} is readable by other users (mode "
            f"{stat.S_IMODE(mode):o}); whoever reads it may use this Ray: chmod 600 {path}",
            file=sys.stderr,
            flush=True,
        )


def _unreachable(address: str, reason: object) -> str:
    reason = " ".join(str(reason).split())[:200]
    return (
        f"cannot reach a Ray cluster at {address!r} ({reason}); start one with `ray start "
        f"--head` and pass its address (or --address auto on its head node), or leave "
        f"--address and RAY_ADDRESS unset to start a local Ray"
    )


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a cluster address nothing listens on (ray.init would retry for minutes):
    one TCP connection to HOST:PORT or ray://HOST:PORT; 'auto' is checked by ray.init."""
    import socket

    if address == "auto" or address.startswith("local"):
        return
    target = address.removeprefix("ray://").split("/")[0]
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise RaysimError(f"Ray address {address!r} is not 'auto', HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as error:
        raise RaysimError(_unreachable(address, error)) from None


def _granted_gpus(ctx: RunContext, cluster_gpus: float) -> RunContext:
    """The run context with the GPUs its tasks and server actor really get: a request the
    cluster cannot meet (no GPU in it) becomes 0, said once here, in the driver, so that the
    workers use the CPU without repeating the notice and nothing waits forever for a GPU."""
    config = ctx.config
    clients_gpus = task_num_gpus(config.clients.num_gpus, cluster_gpus)
    server_gpus = task_num_gpus(
        config.server.num_gpus,
        cluster_gpus,
        key="server.num_gpus",
        fallback="the server runs on the CPU",
    )
    if (clients_gpus, server_gpus) == (config.clients.num_gpus, config.server.num_gpus):
        return ctx
    granted = dataclasses.replace(
        config,
        clients=dataclasses.replace(config.clients, num_gpus=clients_gpus),
        server=dataclasses.replace(config.server, num_gpus=server_gpus),
    )
    return dataclasses.replace(ctx, config=granted)


def check_resources_fit(config) -> None:
    """A client task (or the server actor) asking for more CPUs or GPUs than any node has
    would wait forever: refuse it in one line. (No GPU at all: they fall back to the CPU,
    with a notice.)"""
    clients = config.clients
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        return
    most_cpus = max(n.get("CPU", 0.0) for n in nodes)
    if clients.num_cpus > most_cpus:
        raise RaysimError(
            f"clients.num_cpus={clients.num_cpus:g} but the largest node of the Ray cluster has "
            f"{most_cpus:g} CPUs: a client task could never start; lower clients.num_cpus"
        )
    most_gpus = max(n.get("GPU", 0.0) for n in nodes)
    if most_gpus and clients.num_gpus > most_gpus:
        raise RaysimError(
            f"clients.num_gpus={clients.num_gpus:g} but the largest node of the Ray cluster has "
            f"{most_gpus:g} GPUs: a client task could never start; lower clients.num_gpus"
        )
    if most_gpus and config.server.num_gpus > most_gpus:
        raise RaysimError(
            f"server.num_gpus={config.server.num_gpus:g} but the largest node of the Ray cluster "
            f"has {most_gpus:g} GPUs: the server could never start; lower server.num_gpus"
        )


def plugin_runtime_env() -> dict | None:
    """The job runtime_env that brings the user's plug-in modules to every worker of a Ray that
    raysim starts or joins (None: no user modules)."""
    user_modules = modules_to_ship()
    if not user_modules:
        return None
    print(f"raysim: sending plug-in code to the workers: {', '.join(user_modules)}", flush=True)
    return {"py_modules": user_modules}


def ship_plugins_by_value() -> None:
    """Ray was started by someone else (a notebook's ray.init, a test session), so the job's
    runtime_env is not raysim's to set: the user's plug-in modules are pickled by value
    instead, inside the objects the workers receive (the run context carries every plug-in
    the driver resolved, raysim.registry.snapshot)."""
    import sys

    from ray import cloudpickle

    names = [
        Path(path).stem if path.endswith(".py") else Path(path).name for path in modules_to_ship()
    ]
    for name in names:
        cloudpickle.register_pickle_by_value(sys.modules[name])
    if names:
        print(
            f"raysim: Ray was started outside raysim; sending plug-in modules by value: "
            f"{', '.join(names)}",
            flush=True,
        )


def build_index_with_actors(backend: str, num_rows: int, dim: int, *, shards: int = 1, **kw):
    """raysim.index.build_index with shards as Ray actors when there are several."""
    from raysim.index import build_index

    return build_index(backend, num_rows, dim, shards=shards, use_ray=shards > 1, **kw)


# Per worker process: the run's immutable bundle (context, algorithm, training data), fetched
# once per run instead of once per task. Only the newest run is kept.
_RUN_BUNDLE_CACHE: dict[str, tuple] = {}


def _run_bundle(run_ref: ray.ObjectRef) -> tuple:
    key = run_ref.hex()
    bundle = _RUN_BUNDLE_CACHE.get(key)
    if bundle is None:
        _RUN_BUNDLE_CACHE.clear()
        ctx, algorithm, train_x_ref, *rest = ray.get(run_ref)
        bundle = _RUN_BUNDLE_CACHE[key] = (ctx, algorithm, ray.get(train_x_ref), *rest)
    return bundle


@ray.remote(num_returns=2)
def _load_dataset_task(config, plugins) -> tuple:
    # Runs on a worker: the feature array goes from the worker's memory straight into the
    # object store, so the driver never holds (or maps) the largest array of the run.
    # `plugins`: names registered in the driver's code (a dataset plug-in among them).
    from raysim.data.datasets import load_dataset

    registry.install(plugins)
    dataset = load_dataset(config)
    shape = dataset.train_x.shape[1:]
    light = dataclasses.replace(dataset, train_x=np.empty((0, *shape), dtype=np.float32))
    return light, dataset.train_x


def load_dataset_in_cluster(config) -> tuple[Dataset, ray.ObjectRef]:
    """Load the dataset in a Ray task; returns it without features, plus their reference.

    The driver needs only labels (to partition), shapes and the test split; the training
    features stay in the object store, read zero-copy by the client tasks.
    """
    # At most a client task's CPUs, so it fits a Tune trial's placement group (raysim/tune.py).
    load_task = _load_dataset_task.options(num_cpus=min(1.0, config.clients.num_cpus))
    light_ref, train_x_ref = load_task.remote(config, registry.snapshot())
    try:
        return ray.get(light_ref), train_x_ref
    except ray.exceptions.RayTaskError as error:
        if isinstance(error.cause, RaysimError):  # bad data/config: one clear message, as locally
            raise error.cause from None
        missing = _import_error_in(error)
        if missing is not None:
            raise RaysimError(_worker_cannot_import(missing)) from None
        raise


def _import_error_in(error: BaseException) -> ImportError | None:
    """The ImportError behind a Ray task error (nested task errors, exception chains), if any:
    a module the driver imports but a worker cannot (not installed there, not shipped)."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, ImportError):
            return error
        seen += 1
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__
    return None


def _worker_cannot_import(error: ImportError) -> str:
    name = error.name or " ".join(str(error).split())[:200]
    return (
        f"a Ray worker cannot import module {name!r} ({' '.join(str(error).split())[:200]}): "
        "install it on every node of the cluster, or name it in the config as a plug-in "
        "(module:attr) so raysim ships it (docs/EXTENDING.md)"
    )


@ray.remote
def _client_task(
    run_ref: list, payload, round_index: int, client_ids: np.ndarray, personal=None, attempts=None
) -> list:
    # run_ref arrives wrapped in a list so Ray passes the reference and the worker can cache
    # the bundle; the payload (new every round) is resolved by Ray before the task starts.
    # `personal`: the clients' own payloads (FedAwS: their class rows), only theirs.
    # `attempts`: each client's attempt (None: all 0); injected faults depend on it, and an
    # injected hard exit really ends this worker (raysim.core.faults).
    updates, seconds = _train_with_bundle(
        run_ref[0], payload, round_index, client_ids, personal, attempts, hard_exits=True
    )
    # The node id shows where clients ran (summary.json's task_nodes; multi-node runs).
    return updates, seconds, ray.get_runtime_context().get_node_id()


@ray.remote
def _warm_task(run_ref: list) -> int:
    # Starts a client worker and caches the run's bundle in it (ServerActor._warm_workers);
    # the short sleep keeps it busy so that the other warm tasks start workers of their own.
    _run_bundle(run_ref[0])
    time.sleep(0.2)
    return os.getpid()


def _train_with_bundle(
    run_ref, payload, round_index: int, client_ids, personal, attempts=None, hard_exits=False
) -> tuple[list, float]:
    """The clients' training with the run's cached bundle, in this process (a client task, or
    the server actor for a small round): their updates and the seconds it took."""
    started = time.perf_counter()
    ctx, algorithm, train_x, train_y, indices, offsets = _run_bundle(run_ref)
    updates = train_clients(
        ctx,
        algorithm,
        payload,
        train_x,
        train_y,
        indices,
        offsets,
        round_index,
        client_ids,
        personal,
        attempts=attempts,
        hard_exits=hard_exits,
    )
    return updates, time.perf_counter() - started


# How often a round waiting for client tasks checks that a node can still run them.
CAPACITY_CHECK_S = 5.0

# The most a round's deadline is extended while that round starts client workers.
WORKER_START_ALLOWANCE_S = 60.0


@dataclasses.dataclass(frozen=True)
class _Dropped:
    """A client that sends nothing this round (out of retries, or `late` for the deadline)."""

    client_id: int
    late: bool = False


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
        test_x: np.ndarray,
        test_y: np.ndarray,
        client_classes: np.ndarray,
        client_sizes: np.ndarray,
        val_x: np.ndarray | None = None,
        val_y: np.ndarray | None = None,
    ) -> None:
        self.server = Server(
            ctx,
            test_x,
            test_y,
            client_classes,
            client_sizes=client_sizes,
            val_x=val_x,
            val_y=val_y,
        )
        self.run_ref = run_ref
        clients = ctx.config.clients
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        num_gpus = task_num_gpus(clients.num_gpus, cluster_gpus, notice=False)  # driver tells
        # Ray's own retries are off: a failed task comes back to run_round, which retries its
        # clients with per-client attempts (raysim.core.faults) so results stay deterministic.
        self.task = _client_task.options(
            num_cpus=clients.num_cpus, num_gpus=num_gpus, max_retries=0, retry_exceptions=False
        )
        self.task_cpus, self.task_gpus = clients.num_cpus, num_gpus
        self.capacity = CapacityWatch(clients.num_cpus, num_gpus)
        self.faults = FaultPlan.from_config(ctx.config)
        self.max_retries = clients.max_retries
        # Tasks for a round whose clients failed inside this actor (_run_round_here).
        self.fallback_tasks = int(ray.cluster_resources().get("CPU", 1.0) // clients.num_cpus)
        self.deadline_s = ctx.config.run.round_deadline_s
        # Starting a client worker (Python, torch, the run's data; 1-3 s here, more under load)
        # is not lateness. A round that starts workers (the first one this actor runs, and any
        # after a round that cancelled tasks) counts its deadline from the first update's
        # arrival (or, if none arrives, WORKER_START_ALLOWANCE_S later). A late task is
        # cancelled with force, which ends its worker (a plain cancel raises KeyboardInterrupt
        # anywhere in the task, even inside a module's first import, and leaves a broken worker
        # for later tasks), so the next round starts replacements. Timed from the dispatch, a
        # 1 s deadline on 20 ms rounds trained nothing: 0 of 64 updates in 8 rounds; adding a
        # start time measured once was not enough either (round 1 may find warm workers and
        # measure 0.05 s, while replacements under load took seconds: 0 updates in a round).
        self.workers_starting = True
        self._publish_payload()
        self._prefetched: tuple[int, float, list, list] | None = None
        # A small next round's training, started on a thread (see _run_round_here).
        self._prefetched_here: tuple[int, Future] | None = None
        self._trainer: ThreadPoolExecutor | None = None
        self.metrics = RoundMetrics(ctx.config.run.name)  # Ray dashboard: rounds, updates, bytes
        self.nodes: Counter[str] = Counter()  # client tasks per node id

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
        if self.deadline_s is not None and self.workers_starting:
            self._warm_workers()
        refs = [self._submit(info.round_index, chunk) for chunk in chunks]
        return info.round_index, time.perf_counter(), refs, chunks

    def _warm_workers(self) -> None:
        """Start the client workers (Python, torch, the run's data) before a round with a
        deadline is dispatched, on every slot: a task that waits for its worker to start is
        not late. Counting from the first update alone was not enough: one slot's worker up,
        the other's still starting, and its honest clients were cut (4 of 8 in some rounds
        of a 1 s deadline with no slow client)."""
        warm = _warm_task.options(num_cpus=self.task_cpus, num_gpus=self.task_gpus, max_retries=0)
        refs = [warm.remote(self.run_ref) for _ in range(max(1, self.fallback_tasks))]
        # (one not done by then is left to finish: cancelling it would end its worker)
        ray.wait(refs, num_returns=len(refs), timeout=WORKER_START_ALLOWANCE_S)

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
        call_started = time.perf_counter()
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
        round_index = info.round_index
        # The deadline counts from this call at the earliest: tasks dispatched ahead (with the
        # round before) waited meanwhile for the driver, not for their clients.
        deadline_from = max(started, call_started)
        # A "slot" is a contiguous run of the round's clients (ascending ids) whose result is
        # pending, keyed by its first client id. Results are folded in key order = client-id
        # order; a failed task's slot is split into smaller slots that are resubmitted.
        tasks = {
            ref: (chunk, np.zeros(len(chunk), dtype=np.int64))
            for ref, chunk in zip(task_refs, chunks, strict=True)
        }
        keys = [int(chunk[0]) for chunk in chunks]
        heapq.heapify(keys)
        live = set(keys)
        finished: dict[int, list] = {}
        compute_s = 0.0
        retries = 0
        pending = list(task_refs)
        deadline = None if self.deadline_s is None else deadline_from + self.deadline_s
        starting_workers = self.workers_starting and deadline is not None
        if starting_workers:
            deadline += WORKER_START_ALLOWANCE_S
        self.workers_starting = False

        def submit(client_ids: np.ndarray, attempts: np.ndarray) -> None:
            nonlocal retries
            ref = self._submit(round_index, client_ids, attempts)
            tasks[ref] = (client_ids, attempts)
            pending.append(ref)
            retries += 1
            key = int(client_ids[0])
            if key not in live:
                live.add(key)
                heapq.heappush(keys, key)

        def finish(key: int, entries: list) -> None:
            if key not in live:
                live.add(key)
                heapq.heappush(keys, key)
            finished[key] = entries

        def failed(client_ids: np.ndarray, attempts: np.ndarray, culprit: int | None) -> None:
            """The task of `client_ids` failed, caused by `culprit` (None: unknown)."""
            if culprit is not None:
                position = int(np.searchsorted(client_ids, culprit))
                if position >= len(client_ids) or client_ids[position] != culprit:
                    culprit = None  # not one of this task's clients: nobody to blame
            if culprit is None and len(client_ids) > 1:
                # Nobody to blame: each client alone again, at the same attempt; the one that
                # fails again is then blamed (a task of one client is its own culprit).
                for position in range(len(client_ids)):
                    submit(client_ids[position : position + 1], attempts[position : position + 1])
                return
            if culprit is None:
                position, culprit = 0, int(client_ids[0])
            self.server.record_failure(culprit)
            attempts = attempts.copy()
            attempts[position] += 1
            if position:  # the clients before it trained fine: again, at the same attempts
                submit(client_ids[:position], attempts[:position])
            rest, rest_attempts = client_ids[position:], attempts[position:]
            if attempts[position] > self.max_retries:  # out of retries: dropped this round
                finish(culprit, [_Dropped(culprit)])
                rest, rest_attempts = rest[1:], rest_attempts[1:]
            if len(rest):
                submit(rest, rest_attempts)

        while pending:
            # Woken every CAPACITY_CHECK_S to see that some live node can still run a client
            # task (CapacityWatch): losing the last node with CPUs hung a run forever.
            timeout = CAPACITY_CHECK_S
            if deadline is not None:
                timeout = min(timeout, max(0.0, deadline - time.perf_counter()))
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done and (deadline is None or time.perf_counter() < deadline):
                self.capacity.check(ray.nodes(), time.perf_counter())
                continue
            self.capacity.since = None
            if not done:  # the round's deadline passed: cancel what runs, drop its clients
                for ref in pending:
                    ray.cancel(ref, force=True)  # ends the worker (see __init__)
                    self.workers_starting = True  # the next round starts replacements
                    client_ids, _ = tasks.pop(ref)
                    finish(int(client_ids[0]), [_Dropped(int(c), late=True) for c in client_ids])
                pending = []
            else:
                client_ids, attempts = tasks.pop(done[0])
                try:
                    updates, task_s, node_id = ray.get(done[0])
                except ray.exceptions.RayTaskError as error:
                    if isinstance(error.cause, RaysimError):  # bad input found in the task
                        raise error.cause from None  # (e.g. a sum leaving int64): one line
                    if not isinstance(error.cause, InjectedClientFailure):
                        raise  # an error in the client code itself: a bug, not a fault
                    failed(client_ids, attempts, error.cause.client_id)
                except ray.exceptions.RayError:  # the worker died (or its node, or an object)
                    culprit = None
                    if self.faults is not None:
                        culprit = self.faults.crash_culprit(round_index, client_ids, attempts)
                    failed(client_ids, attempts, culprit)
                else:
                    self.nodes[node_id] += 1
                    finished[int(client_ids[0])] = updates
                    compute_s += task_s
                    if deadline is not None:
                        # A worker is up (the start allowance ends), and every update gives the
                        # clients still pending deadline_s more: clients queued behind others
                        # for a slot are not late, a hanging one is once nothing else arrives
                        # (a fixed cut lost honest clients queued on a loaded machine).
                        following = time.perf_counter() + self.deadline_s
                        deadline = (min if starting_workers else max)(deadline, following)
                        starting_workers = False
            while keys and keys[0] in finished:  # fold in client-id order
                key = heapq.heappop(keys)
                live.discard(key)
                for entry in finished.pop(key):
                    if isinstance(entry, _Dropped):
                        self.server.drop(entry.client_id, late=entry.late)
                    else:
                        self.server.add([entry])
        # Wall time until the last update was folded in (folding overlaps with training).
        clients_s = time.perf_counter() - started
        stats = self.server.finish_round(evaluate)
        stats.clients_s = clients_s
        stats.client_compute_s = compute_s
        stats.tasks = len(task_refs)
        stats.task_retries = retries
        self.metrics.record(stats)
        self._publish_payload()
        if next_round is not None and next_round[1] is not None:
            self._prefetched = self._dispatch(*next_round)
        return stats

    def _train_here(self, info: RoundInfo, payload, personal) -> tuple[list, float]:
        """Train a round's clients in this process with the code and bundle a task uses (the
        same updates, bit for bit); returns the updates and the seconds it took."""
        return _train_with_bundle(
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
            ids = info.trained_ids
            chunks = chunk_clients(ids, max(1, min(len(ids), self.fallback_tasks)))
            stats = self.run_round(info, chunks, evaluate, None)
            stats.server_place_failed = f"{type(error).__name__}: {error}"[:200]
            return stats
        self.server.add(updates)
        stats = self.server.finish_round(evaluate)
        stats.clients_s = stats.client_compute_s = compute_s
        stats.tasks = 0  # none: trained in the server actor
        self.metrics.record(stats)
        self._publish_payload()
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

    def get_state(self) -> ServerState:
        return self.server.get_state()

    def set_state(self, state: ServerState) -> None:
        self.server.set_state(state)
        self._prefetched = None  # dispatched against the old payload
        self._prefetched_here = None
        self._publish_payload()

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes()

    def task_nodes(self) -> dict[str, int]:
        return dict(self.nodes)


class RayBackend:
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
            split, ctx = prepare(dataset)
            backend = cls(ctx, dataset, split, train_x_ref)
        except BaseException:
            if started_ray:
                disconnect()
            raise
        backend.started_ray = started_ray
        return backend

    def __init__(
        self, ctx: RunContext, dataset: Dataset, split: ClientSplit, train_x_ref: ray.ObjectRef
    ) -> None:
        """Ray must be connected (see `connect`); `train_x_ref` holds the training features."""
        ctx = client_state.attach(ctx, "ray")  # a store actor only if the algorithm uses one
        # Index shards beyond the first become actors (FedAwS's nearest-class index).
        ctx = dataclasses.replace(ctx, index_builder=build_index_with_actors)
        ctx = _granted_gpus(ctx, ray.cluster_resources().get("GPU", 0.0))
        self.ctx = ctx
        self.dataset, self.split = dataset, split
        self.started_ray = False
        clients = ctx.config.clients
        run_ref = ray.put(
            (
                ctx,
                build_algorithm(ctx),
                train_x_ref,
                dataset.train_y,
                split.indices,
                split.offsets,
            )
        )
        # Kept for restarting the server actor after it died (`restart`).
        self._server_args = (
            ctx,
            [run_ref],
            ray.put(dataset.test_x),
            ray.put(dataset.test_y),
            single_class_of_clients(dataset.train_y, split.indices, split.offsets),
            np.diff(split.offsets),
            None if dataset.val_x is None else ray.put(dataset.val_x),
            None if dataset.val_y is None else ray.put(dataset.val_y),
        )
        self._server_gpus = ctx.config.server.num_gpus  # as granted (_granted_gpus)
        self.server = ServerActor.options(num_gpus=self._server_gpus).remote(*self._server_args)
        self.restarts = 0
        # Test hook: RAYSIM_TEST_KILL_SERVER_AT_ROUND=r kills the server actor once, while it
        # runs round r (1-based), as a crashed server would die.
        kill_at = os.environ.get("RAYSIM_TEST_KILL_SERVER_AT_ROUND")
        self._kill_server_at = int(kill_at) if kill_at else None
        cpus = ray.cluster_resources().get("CPU", 1.0)
        group = ray.util.get_current_placement_group()
        if group is not None:  # e.g. a Tune trial: only its own placement group's CPUs
            cpus = sum(bundle.get("CPU", 0.0) for bundle in group.bundle_specs)
        self.parallel_slots = max(1, int(cpus // clients.num_cpus))
        self.seconds_per_client: float | None = None  # measured, for automatic packing
        self.rounds_run = 0
        # Where each round trains (trains_in_server) and what each place costs, measured.
        self._placement: dict[int, bool] = {}
        self._clients_of: dict[int, int] = {}
        self._cost: dict[str, float | None] = {"tasks": None, "server": None}
        self._cost_round: dict[bool, int] = {False: 0, True: 0}
        self._last_call: tuple[int, float] | None = None
        # Whether the server actor trains (or is about to train) clients in the current call,
        # and whether that place is off for good: a client that kills its process there (a
        # segfault, os._exit, Ray's memory monitor) takes the server with it, while in a task
        # it costs only that client. So after one such loss, or a client exception inside the
        # server, every round trains in tasks.
        self._server_busy = False
        self._server_place_off = False

    # Where a round's clients train, with `clients.per_task: auto`: in tasks (spread over the
    # client slots) or in the server actor (one after another, no task round trip). Which is
    # faster depends on the machine and the clients (on 2 cores, 10 digits clients of ~0.3 ms:
    # 3.7 ms a round in the actor, 8+ ms in tasks; 100 of them: 24 vs 45 ms; 50 LeNet clients
    # of 64 samples: tasks win), so it is measured: each place is timed on consecutive
    # rounds (the time between the driver's calls, per trained client, the first
    # round after a switch not counted), the faster one is used, and the other is timed again
    # every REPROBE_EVERY rounds. Results do not depend on the place (bit for bit).
    REPROBE_EVERY = 50

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
            for old in [r for r in self._placement if r < round_index - 2]:
                del self._placement[old]  # (only the last rounds are ever looked at)
                self._clients_of.pop(old, None)
        return decided

    def _place(self, round_index: int) -> bool:
        if not self._server_eligible() or round_index < 2:  # round 1 starts the workers
            return False
        tasks, server = self._cost["tasks"], self._cost["server"]
        if tasks is None:
            return False
        if server is None:
            return not self._server_cannot_win(tasks)
        faster = server < tasks
        # the slower place is timed again every REPROBE_EVERY rounds (clients grow, the
        # cluster's load changes): it trains until a steady round of it has been measured
        if round_index - self._cost_round[not faster] > self.REPROBE_EVERY:
            return faster if not faster and self._server_cannot_win(tasks) else not faster
        return faster

    def _server_cannot_win(self, tasks_per_client: float) -> bool:
        """Whether timing the server is pointless: it trains a round's clients one after
        another, so a client costs it at least the compute the client took in a task
        (`seconds_per_client`); when that alone is as much as a client's share of a task
        round (the tasks ran in parallel), the server is slower. Probing it anyway cost the
        heavy LeNet rounds of benchmarks/peers three rounds at 1.7-2x the tasks' time."""
        return self.seconds_per_client is not None and self.seconds_per_client >= tasks_per_client

    def _record_round_time(self, round_index: int) -> None:
        """Time the round before this call (the period between two calls) for its place,
        when the round before it trained in the same place (steady state)."""
        now = time.perf_counter()
        previous, self._last_call = self._last_call, (round_index, now)
        if previous is None or previous[0] != round_index - 1:
            return
        earlier = self._placement.get(round_index - 2)
        place = self._placement.get(round_index - 1)
        if place is None or earlier is None or earlier != place:
            return
        per_client = (now - previous[1]) / max(1, self._clients_of.get(round_index - 1, 1))
        key = "server" if place else "tasks"
        self._cost[key] = (
            per_client if self._cost[key] is None else (0.5 * self._cost[key] + 0.5 * per_client)
        )
        self._cost_round[place] = round_index - 1

    def _chunks(self, info: RoundInfo) -> list[np.ndarray] | None:
        """The round's tasks (contiguous runs of its clients), or None: train in the server."""
        ids = info.trained_ids
        self._clients_of[info.round_index] = len(ids)
        if self.trains_in_server(info.round_index):
            return None
        return chunk_clients(ids, self.tasks_for(len(ids)))

    def tasks_for(self, num_clients: int) -> int:
        """How many tasks to split the round's clients into.

        `clients.per_task: auto` packs from measurement: a task should carry at least
        MIN_TASK_SECONDS of training (about Ray's own cost of one more task here), and there
        are never more tasks than free slots. Rounds of a few very small clients thus run in
        one task; anything heavier spreads over every slot (measured on digits, 10 clients of
        ~0.5 ms: 2 tasks 8.3-8.7 ms a round, 1 task 9.5-9.9 ms). Packing never changes results
        (updates are reduced per client in client-id order), only speed.
        """
        per_task = self.ctx.config.clients.per_task
        if per_task != "auto":
            return math.ceil(num_clients / per_task)
        if self.ctx.config.run.round_deadline_s is not None:
            # One client per task: a late task is cancelled with all its clients, so a hanging
            # client must not take the honest clients packed with it.
            return num_clients
        if self.seconds_per_client is None:  # first rounds: nothing measured yet
            return min(num_clients, self.parallel_slots)
        worth = int(num_clients * self.seconds_per_client / self.MIN_TASK_SECONDS)
        return max(1, min(num_clients, self.parallel_slots, worth))

    MIN_TASK_SECONDS = 0.002

    def run_round(
        self, info: RoundInfo, evaluate: bool, next_info: RoundInfo | None = None
    ) -> RoundStats:
        self._record_round_time(info.round_index)
        chunks = self._chunks(info)
        next_round = None if next_info is None else (next_info, self._chunks(next_info))
        call = self.server.run_round.remote(info, chunks, evaluate, next_round)
        # (the next round's clients may start training in the server during this call)
        self._server_busy = chunks is None or (next_round is not None and next_round[1] is None)
        if self._kill_server_at == info.round_index + 1:
            self._kill_server_at = None
            ray.kill(self.server)
        stats = self._get(call)
        if stats.server_place_failed:
            self._stop_server_place(f"a client failed in it ({stats.server_place_failed})")
        self.rounds_run += 1
        if stats.clients_done and stats.tasks and self.rounds_run > 1:  # round 1: start-up
            measured = stats.client_compute_s / stats.clients_done
            previous = self.seconds_per_client
            self.seconds_per_client = (
                measured if previous is None else 0.7 * previous + 0.3 * measured
            )
        return stats

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

    def _lost(self, message: str, error: BaseException) -> ServerLost:
        """ServerLost; if the server was training clients, they are why: no more of that."""
        if self._server_busy:
            self._server_busy = False
            self._stop_server_place("died (a client crashed, e.g. a segfault or out of memory)")
        return ServerLost(message)

    def _get(self, call: ray.ObjectRef):
        """The result of a server actor call; ServerLost if the actor (or an index shard
        actor it calls) died: killed, crashed, its node lost, or ended by Ray's memory monitor
        (OutOfMemoryError). The round loop then calls `restart` and replays rounds. An
        exception the server's own code raised propagates as it is."""
        try:
            return ray.get(call)
        except ray.exceptions.RayTaskError as error:
            cause = error.cause
            if isinstance(cause, RaysimError):  # the user's input, as on the local backend:
                raise cause from None  # one line, not Ray's wrapped traceback
            missing = _import_error_in(error)
            if missing is not None:
                raise RaysimError(_worker_cannot_import(missing)) from None
            if isinstance(cause, ray.exceptions.RayError) and not isinstance(
                cause, ray.exceptions.RayTaskError
            ):
                raise self._lost(f"an actor of the server failed: {cause}", error) from error
            raise
        except ray.exceptions.RayError as error:
            raise self._lost(f"the server actor failed: {error}", error) from error

    def restart(self, state: ServerState | None) -> None:
        """Replace a lost server actor by a new one holding `state` (a checkpointed state,
        client state store included), or, with None, the run's initial state: a new actor
        starts there (init_server is deterministic given the run seed), and the store empty.
        Actors the old server created (FedAwS's index shards) died with it; the algorithm
        rebuilds them from the restored state."""
        try:
            ray.kill(self.server)
        except Exception:  # noqa: BLE001 - it is already gone
            pass
        self.restarts += 1
        self.server = ServerActor.options(num_gpus=self._server_gpus).remote(*self._server_args)
        if state is not None:
            self.set_state(state)
        elif self.ctx.client_state is not None:
            self.ctx.client_state.restore({})

    def get_state(self) -> ServerState:
        return client_state.with_store(self._get(self.server.get_state.remote()), self.ctx)

    def set_state(self, state: ServerState) -> None:
        state = client_state.without_store(state, self.ctx)
        self._get(self.server.set_state.remote(state))

    def server_peak_rss_bytes(self) -> int:
        return self._get(self.server.peak_rss_bytes.remote())

    def task_nodes(self) -> dict[str, int]:
        """How many client tasks ran on each node (by Ray node id) so far (since the server
        actor's last restart)."""
        return self._get(self.server.task_nodes.remote())

    def describe(self) -> str:
        resources = ray.cluster_resources()
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        return (
            f"ray backend: {nodes} node(s), {resources.get('CPU', 0):g} CPUs, "
            f"{resources.get('GPU', 0):g} GPUs; {self.parallel_slots} client slots"
        )

    def shutdown(self) -> None:
        try:
            ray.kill(self.server)
            if self.ctx.client_state is not None:
                self.ctx.client_state.shutdown()
        finally:
            if self.started_ray:
                disconnect()
