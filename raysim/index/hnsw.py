"""Approximate nearest rows with an HNSW graph (hnswlib, inner-product space).

HNSW (Malkov & Yashunin, 2018) links every row to about M near rows in a layered graph; a
search walks the graph greedily keeping the `ef_search` best rows seen. Unlike IVF it has no
centroids to go stale, which matters for FedAwS: spreadout makes the class rows nearly uniform
on the sphere, where IVF's lists stop matching the neighbourhoods.

Updates are in place: hnswlib's `add_items` with a label that already exists overwrites that
element's vector and repairs its links (`updatePoint`: its own neighbour lists are searched
again and its neighbours' lists are refreshed), so no rebuild is needed between rounds.

hnswlib's inner-product "distance" is 1 - u.v; the similarity returned is 1 - distance in
float32 (within ~1e-7 of the dot product). Answers are re-ordered by (similarity, id). A query
for which the graph walk finds fewer than k other rows is searched again with a larger ef.
"""

from __future__ import annotations

import numpy as np

from raysim.index.base import MISSING_ID, as_ids, as_rows, check_search_args, drop_query_and_rank


class HNSWIndex:
    """HNSW graph over rows [row_offset, row_offset + num_rows), updated in place.

    Options:
        M: links per row (default 16); more gives higher recall, more memory, slower build.
        ef_construction: candidate list size while building and updating (default 100).
        ef_search: candidate list size while searching (default 200; at least k + 1 is used).
        threads: threads for build, update and search (None: all CPUs of the process).
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
        threads: int | None = None,
        seed: int = 0,
    ) -> None:
        import hnswlib  # imported here: only configs that choose this backend need it

        if M < 2:
            raise ValueError(f"M must be >= 2, got {M}")
        if ef_construction < 1:
            raise ValueError(f"ef_construction must be >= 1, got {ef_construction}")
        if ef_search < 1:
            raise ValueError(f"ef_search must be >= 1, got {ef_search}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self._hnswlib = hnswlib
        self.num_rows = int(num_rows)
        self.dim = int(dim)
        self.row_offset = int(row_offset)
        self.M = int(M)
        self.ef_construction = int(ef_construction)
        self.ef_search = int(ef_search)
        self.threads = -1 if threads is None else int(threads)
        self.seed = int(seed)
        self.index = None

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
            index.add_items(rows, np.arange(self.num_rows), num_threads=self.threads)
        self.index = index

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        self._require()
        rows = as_rows(rows, self.dim)
        local = as_ids(row_ids, rows.shape[0], self.row_offset + self.num_rows) - self.row_offset
        if local.size and local.min() < 0:
            raise ValueError("row_ids outside this index's rows")
        if local.size:  # existing labels: hnswlib replaces the vector and repairs the links
            self.index.add_items(rows, local, num_threads=self.threads)

    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        self._require()
        query_ids, queries = check_search_args(query_ids, queries, k, None, self.dim)
        wanted = min(k, self.num_rows - 1) if self.num_rows else 0  # a shard may hold < k rows
        local_self = query_ids - self.row_offset
        ef = max(self.ef_search, k + 1)
        ids, sims = self._search(queries, local_self, k, ef)
        short = np.flatnonzero((ids != MISSING_ID).sum(1) < wanted)
        while short.size and ef < 2 * self.num_rows:
            ef *= 2
            ids[short], sims[short] = self._search(queries[short], local_self[short], k, ef)
            short = short[(ids[short] != MISSING_ID).sum(1) < wanted]
        if short.size:
            raise RuntimeError(
                f"HNSW found fewer than {wanted} rows for {short.size} queries even with "
                f"ef={ef}; the graph is disconnected (try a larger M)"
            )
        return np.where(ids == MISSING_ID, MISSING_ID, ids + self.row_offset), sims

    def _search(
        self, queries: np.ndarray, local_self: np.ndarray, k: int, ef: int
    ) -> tuple[np.ndarray, np.ndarray]:
        fetch = min(k + 1, self.num_rows)
        if len(queries) == 0 or fetch == 0:
            nothing = np.empty((len(queries), 0))
            return drop_query_and_rank(local_self, nothing, nothing, k)
        self.index.set_ef(ef)
        try:
            labels, distances = self.index.knn_query(queries, k=fetch, num_threads=self.threads)
        except RuntimeError:  # hnswlib refuses when some query found < fetch rows
            labels, distances = self._search_one_by_one(queries, fetch)
        labels = labels.astype(np.int64)
        sims = (1.0 - distances).astype(np.float32)
        return drop_query_and_rank(local_self, labels, sims, k)

    def _search_one_by_one(self, queries: np.ndarray, fetch: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.full((len(queries), fetch), MISSING_ID, dtype=np.int64)
        distances = np.full((len(queries), fetch), np.inf, dtype=np.float32)
        for row, query in enumerate(queries):
            for count in range(fetch, 0, -1):
                try:
                    found, dist = self.index.knn_query(query[None], k=count, num_threads=1)
                except RuntimeError:
                    continue
                labels[row, :count] = found[0]
                distances[row, :count] = dist[0]
                break
        return labels, distances
