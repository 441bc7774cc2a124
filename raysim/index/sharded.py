"""A nearest-class index split into contiguous row blocks, in this process or as Ray actors.

Shard s holds rows [start_s, end_s). `update` sends each changed row to its shard; `search`
asks every shard for its local top-k (global ids, the query's own row excluded) and merges the
answers into the global top-k by (similarity descending, id ascending). The merge is the same
code for both executions; with the exact backend the similarities do not depend on the shard
layout, so any number of shards gives the same answer as one.

Ray execution puts one actor per shard. Actors ask for `num_cpus` = 0 by default, like the
server actor: in a federated run the server step (index update + search) never overlaps the
clients' training, so reserving CPUs for the shards would only take them away from the client
tasks for the whole run (and 4 shards could never start on a 2-CPU machine). Each shard still
uses `threads` threads when it works (default: num_cpus if >= 1, else the node's CPUs divided
by the number of shards). Actors are spread over the cluster's nodes when it has several.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from raysim.errors import ConfigError, RaysimError
from raysim.index.base import (
    MISSING_ID,
    as_ids,
    as_rows,
    available_threads,
    check_search_args,
    merge,
)


def shard_bounds(num_rows: int, num_shards: int) -> np.ndarray:
    """Start of each shard plus the end: shard s holds rows [bounds[s], bounds[s + 1])."""
    return np.array([s * num_rows // num_shards for s in range(num_shards + 1)], dtype=np.int64)


class ShardedIndex:
    """The NearestClassIndex the server uses: `num_shards` backend indexes over row blocks."""

    def __init__(
        self,
        backend: str,
        num_shards: int,
        options: Mapping[str, Any] | None = None,
        *,
        num_rows: int,
        dim: int,
        use_ray: bool = False,
        num_cpus: float = 0.0,
        num_gpus: float = 0.0,
    ) -> None:
        from raysim.registry import indexes

        self.backend = backend
        self.num_shards = int(num_shards)
        self.num_rows = int(num_rows)
        self.dim = int(dim)
        self.use_ray = use_ray
        self.bounds = shard_bounds(self.num_rows, self.num_shards)
        options = dict(options or {})
        factory = indexes.get(backend)
        if use_ray:
            import ray

            if not ray.is_initialized():
                raise RaysimError(
                    "a Ray-sharded index needs a running Ray: call ray.init() first "
                    "(or use the ray runtime backend)"
                )
            actor = _shard_actor_class().options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy="SPREAD",
            )
            self.shards = [
                actor.remote(
                    backend,
                    self._shard_rows(s),
                    self.dim,
                    int(self.bounds[s]),
                    options,
                    float(num_cpus),
                    self.num_shards,
                )
                for s in range(self.num_shards)
            ]
        else:
            self.shards = [
                factory(self._shard_rows(s), self.dim, int(self.bounds[s]), **options)
                for s in range(self.num_shards)
            ]

    def _shard_rows(self, shard: int) -> int:
        return int(self.bounds[shard + 1] - self.bounds[shard])

    # --- the NearestClassIndex protocol -------------------------------------------------------
    def reset(self, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        if rows.shape[0] != self.num_rows:
            raise ValueError(f"reset expects {self.num_rows} rows, got {rows.shape[0]}")
        blocks = [rows[self.bounds[s] : self.bounds[s + 1]] for s in range(self.num_shards)]
        self._call_all("reset", [(block,) for block in blocks])

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        row_ids = as_ids(row_ids, rows.shape[0], self.num_rows)
        increasing = row_ids.size < 2 or bool((row_ids[1:] > row_ids[:-1]).all())
        if not increasing and np.unique(row_ids).size != row_ids.size:
            raise ValueError("update(row_ids, ...) got a row id twice")
        shard_of = np.searchsorted(self.bounds, row_ids, side="right") - 1
        calls = {}
        if increasing:  # each shard's rows are one slice: views, no copies (FedAwS's case)
            cuts = np.searchsorted(shard_of, np.arange(self.num_shards + 1))
            for s in range(self.num_shards):
                if cuts[s] < cuts[s + 1]:
                    part = slice(int(cuts[s]), int(cuts[s + 1]))
                    calls[s] = (row_ids[part], rows[part])
        else:
            for s in np.unique(shard_of):
                mine = np.flatnonzero(shard_of == s)
                calls[int(s)] = (row_ids[mine], rows[mine])
        self._call_some("update", calls)

    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        query_ids, queries = check_search_args(query_ids, queries, k, self.num_rows, self.dim)
        if self.use_ray and self.num_shards > 1:
            import ray

            query_ids, queries = ray.put(query_ids), ray.put(queries)  # sent once to all shards
        answers = self._call_all("search", [(query_ids, queries, k)] * self.num_shards)
        ids, sims = merge(answers, k)
        if (ids == MISSING_ID).any():  # a backend bug, never a user error
            raise RuntimeError(f"{self.backend} index returned fewer than k={k} neighbours")
        return ids, sims

    # --- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the shard actors now (they also stop when this object is garbage-collected)."""
        if self.use_ray:
            import ray

            for shard in self.shards:
                ray.kill(shard)
        self.shards = []

    def __enter__(self) -> ShardedIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def diagnostics(self) -> list[dict[str, Any]]:
        """Per-shard counters (e.g. the exact backend's fallback count, IVF trainings)."""
        return self._call_all("diagnostics", [()] * self.num_shards)

    # --- execution ----------------------------------------------------------------------------
    def _call_all(self, method: str, args: list[tuple]) -> list[Any]:
        return list(self._call_some(method, dict(enumerate(args))).values())

    def _call_some(self, method: str, calls: dict[int, tuple]) -> dict[int, Any]:
        if not self.shards:
            raise RuntimeError("the index is closed")
        if self.use_ray:
            import ray

            refs = {s: getattr(self.shards[s], method).remote(*a) for s, a in calls.items()}
            return dict(zip(refs, ray.get(list(refs.values())), strict=True))
        return {s: _call_shard(self.shards[s], method, a) for s, a in calls.items()}


def _call_shard(shard: Any, method: str, args: tuple) -> Any:
    if method == "diagnostics":
        return shard_diagnostics(shard)
    return getattr(shard, method)(*args)


def shard_diagnostics(shard: Any) -> dict[str, Any]:
    """The counters a backend exposes, plus the process id and peak RSS of its process."""
    import os

    from raysim.process_memory import peak_rss_bytes

    names = (
        "row_offset",
        "num_rows",
        "fallback_queries",
        "trainings",
        "relinked_rows",
        "skipped_rows",
    )
    found = {name: getattr(shard, name) for name in names if hasattr(shard, name)}
    return {**found, "pid": os.getpid(), "peak_rss_bytes": peak_rss_bytes()}


_ACTOR_CLASS = None


def _shard_actor_class():
    """The Ray actor class, defined on first use so importing raysim.index needs no Ray."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        @ray.remote(num_cpus=0)
        class IndexShard:
            """One shard in its own process; sets its thread count before building."""

            def __init__(
                self,
                backend: str,
                num_rows: int,
                dim: int,
                row_offset: int,
                options: dict,
                num_cpus: float,
                num_shards: int,
            ) -> None:
                import torch

                from raysim.registry import indexes

                threads = options.get("threads")
                if threads is None:
                    cpus = int(num_cpus) if num_cpus >= 1 else available_threads() // num_shards
                    threads = max(1, cpus)
                torch.set_num_threads(threads)  # this process is the shard's alone
                options = {**options, "threads": threads}
                self.index = indexes.get(backend)(num_rows, dim, row_offset, **options)

            def reset(self, rows: np.ndarray) -> None:
                self.index.reset(rows)

            def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
                self.index.update(row_ids, rows)

            def search(self, query_ids: np.ndarray, queries: np.ndarray, k: int):
                return self.index.search(query_ids, queries, k)

            def diagnostics(self) -> dict[str, Any]:
                return shard_diagnostics(self.index)

        _ACTOR_CLASS = IndexShard
    return _ACTOR_CLASS


def build_index(
    backend: str,
    num_rows: int,
    dim: int,
    *,
    shards: int = 1,
    use_ray: bool = False,
    num_cpus: float = 0.0,
    num_gpus: float = 0.0,
    **options: Any,
) -> ShardedIndex:
    """A ShardedIndex of `backend` ("exact", "faiss_ivf", "hnsw") over num_rows x dim rows.

    `options` are the backend's (see its class: e.g. nlist/nprobe/retrain_every for faiss_ivf,
    M/ef_construction/ef_search for hnsw, threads for both). num_cpus / num_gpus are the Ray
    resources of each shard actor and apply only with use_ray. Bad names and values raise
    ConfigError naming the config key (`index.backend`, `index.shards`, `index.<option>`).
    The index is empty until `reset(rows)`.
    """
    from raysim.registry import indexes

    if backend not in indexes:
        try:
            indexes.get(backend)
        except ConfigError as error:
            raise ConfigError(f"index.backend: {error}") from None
    if isinstance(shards, bool) or not isinstance(shards, int | np.integer):
        raise ConfigError(f"'index.shards' expects an integer, got {shards!r}")
    if not 1 <= shards <= max(1, num_rows):
        raise ConfigError(f"index.shards must be in [1, {num_rows}] (the rows), got {shards}")
    if num_rows < 2 or dim < 1:
        raise ConfigError(f"an index needs >= 2 rows and dim >= 1, got {num_rows} x {dim}")
    for key, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"'index.{key}' expects a number >= 0, got {value!r}")
    options = indexes.check_options(backend, options, "index")
    # Build the smallest shard here (cheap: backends allocate on reset) to check value ranges.
    smallest = int(np.diff(shard_bounds(num_rows, shards)).min())
    try:
        indexes.get(backend)(smallest, dim, 0, **options)
    except ValueError as error:
        raise ConfigError(f"index.{error}") from None
    except ImportError as error:
        raise ConfigError(
            f"index.backend={backend!r} needs a library that is not installed: {error}"
        ) from None
    return ShardedIndex(
        backend,
        shards,
        options,
        num_rows=num_rows,
        dim=dim,
        use_ray=use_ray,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
    )
