"""Ray backend: stateless client tasks, one server actor, data in the object store.

Per run, the training arrays and the CSR split (indices + offsets) are put in the object store
once; per round the server actor puts the global payload once and every client task reads it
from there (zero-copy for numpy arrays). A task trains several clients one after another
(`clients.per_task`), which amortises Ray's per-task cost. The actor receives the tasks' result
references and folds updates in as tasks finish (`ray.wait`), holding back any task that
finishes before an earlier one so the reduction is always in client-id order.
"""

from __future__ import annotations

import logging
import math
import resource
import time

import numpy as np
import ray

from raysim.config import RuntimeConfig
from raysim.core.algorithm import RunContext
from raysim.core.clients import chunk_clients, train_clients
from raysim.core.server import Server, build_algorithm
from raysim.core.state import RoundStats, ServerState
from raysim.data.datasets import Dataset
from raysim.data.partition import ClientSplit


def connect(runtime: RuntimeConfig, address: str | None = None) -> bool:
    """Join `address` (or runtime.address), or start a local Ray. True if we started it."""
    if ray.is_initialized():
        return False
    address = address or runtime.address
    if address:
        context = ray.init(address=address, logging_level=logging.WARNING)
    else:
        context = ray.init(num_cpus=runtime.num_cpus, include_dashboard=True,
                           dashboard_host=runtime.dashboard_host, logging_level=logging.WARNING)
    url = getattr(context, "dashboard_url", None)
    if url:
        print(f"Ray dashboard: http://{url}", flush=True)
    return True


def peak_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@ray.remote
def _client_task(static, payload, train_x, train_y, indices, offsets, round_index, client_ids):
    ctx, algorithm = static
    return train_clients(ctx, algorithm, payload, train_x, train_y, indices, offsets,
                         round_index, client_ids)


@ray.remote(num_cpus=0)
class ServerActor:
    """Holds the global state; aggregates a round's updates as the client tasks finish."""

    def __init__(self, ctx: RunContext, test_x: np.ndarray, test_y: np.ndarray) -> None:
        self.server = Server(ctx, test_x, test_y)

    def payload_ref(self) -> list:
        # Wrapped in a list so Ray hands the driver the reference, not the value.
        return [ray.put(self.server.payload())]

    def run_round(self, num_clients: int, task_refs: list, evaluate: bool) -> tuple[RoundStats, list]:
        started = time.perf_counter()
        self.server.start_round(num_clients)
        position = {ref: index for index, ref in enumerate(task_refs)}
        finished: dict[int, list] = {}
        next_index = 0
        pending = list(task_refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                finished[position[ref]] = ray.get(ref)
            while next_index in finished:  # fold in task order = client-id order
                self.server.add(finished.pop(next_index))
                next_index += 1
        clients_s = time.perf_counter() - started
        stats = self.server.finish_round(evaluate)
        # Wall time until the last update was folded in (folding overlaps with training).
        stats.clients_s = clients_s
        return stats, [ray.put(self.server.payload())]

    def get_state(self) -> ServerState:
        return self.server.get_state()

    def set_state(self, state: ServerState) -> list:
        self.server.set_state(state)
        return self.payload_ref()

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes()


class RayBackend:
    name = "ray"

    def __init__(self, ctx: RunContext, dataset: Dataset, split: ClientSplit,
                 address: str | None = None) -> None:
        self.ctx = ctx
        self.started_ray = connect(ctx.config.runtime, address)
        clients = ctx.config.clients
        self.task_options = {"num_cpus": clients.num_cpus, "num_gpus": clients.num_gpus}
        self.static_ref = ray.put((ctx, build_algorithm(ctx)))
        self.data_refs = [ray.put(dataset.train_x), ray.put(dataset.train_y),
                          ray.put(split.indices), ray.put(split.offsets)]
        self.server = ServerActor.remote(ctx, ray.put(dataset.test_x), ray.put(dataset.test_y))
        self.payload_ref = ray.get(self.server.payload_ref.remote())[0]
        cpus = ray.cluster_resources().get("CPU", 1.0)
        self.parallel_slots = max(1, int(cpus // clients.num_cpus))

    def tasks_for(self, num_clients: int) -> int:
        per_task = self.ctx.config.clients.per_task
        if per_task == "auto":
            # One task per free slot: each core trains a contiguous run of clients, so the
            # per-task cost is paid once per core per round.
            return min(num_clients, self.parallel_slots)
        return math.ceil(num_clients / per_task)

    def run_round(self, round_index: int, client_ids: np.ndarray, evaluate: bool) -> RoundStats:
        chunks = chunk_clients(client_ids, self.tasks_for(len(client_ids)))
        task = _client_task.options(**self.task_options)
        task_refs = [task.remote(self.static_ref, self.payload_ref, *self.data_refs, round_index,
                                 chunk) for chunk in chunks]
        stats, next_payload = ray.get(self.server.run_round.remote(len(client_ids), task_refs,
                                                                   evaluate))
        self.payload_ref = next_payload[0]
        return stats

    def get_state(self) -> ServerState:
        return ray.get(self.server.get_state.remote())

    def set_state(self, state: ServerState) -> None:
        self.payload_ref = ray.get(self.server.set_state.remote(state))[0]

    def server_peak_rss_bytes(self) -> int:
        return ray.get(self.server.peak_rss_bytes.remote())

    def describe(self) -> str:
        resources = ray.cluster_resources()
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        return (f"ray backend: {nodes} node(s), {resources.get('CPU', 0):g} CPUs, "
                f"{resources.get('GPU', 0):g} GPUs; {self.parallel_slots} client slots")

    def shutdown(self) -> None:
        ray.kill(self.server)
        if self.started_ray:
            ray.shutdown()
