"""The sections that say where and how a run executes: `runtime:` (the backend and the Ray
cluster), `index:` (FedAwS's nearest-class index and its shards) and `faults:` (injected client
failures and stragglers), each with its own checks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raysim import registry
from raysim.config.limits import MAX_TASK_RESOURCES, MAX_WAIT_S, finite, require


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """The nearest-class index FedAwS mines negatives from (spreadout: topk).

    Each of `shards` holds a contiguous block of class rows (a Ray actor on the Ray backend);
    `options` go to the backend (e.g. faiss IVF's nlist/nprobe, HNSW's M/ef_search).
    """

    backend: str = "exact"
    shards: int = 1
    retrain_every: int = 50  # updates between retrainings of a trained index (faiss IVF)
    # Ray resources per shard actor (shards > 1 on the Ray backend; one shard runs inside the
    # server actor). 0 reserves nothing, right for one box; reserve CPUs/GPUs on a cluster.
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)

    def check(self, source: str, resolve: bool = True) -> None:
        require(source, self.shards >= 1, "index.shards", ">= 1", self.shards)
        every = self.retrain_every
        require(source, every >= 1, "index.retrain_every", ">= 1", every)
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            require(source, value >= 0, f"index.{key}", ">= 0", value)
            require(
                source,
                finite(value) and value <= MAX_TASK_RESOURCES,
                f"index.{key}",
                f"finite and at most {MAX_TASK_RESOURCES:.0f} (a shard actor runs on one machine)",
                value,
            )
        if resolve and ":" in self.backend:  # imported in the driver: the module ships to Ray
            registry.indexes.get(self.backend)


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    backend: str = "ray"  # 'ray' or 'local'
    num_cpus: int | None = None  # CPUs for a local Ray start (None: all)
    address: str | None = None  # 'auto' or 'ray://...' joins an existing cluster
    dashboard_host: str = "127.0.0.1"
    # Start Ray's dashboard with a Ray that raysim starts (a cluster it joins keeps its own).
    # Off saves its process (~4 s of CPU at start, and its polling): batch sweeps, tests.
    dashboard: bool = True
    # A round's client tasks under Ray's SPREAD scheduling: over the cluster's nodes in turn,
    # instead of Ray's default, which fills the submitting node (the server's) first and
    # spills over only when it is busy.
    spread_tasks: bool = False
    # glibc's malloc in processes that train clients: blocks up to 32 MiB from its heap and up
    # to 256 MiB of freed memory kept for reuse, so a batched round's large tensors do not
    # fault in fresh pages every step (raysim.runtime.allocator). False: glibc's defaults.
    tune_malloc: bool = True

    def check(self, source: str, resolve: bool = True) -> None:
        require(
            source,
            self.backend in registry.backends or not resolve,
            "runtime.backend",
            f"one of {', '.join(registry.backends.names())} or package.module:Class",
            self.backend,
        )
        if resolve and ":" in self.backend:
            registry.backends.get(self.backend)  # imported here: it runs in the driver
        cpus = self.num_cpus
        require(source, cpus is None or cpus >= 1, "runtime.num_cpus", ">= 1", cpus)
        host = self.dashboard_host
        require(source, bool(host), "runtime.dashboard_host", "a host address", host)
        require(
            source,
            self.address is None or bool(self.address),
            "runtime.address",
            "'auto', 'ray://host:port' or null",
            self.address,
        )


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Injected client faults (raysim.core.faults), deterministic given `seed`: each
    (round, client, attempt) fails with probability `client_failure_rate` (a hard worker exit
    for `hard_exit_fraction` of failures, else an exception) and is a straggler, delayed by
    `straggler_delay_s`, with probability `straggler_rate`."""

    client_failure_rate: float = 0.0
    hard_exit_fraction: float = 0.5
    straggler_rate: float = 0.0
    straggler_delay_s: float = 0.0
    seed: int = 0

    def check(self, source: str, resolve: bool = True) -> None:
        for key in ("client_failure_rate", "hard_exit_fraction", "straggler_rate"):
            value = getattr(self, key)
            require(source, 0 <= value <= 1, f"faults.{key}", "in [0, 1]", value)
        delay = self.straggler_delay_s
        require(
            source,
            delay >= 0 and finite(delay),
            "faults.straggler_delay_s",
            "a finite number of seconds >= 0",
            delay,
        )
        require(
            source,
            delay <= MAX_WAIT_S,
            "faults.straggler_delay_s",
            f"at most {MAX_WAIT_S:.0f} seconds (1 day)",
            delay,
        )
        require(source, self.seed >= 0, "faults.seed", ">= 0", self.seed)
