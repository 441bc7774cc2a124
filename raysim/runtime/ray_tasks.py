"""What the Ray workers of a run execute: the task that loads the dataset into the object
store, the client tasks that train a task's clients (and, for a round with a deadline, the
timed variant that reports when its training starts), with the run's bundle (context,
algorithm, training data) cached once per worker.

The remote functions keep their names: they are the task names Ray shows (dashboard, errors).
Retries, deadlines and fault handling around the client tasks are the server actor's
(raysim.runtime.ray_round)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import ray

from raysim import registry
from raysim.core.algorithm import RunContext
from raysim.core.clients import train_clients
from raysim.data.datasets import Dataset
from raysim.data.partition import ClientSplit
from raysim.runtime import collector
from raysim.runtime.allocator import tune_malloc
from raysim.runtime.ray_errors import one_line_error


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
        one_line = one_line_error(error)  # bad data/config, a missing module: as locally
        if one_line is not None:
            raise one_line from None
        raise


def put_run_bundle(
    ctx: RunContext, algorithm, train_x_ref: ray.ObjectRef, dataset: Dataset, split: ClientSplit
) -> ray.ObjectRef:
    """The run's immutable bundle in the object store, once per run (read by `run_bundle`)."""
    return ray.put((ctx, algorithm, train_x_ref, dataset.train_y, split.indices, split.offsets))


# Per worker process: the run's immutable bundle (context, algorithm, training data), fetched
# once per run instead of once per task. Only the newest run is kept.
_RUN_BUNDLE_CACHE: dict[str, tuple] = {}


def bundle_cached(run_ref: ray.ObjectRef) -> bool:
    """Whether this worker holds the run's bundle. (A remote function's body must not read
    _RUN_BUNDLE_CACHE itself: Ray pickles the function by value, with a copy of the module
    globals it names, so it would see an empty dict forever; the module's functions it calls
    are pickled by reference and share the worker's one cache.)"""
    return run_ref.hex() in _RUN_BUNDLE_CACHE


def run_bundle(run_ref: ray.ObjectRef) -> tuple:
    """(ctx, algorithm, train_x, train_y, indices, offsets) of the run, from this worker's
    cache."""
    key = run_ref.hex()
    bundle = _RUN_BUNDLE_CACHE.get(key)
    if bundle is None:
        _RUN_BUNDLE_CACHE.clear()
        ctx, algorithm, train_x_ref, *rest = ray.get(run_ref)
        bundle = _RUN_BUNDLE_CACHE[key] = (ctx, algorithm, ray.get(train_x_ref), *rest)
    return bundle


@ray.remote
def _client_task(
    run_ref: list, payload, round_index: int, client_ids: np.ndarray, personal=None, attempts=None
) -> list:
    # run_ref arrives wrapped in a list so Ray passes the reference and the worker can cache
    # the bundle; the payload (new every round) is resolved by Ray before the task starts.
    # `personal`: the clients' own payloads (FedAwS: their class rows), only theirs.
    # `attempts`: each client's attempt (None: all 0); injected faults depend on it, and an
    # injected hard exit really ends this worker (raysim.core.faults).
    updates, seconds = train_with_bundle(
        run_ref[0], payload, round_index, client_ids, personal, attempts, hard_exits=True
    )
    # The node id shows where clients ran (summary.json's task_nodes; multi-node runs).
    return updates, seconds, ray.get_runtime_context().get_node_id()


# The markers a timed client task (a round with a deadline) yields before its result.
LOADING = "raysim:loading"  # this worker fetches the run's bundle first (its first task)
STARTED = "raysim:started"  # the bundle is here: the clients' training begins now


@ray.remote(num_returns="streaming")
def _timed_client_task(
    run_ref: list, payload, round_index: int, client_ids: np.ndarray, personal=None, attempts=None
):
    # _client_task for a round with a deadline (run.round_deadline_s), as a streaming
    # generator: it yields STARTED when its clients' training begins, then _client_task's
    # result. The server times each task's lateness from its own STARTED (ray_round), so a
    # task that waited for a CPU slot, for its worker process to start (Python, imports, the
    # task's arguments: all before this body runs) or for the run's bundle (the dataset's
    # features, the context and algorithm, fetched once per worker) is not late. A worker's
    # first task yields LOADING before fetching the bundle, which bounds a fetch that hangs
    # (ray_round.BUNDLE_LOAD_ALLOWANCE_S). One small object more than a plain task returns.
    if not bundle_cached(run_ref[0]):
        yield LOADING
        run_bundle(run_ref[0])
    yield STARTED
    updates, seconds = train_with_bundle(
        run_ref[0], payload, round_index, client_ids, personal, attempts, hard_exits=True
    )
    yield updates, seconds, ray.get_runtime_context().get_node_id()


def warm_up_training(run_ref: ray.ObjectRef) -> None:
    """What this process's first batched round would pay before its first client trains,
    paid now: the run's bundle and the algorithm's batching check, whose probe is this
    process's first vmapped call (~1 s of torch.func's start on a CPU). The server actor runs
    it on a thread while the first rounds train in tasks, so that moving small rounds into it
    does not stall one round by that second. Nothing it finds is kept but caches: a problem it
    meets is met again, and reported, by the round that trains."""
    from raysim.core.algorithm import AlgorithmHooks
    from raysim.core.batched_training import batching_refusal

    try:
        ctx, algorithm, *_ = run_bundle(run_ref)
        if ctx.config.clients.batched:
            batching_refusal(ctx, AlgorithmHooks.of(algorithm))
    except Exception:  # noqa: BLE001, S110 - see the docstring: the round reports it
        pass


def train_with_bundle(
    run_ref, payload, round_index: int, client_ids, personal, attempts=None, hard_exits=False
) -> tuple[list, float]:
    """The clients' training with the run's cached bundle, in this process (a client task, or
    the server actor for a small round): their updates and the seconds it took."""
    started = time.perf_counter()
    ctx, algorithm, train_x, train_y, indices, offsets = run_bundle(run_ref)
    tune_malloc(ctx.config.runtime.tune_malloc)  # (once per process)
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
    collector.after_round(run_ref.hex())  # a worker may serve several runs, one at a time
    return updates, time.perf_counter() - started
