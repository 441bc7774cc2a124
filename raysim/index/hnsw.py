"""Approximate nearest rows with an HNSW graph (hnswlib, inner-product space).

HNSW (Malkov & Yashunin, 2018) links every row to about M near rows in a layered graph; a
search walks the graph greedily keeping the `ef_search` best rows seen. Unlike IVF it has no
centroids to go stale, which matters for FedAwS: spreadout makes the class rows nearly uniform
on the sphere, where IVF's lists stop matching the neighbourhoods.

Updates are in place. hnswlib's `add_items` with a label that already exists overwrites that
element's vector and repairs its links (`updatePoint`: its neighbour lists are searched again
and its neighbours' lists refreshed), so no rebuild is needed between rounds. That costs about
as much as inserting the row (~1-2 ms at d = 512), which is fine for the 4,000 rows the clients
return but not for the ~10^5 neighbour rows a FedAwS spreadout step nudges every round. Hence
`relink_distance`: the shard keeps its own copy of the current rows; `update` always refreshes
that copy, and re-links a row in the graph only when it moved more than `relink_distance`
(cosine distance 1 - u.v between the linked and the new version; 0, the default, re-links
every changed row). A row that moved less is found through its slightly stale position.

Either way the graph only *proposes* candidates: the k + 1 + extra rows it finds are re-scored
against the current rows with the exact index's float64 dot product (`exact_dot`), so the
similarities are exact and equal the exact backend's for the same pair, and the answer is
ordered by (similarity, id). A query whose graph walk finds fewer than k other rows is searched
again with a larger ef.
"""

from __future__ import annotations

import numpy as np
import torch

from raysim.index.base import MISSING_ID, as_ids, as_rows, check_search_args, drop_query_and_rank
from raysim.index.exact import exact_dot


class HNSWIndex:
    """HNSW graph over rows [row_offset, row_offset + num_rows), updated in place.

    Options:
        M: links per row (default 16); more gives higher recall, more memory, slower build.
        ef_construction: candidate list size while building and re-linking (default 100).
        ef_search: candidate list size while searching (default 200; at least k + 1 + extra).
        extra: candidates fetched beyond k + 1 and re-scored (default max(8, k // 4)).
        relink_distance: re-link a changed row only when it moved more than this cosine
            distance since it was linked (default 0: always).
        threads: threads for search (None: all CPUs of the process); also for build and
            update with `parallel_build`.
        parallel_build: insert rows with `threads` threads (default False: one). hnswlib's
            parallel insertion links rows in the order its threads happen to reach them, so
            the graph, the negatives it finds and the run's results change from run to run
            (seen on the Ray backend: FedAwS's class rows differed between two runs of one
            config). With one thread the graph follows from the rows and `seed` alone, and a
            run is bit-identical across runs and backends; searches are read-only and stay
            parallel. True trades that for a faster build of a large index.
        seed: seeds the graph's level assignment.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        row_offset: int = 0,
        *,
        M: int = 16,  # noqa: N803 - the name every HNSW paper and library uses
        ef_construction: int = 100,
        ef_search: int = 200,
        extra: int | None = None,
        relink_distance: float = 0.0,
        threads: int | None = None,
        parallel_build: bool = False,
        seed: int = 0,
    ) -> None:
        try:
            import hnswlib  # imported here: only configs that choose this backend need it
        except ImportError:
            from raysim.errors import ConfigError

            raise ConfigError(
                "index.backend 'hnsw' needs hnswlib: pip install 'raysim[hnsw]' (it builds "
                "with a C++ compiler); or choose index.backend exact or faiss_ivf"
            ) from None

        if M < 2:
            raise ValueError(f"M must be >= 2, got {M}")
        if ef_construction < 1:
            raise ValueError(f"ef_construction must be >= 1, got {ef_construction}")
        if ef_search < 1:
            raise ValueError(f"ef_search must be >= 1, got {ef_search}")
        if extra is not None and extra < 0:
            raise ValueError(f"extra must be >= 0 or None, got {extra}")
        if not 0.0 <= relink_distance <= 2.0:
            raise ValueError(f"relink_distance must be in [0, 2], got {relink_distance}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self._hnswlib = hnswlib
        self.num_rows = int(num_rows)
        self.dim = int(dim)
        self.row_offset = int(row_offset)
        self.M = int(M)
        self.ef_construction = int(ef_construction)
        self.ef_search = int(ef_search)
        self.extra = extra
        self.relink_distance = float(relink_distance)
        self.threads = -1 if threads is None else int(threads)
        if not isinstance(parallel_build, bool):
            raise ValueError(f"parallel_build must be true or false, got {parallel_build!r}")
        # threads that write the graph (see parallel_build)
        self.build_threads = self.threads if parallel_build else 1
        self.seed = int(seed)
        self.index = None
        self.rows: np.ndarray | None = None
        self.relinked_rows = 0  # diagnostics: rows re-linked by update() so far
        self.skipped_rows = 0  # ... and rows whose small move was not re-linked

    def _require(self) -> None:
        if self.index is None:
            raise RuntimeError("the index is empty: call reset(rows) first")

    def reset(self, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        if rows.shape[0] != self.num_rows:
            raise ValueError(f"reset expects {self.num_rows} rows, got {rows.shape[0]}")
        index = self._hnswlib.Index(space="ip", dim=self.dim)
        index.init_index(
            max_elements=max(1, self.num_rows),
            ef_construction=self.ef_construction,
            M=self.M,
            random_seed=self.seed,
        )
        if self.num_rows:
            index.add_items(rows, np.arange(self.num_rows), num_threads=self.build_threads)
        self.index = index
        self.rows = rows.copy()

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        self._require()
        rows = as_rows(rows, self.dim)
        local = as_ids(row_ids, rows.shape[0], self.row_offset + self.num_rows) - self.row_offset
        if local.size and local.min() < 0:
            raise ValueError("row_ids outside this index's rows")
        if not local.size:
            return
        self.rows[local] = rows
        if self.relink_distance > 0:
            linked = self.index.get_items(local, return_type="numpy")
            moved = 1.0 - np.einsum("ij,ij->i", linked, rows)  # float32 suffices for a threshold
            far = moved > self.relink_distance
            self.skipped_rows += int((~far).sum())
            local, rows = local[far], rows[far]
        if local.size:  # existing labels: hnswlib replaces the vector and repairs the links
            self.index.add_items(rows, local, num_threads=self.build_threads)
            self.relinked_rows += int(local.size)

    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        self._require()
        query_ids, queries = check_search_args(query_ids, queries, k, None, self.dim)
        if not queries.flags.writeable:  # e.g. from Ray's object store; torch wants writable
            queries = queries.copy()
        wanted = min(k, self.num_rows - 1) if self.num_rows else 0  # a shard may hold < k rows
        local_self = query_ids - self.row_offset
        fetch = k + 1 + (self.extra if self.extra is not None else max(8, k // 4))
        ef = max(self.ef_search, fetch)
        ids, sims = self._search(queries, local_self, k, fetch, ef)
        short = np.flatnonzero((ids != MISSING_ID).sum(1) < wanted)
        while short.size and ef < 2 * self.num_rows:
            ef *= 2
            ids[short], sims[short] = self._search(queries[short], local_self[short], k, fetch, ef)
            short = short[(ids[short] != MISSING_ID).sum(1) < wanted]
        if short.size:
            raise RuntimeError(
                f"HNSW found fewer than {wanted} rows for {short.size} queries even with "
                f"ef={ef}; the graph is disconnected (try a larger M)"
            )
        return np.where(ids == MISSING_ID, MISSING_ID, ids + self.row_offset), sims

    def _search(
        self, queries: np.ndarray, local_self: np.ndarray, k: int, fetch: int, ef: int
    ) -> tuple[np.ndarray, np.ndarray]:
        fetch = min(fetch, self.num_rows)
        if len(queries) == 0 or fetch == 0:
            nothing = np.empty((len(queries), 0))
            return drop_query_and_rank(local_self, nothing, nothing, k)
        self.index.set_ef(ef)
        try:
            labels, _ = self.index.knn_query(queries, k=fetch, num_threads=self.threads)
        except RuntimeError:  # hnswlib refuses when some query found < fetch rows
            labels = self._search_one_by_one(queries, fetch)
        labels = labels.astype(np.int64)
        # Re-score every candidate against the current rows: exact similarities.
        found = labels >= 0
        query_rows, slots = np.nonzero(found)
        sims = np.full(labels.shape, -np.inf, dtype=np.float32)
        sims[query_rows, slots] = (
            exact_dot(
                torch.from_numpy(queries),
                torch.from_numpy(query_rows),
                torch.from_numpy(self.rows),
                torch.from_numpy(labels[query_rows, slots]),
            )
            .float()
            .numpy()
        )
        return drop_query_and_rank(local_self, labels, sims, k)

    def _search_one_by_one(self, queries: np.ndarray, fetch: int) -> np.ndarray:
        labels = np.full((len(queries), fetch), MISSING_ID, dtype=np.int64)
        for row, query in enumerate(queries):
            for count in range(fetch, 0, -1):
                try:
                    found, _ = self.index.knn_query(query[None], k=count, num_threads=1)
                except RuntimeError:
                    continue
                labels[row, :count] = found[0]
                break
        return labels
