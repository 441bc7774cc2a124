"""Approximate nearest rows with a faiss inverted-file index (IndexIVFFlat, inner product).

Rows live in `nlist` lists keyed by their nearest k-means centroid; a search scans the
`nprobe` lists nearest to the query. An array direct map (row id -> list position) lets
`update` move changed rows in place (`update_vectors`: remove from the old list, append to the
list of their new centroid) instead of rebuilding. The centroids themselves go stale as FedAwS
moves the rows, so every `retrain_every` updates the k-means is trained again on the current
rows and the lists are rebuilt.

Similarities are faiss's float32 inner products; the answer is re-ordered by (similarity, id)
so ties are broken as in the exact index. A query whose probed lists hold fewer than k other
rows is searched again with twice the probes, up to all lists (then it is exhaustive).
"""

from __future__ import annotations

import math

import numpy as np

from raysim.index.base import MISSING_ID, as_ids, as_rows, check_search_args, drop_query_and_rank
from raysim.seeds import ivf_training


def default_nlist(num_rows: int) -> int:
    """4 sqrt(n) lists, but at least 39 training rows per list (faiss's k-means minimum)."""
    return max(1, min(int(4 * math.sqrt(num_rows)), num_rows // 39))


class FaissIVFIndex:
    """IVF-Flat over rows [row_offset, row_offset + num_rows), updated in place.

    Options:
        nlist: number of k-means lists (default 4 sqrt(rows), at most rows / 39).
        nprobe: lists scanned per query (default 32); more is slower and more accurate.
        retrain_every: re-train the k-means every this many `update` calls (None: never).
        train_size: rows sampled for k-means (default min(rows, 64 nlist)).
        threads: OpenMP threads for faiss (None: faiss's default, all CPUs; process-wide).
        seed: seeds the k-means and its training sample.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        row_offset: int = 0,
        *,
        nlist: int | None = None,
        nprobe: int = 32,
        retrain_every: int | None = 50,
        train_size: int | None = None,
        threads: int | None = None,
        seed: int = 0,
    ) -> None:
        import faiss  # imported here: only configs that choose this backend need faiss

        self._faiss = faiss
        self.num_rows = int(num_rows)
        self.dim = int(dim)
        self.row_offset = int(row_offset)
        self.nlist = int(nlist) if nlist is not None else default_nlist(self.num_rows)
        if not 1 <= self.nlist <= max(1, self.num_rows):
            raise ValueError(
                f"nlist must be in [1, {self.num_rows}] (the rows of a shard), got {self.nlist}"
            )
        if nprobe < 1:
            raise ValueError(f"nprobe must be >= 1, got {nprobe}")
        if retrain_every is not None and retrain_every < 1:
            raise ValueError(f"retrain_every must be >= 1 or None, got {retrain_every}")
        self.nprobe = min(int(nprobe), self.nlist)
        self.retrain_every = retrain_every
        self.train_size = train_size
        self.seed = int(seed)
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if train_size is not None and train_size < 1:
            raise ValueError(f"train_size must be >= 1 or None, got {train_size}")
        self.threads = threads
        self.updates_since_training = 0
        self.trainings = 0
        self.index = None

    def _build(self, rows: np.ndarray) -> None:
        faiss = self._faiss
        if self.threads is not None:  # process-wide in faiss; set where the shard runs
            faiss.omp_set_num_threads(int(self.threads))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, self.nlist, faiss.METRIC_INNER_PRODUCT)
        index.cp.seed, rng = ivf_training(self.seed, self.trainings)
        size = min(self.num_rows, self.train_size or 64 * self.nlist)
        sample = (
            rows if size >= self.num_rows else rows[np.sort(rng.choice(len(rows), size, False))]
        )
        index.train(np.ascontiguousarray(sample))
        index.add(rows)  # ids 0..n-1 in order: what the array direct map needs
        index.set_direct_map_type(faiss.DirectMap.Array)
        index.quantizer_trains_alone = 0
        self.index = index
        self._quantizer = quantizer  # keep it alive with the index
        self.trainings += 1
        self.updates_since_training = 0

    def _require(self) -> None:
        if self.index is None:
            raise RuntimeError("the index is empty: call reset(rows) first")

    def reset(self, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        if rows.shape[0] != self.num_rows:
            raise ValueError(f"reset expects {self.num_rows} rows, got {rows.shape[0]}")
        self._build(rows)

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        self._require()
        rows = as_rows(rows, self.dim)
        local = as_ids(row_ids, rows.shape[0], self.row_offset + self.num_rows) - self.row_offset
        if local.size and local.min() < 0:
            raise ValueError("row_ids outside this index's rows")
        self.index.update_vectors(np.ascontiguousarray(local), rows)
        self.updates_since_training += 1
        if self.retrain_every is not None and self.updates_since_training >= self.retrain_every:
            self._build(self.index.reconstruct_n(0, self.num_rows))

    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        self._require()
        query_ids, queries = check_search_args(query_ids, queries, k, None, self.dim)
        wanted = min(k, self.num_rows - 1) if self.num_rows else 0  # a shard may hold < k rows
        local_self = query_ids - self.row_offset
        ids, sims = self._search(queries, local_self, k, self.nprobe)
        probes = self.nprobe
        short = np.flatnonzero((ids != MISSING_ID).sum(1) < wanted)
        while short.size and probes < self.nlist:
            probes = min(self.nlist, probes * 2)
            ids[short], sims[short] = self._search(queries[short], local_self[short], k, probes)
            short = short[(ids[short] != MISSING_ID).sum(1) < wanted]
        return np.where(ids == MISSING_ID, MISSING_ID, ids + self.row_offset), sims

    def _search(
        self, queries: np.ndarray, local_self: np.ndarray, k: int, nprobe: int
    ) -> tuple[np.ndarray, np.ndarray]:
        params = self._faiss.SearchParametersIVF(nprobe=nprobe)
        fetch = min(k + 1, self.num_rows)
        sims, ids = self.index.search(queries, fetch, params=params)
        return drop_query_and_rank(local_self, ids, sims, k)
