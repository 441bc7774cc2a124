"""Exact nearest rows by dot product: blocked float32 GEMM, then a float64 re-score.

Why two stages. The float32 GEMM is fast, but its rounding depends on how the matrix is cut
(block sizes, shard boundaries, BLAS kernel choice), so near-ties could be ordered differently
by one shard and by four. The GEMM therefore only *selects candidates*; every candidate that
could still be in the top k is then re-scored by `exact_dot`, whose result is a pure function of
the two vectors (float64 products of float32 inputs are exact, summed by a fixed pairwise tree of
element-wise adds). Final order: float32(re-scored similarity) descending, then id ascending.
Those keys do not depend on the layout, so 1 shard and 4 shards (or CPU and GPU) return the same
ids and the same similarities, bit for bit.

Why the candidate set is complete. For rows of norm <= R and a query q, a float32 dot product of
length d is within delta = gamma_d * |q| * R of the truth (gamma_d = d u / (1 - d u), u = 2^-24,
whatever the summation order). Keep, per query, the m = k + extra best GEMM scores; t = the k-th
of them. Any row left out scored at most s_m, the m-th kept score. If s_m < t - eps with
eps = 2 delta + 2^-22 |q| R, every left-out row is beaten, after re-scoring and float32
rounding, by the k kept rows scoring >= t, so it cannot be in the answer. When a query fails
that test (a pile of near-ties at the boundary), it is searched again collecting *every* row
within the margin: slower, still exact.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from raysim.index.base import (
    MISSING_ID,
    as_ids,
    as_rows,
    check_search_args,
    rank,
    server_threads,
)

_UNIT_ROUNDOFF_FP32 = 2.0**-24
_UNIT_ROUNDOFF_TF32 = 2.0**-11  # CUDA matmuls may run in TF32 when the user allows it
_CPU_CHUNK_ELEMENTS = 1 << 18  # exact_dot's products per chunk on the CPU (2 MB of float64)


def exact_dot(
    left: torch.Tensor,
    left_index: torch.Tensor,
    right: torch.Tensor,
    right_index: torch.Tensor,
    max_elements: int = 1 << 22,
) -> torch.Tensor:
    """Dot products left[left_index[i]] . right[right_index[i]] in float64, layout-free.

    Products of float32 values are exact in float64; they are summed by a fixed binary tree
    (element-wise adds of the two halves of a zero-padded power-of-two width, each correctly
    rounded), so each result depends only on the two rows: not on how many pairs are computed
    together, in what order, or on which device. Pairs are gathered in chunks of
    `max_elements` values, which bounds the working memory. On the CPU the arithmetic runs in
    numpy, the chunks spread over torch's number of threads (each chunk's results are its own:
    the threads change only the time).
    """
    count = left_index.shape[0]
    dim = left.shape[1]
    width = 1 << max(0, math.ceil(math.log2(max(dim, 1))))
    step = max(1, max_elements // width)
    if left.device.type == "cpu":  # chunks that stay in the cache (~2 MB of float64)
        step = max(1, min(max_elements, _CPU_CHUNK_ELEMENTS) // width)
        out = _exact_dot_cpu(
            left.numpy(), left_index.numpy(), right.numpy(), right_index.numpy(), width, step
        )
        return torch.from_numpy(out)
    out = torch.empty(count, dtype=torch.float64, device=left.device)
    for start in range(0, count, step):
        stop = min(count, start + step)
        rows = left[left_index[start:stop]].double() * right[right_index[start:stop]].double()
        if width != dim:
            rows = torch.nn.functional.pad(rows, (0, width - dim))
        half = width
        while half > 1:
            half //= 2
            rows = rows[:, :half] + rows[:, half : 2 * half]
        out[start:stop] = rows[:, 0]
    return out


def _exact_dot_cpu(
    left: np.ndarray,
    left_index: np.ndarray,
    right: np.ndarray,
    right_index: np.ndarray,
    width: int,
    step: int,
) -> np.ndarray:
    """exact_dot on the CPU: chunks of `step` pairs, on torch's number of threads."""
    count, dim = left_index.shape[0], left.shape[1]
    out = np.empty(count, dtype=np.float64)
    starts = list(range(0, count, step))
    threads = min(len(starts), torch.get_num_threads())

    def run(mine: list[int]) -> None:
        products = np.zeros((min(step, count), width), dtype=np.float64)
        for start in mine:
            stop = min(count, start + step)
            rows = products[: stop - start]
            np.multiply(  # float32 x float32 in float64: exact
                left[left_index[start:stop]],
                right[right_index[start:stop]],
                out=rows[:, :dim],
                dtype=np.float64,
            )
            half = width
            while half > 1:
                half //= 2
                np.add(rows[:, :half], rows[:, half : 2 * half], out=rows[:, :half])
            out[start:stop] = rows[:, 0]

    if threads <= 1:
        run(starts)
    else:
        from concurrent.futures import ThreadPoolExecutor  # numpy releases the GIL

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(run, [starts[t::threads] for t in range(threads)]))
    return out


def _norms(rows: np.ndarray) -> np.ndarray:
    """Row norms in float64 without a float64 copy of the rows."""
    return np.sqrt(np.einsum("ij,ij->i", rows, rows, dtype=np.float64))


def _faiss():
    import faiss

    return faiss


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"index.device={device!r} but no CUDA device is visible")
    return torch.device(device)


class ExactIndex:
    """Exact top-k by dot product over rows [row_offset, row_offset + num_rows).

    Options:
        max_block_elements: size of one query-block x row-block score matrix (float32), the
            bound on the search's working memory (default 2^25 = 128 MiB).
        extra: candidates kept beyond k per query (default max(8, k // 4)); more makes the slow
            exact fallback rarer on data with many near-ties.
        device: "cpu", "cuda", "cuda:N", or "auto" (CUDA when visible).
        engine: what computes the float32 candidate scores: "torch" (blocked GEMM + top-k, any
            device) or "faiss" (faiss.knn, CPU only; its bundled BLAS was ~1.5x faster than
            torch's here). "auto": faiss on CPU, torch on GPU. Answers are identical either way
            (the re-score decides them).
        threads: threads while searching (None: every CPU this process may use, whatever it
            inherited: see raysim.index.base.server_threads); restored after.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        row_offset: int = 0,
        *,
        max_block_elements: int = 1 << 25,
        extra: int | None = None,
        device: str = "auto",
        engine: str = "auto",
        threads: int | None = None,
    ) -> None:
        if max_block_elements < 1:
            raise ValueError(f"max_block_elements must be >= 1, got {max_block_elements}")
        if extra is not None and extra < 0:
            raise ValueError(f"extra must be >= 0 or None, got {extra}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if device != "auto" and not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
        if engine not in ("auto", "torch", "faiss"):
            raise ValueError(f"engine must be 'auto', 'torch' or 'faiss', got {engine!r}")
        if engine == "faiss" and device.startswith("cuda"):
            raise ValueError("engine 'faiss' runs on the CPU; use engine 'torch' with device cuda")
        self.engine_option = engine
        self.num_rows = int(num_rows)
        self.dim = int(dim)
        self.row_offset = int(row_offset)
        self.max_block_elements = int(max_block_elements)
        self.extra = extra
        self.device_option = device
        self.threads = threads
        # Allocated by the first reset (where the shard runs), so building one is cheap.
        self.rows: torch.Tensor | None = None
        self.norms = np.zeros(self.num_rows, dtype=np.float64)
        self.fallback_queries = 0  # how many queries needed the exact fallback (diagnostics)

    @property
    def device(self) -> torch.device:
        if self.rows is None:
            raise RuntimeError("the index is empty: call reset(rows) first")
        return self.rows.device

    @property
    def engine(self) -> str:
        if self.engine_option != "auto":
            return self.engine_option
        return "faiss" if self.device.type == "cpu" else "torch"

    # --- content ------------------------------------------------------------------------------
    def reset(self, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        if rows.shape[0] != self.num_rows:
            raise ValueError(f"reset expects {self.num_rows} rows, got {rows.shape[0]}")
        # A copy the index owns (rows may be a read-only view, e.g. from Ray's object store).
        self.rows = torch.tensor(rows, device=_resolve_device(self.device_option))
        self.norms = _norms(rows)

    def update(self, row_ids: np.ndarray, rows: np.ndarray) -> None:
        rows = as_rows(rows, self.dim)
        local = as_ids(row_ids, rows.shape[0], self.row_offset + self.num_rows) - self.row_offset
        if local.size and local.min() < 0:
            raise ValueError("row_ids outside this index's rows")
        device = self.device
        index = torch.from_numpy(local).to(device)
        # rows may be read-only (e.g. from Ray's object store): then torch needs a copy
        source = torch.from_numpy(rows) if rows.flags.writeable else torch.tensor(rows)
        self.rows[index] = source.to(device)
        self.norms[local] = _norms(rows)

    # --- search -------------------------------------------------------------------------------
    def search(
        self, query_ids: np.ndarray, queries: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        query_ids, queries = check_search_args(query_ids, queries, k, None, self.dim)
        if not queries.flags.writeable:  # e.g. from Ray's object store; torch wants writable
            queries = queries.copy()
        count = queries.shape[0]
        out_ids = np.full((count, k), MISSING_ID, dtype=np.int64)
        out_sims = np.full((count, k), -np.inf, dtype=np.float32)
        self.device  # noqa: B018 - raises if reset() was never called
        if count == 0 or self.num_rows == 0:
            return out_ids, out_sims
        if self.engine == "faiss":
            _faiss()  # loaded first, so that its threads are set too
        with server_threads(self.threads):
            return self._search(query_ids, queries, k, out_ids, out_sims)

    def _search(
        self,
        query_ids: np.ndarray,
        queries: np.ndarray,
        k: int,
        out_ids: np.ndarray,
        out_sims: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        count = queries.shape[0]
        extra = self.extra if self.extra is not None else max(8, k // 4)
        keep = min(self.num_rows, k + extra)
        # Score blocks of query_block x row_block <= max_block_elements (rows at least keep + 1
        # wide, so the first block fills the pool): many queries per GEMM, rows in slices.
        block = self.max_block_elements
        query_block = min(count, max(1, block // min(self.num_rows, 4096)))
        row_block = min(self.num_rows, max(keep + 1, block // query_block))
        if self.engine == "faiss":  # faiss.knn bounds its own memory (4096 x 1024 blocks)
            query_block = count
        for start in range(0, count, query_block):
            stop = min(count, start + query_block)
            ids, sims = self._search_block(
                query_ids[start:stop], queries[start:stop], k, keep, row_block
            )
            out_ids[start:stop] = ids
            out_sims[start:stop] = sims
        return out_ids, out_sims

    def _margin(self, queries: torch.Tensor) -> torch.Tensor:
        """eps per query: twice the float32 GEMM error bound plus two float32 ulps of |q| R."""
        unit = _UNIT_ROUNDOFF_FP32
        if self.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
            unit = _UNIT_ROUNDOFF_TF32
        gamma = self.dim * unit / (1 - self.dim * unit)
        scale = torch.linalg.vector_norm(queries.double(), dim=1) * float(self.norms.max())
        return (scale * (2.0 * gamma * 1.01 + 2.0**-22) + 1e-12).float()

    def _scores(self, queries: torch.Tensor, local_self: torch.Tensor, lo: int, hi: int):
        """float32 scores of queries against rows [lo, hi), the query's own row at -inf."""
        scores = queries @ self.rows[lo:hi].T
        inside = (local_self >= lo) & (local_self < hi)
        if bool(inside.any()):
            which = torch.nonzero(inside).squeeze(1)
            scores[which, local_self[which] - lo] = -math.inf
        return scores

    def _search_block(
        self, query_ids: np.ndarray, queries_np: np.ndarray, k: int, keep: int, row_block: int
    ) -> tuple[np.ndarray, np.ndarray]:
        device = self.device
        queries = torch.from_numpy(queries_np).to(device)
        local_self = torch.from_numpy(query_ids - self.row_offset).to(device)
        if self.engine == "faiss":
            pool_sims, pool_ids = self._candidates_faiss(queries_np, query_ids, keep)
        else:
            pool_sims, pool_ids = self._candidates_torch(queries, local_self, keep, row_block)
        return self._finish(queries, local_self, pool_sims, pool_ids, k, keep)

    def _candidates_faiss(
        self, queries: np.ndarray, query_ids: np.ndarray, keep: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 top-keep per query from faiss.knn (exhaustive), own row removed."""
        faiss = _faiss()
        fetch = min(self.num_rows, keep + 1)
        sims, ids = faiss.knn(queries, self.rows.numpy(), fetch, metric=faiss.METRIC_INNER_PRODUCT)
        sims[ids == (query_ids - self.row_offset)[:, None]] = -np.inf
        order = np.argsort(-sims, axis=1, kind="stable")[:, :keep]  # own row to the end
        sims = np.take_along_axis(sims, order, axis=1)
        ids = np.take_along_axis(ids, order, axis=1)
        if fetch < keep:  # the shard holds fewer rows than the pool: pad
            pad = ((0, 0), (0, keep - fetch))
            sims = np.pad(sims, pad, constant_values=-np.inf)
            ids = np.pad(ids, pad, constant_values=MISSING_ID)
        return torch.from_numpy(sims), torch.from_numpy(ids.astype(np.int64))

    def _candidates_torch(
        self, queries: torch.Tensor, local_self: torch.Tensor, keep: int, row_block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 top-keep per query by blocked GEMM, own row excluded."""
        device = self.device
        count = queries.shape[0]
        pool_sims = torch.full((count, keep), -math.inf, device=device)
        pool_ids = torch.full((count, keep), MISSING_ID, dtype=torch.int64, device=device)
        full = False
        for lo in range(0, self.num_rows, row_block):
            hi = min(self.num_rows, lo + row_block)
            scores = self._scores(queries, local_self, lo, hi)
            if not full:  # the first blocks: plain top-k until the pool holds `keep` rows
                top_sims, top_cols = torch.topk(scores, min(keep, hi - lo), dim=1)
                new_sims, new_ids = top_sims, top_cols + lo
            else:  # later blocks: only rows beating the pool's worst can enter
                threshold = pool_sims[:, keep - 1 : keep]
                rows_hit, cols_hit = torch.nonzero(scores > threshold, as_tuple=True)
                if rows_hit.numel() == 0:
                    continue
                counts = torch.bincount(rows_hit, minlength=count)
                width = int(counts.max())
                starts = torch.cumsum(counts, 0) - counts
                slot = torch.arange(rows_hit.numel(), device=device) - starts[rows_hit]
                new_sims = torch.full((count, width), -math.inf, device=device)
                new_ids = torch.full((count, width), MISSING_ID, dtype=torch.int64, device=device)
                new_sims[rows_hit, slot] = scores[rows_hit, cols_hit]
                new_ids[rows_hit, slot] = cols_hit + lo
            merged_sims = torch.cat([pool_sims, new_sims], dim=1)
            merged_ids = torch.cat([pool_ids, new_ids], dim=1)
            pool_sims, order = torch.topk(merged_sims, keep, dim=1)
            pool_ids = torch.gather(merged_ids, 1, order)
            full = full or bool(torch.isfinite(pool_sims[:, keep - 1]).all())
        return pool_sims, pool_ids

    def _finish(
        self,
        queries: torch.Tensor,
        local_self: torch.Tensor,
        pool_sims: torch.Tensor,
        pool_ids: torch.Tensor,
        k: int,
        keep: int,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Re-score the candidates, rank them, and redo the queries whose pool was too tight."""
        count = queries.shape[0]
        margin = self._margin(queries)
        kth = pool_sims[:, k - 1] if k <= keep else torch.full_like(margin, -math.inf)
        worst = pool_sims[:, keep - 1]
        # A row was left out only if the pool was full; it scored <= worst.
        unsafe = torch.isfinite(worst) & (worst >= kth - margin) & (keep < self.num_rows)
        # Only rows that might still make the top k are re-scored; the rest cannot (see above).
        candidate = torch.isfinite(pool_sims) & (pool_sims >= (kth - margin)[:, None])
        query_rows, slots = torch.nonzero(candidate, as_tuple=True)
        rescored = torch.full((count, keep), -math.inf, dtype=torch.float32)
        rescored[query_rows.cpu(), slots.cpu()] = (
            exact_dot(queries, query_rows, self.rows, pool_ids[query_rows, slots]).float().cpu()
        )
        candidate_np = candidate.cpu().numpy()
        global_ids = np.where(candidate_np, pool_ids.cpu().numpy() + self.row_offset, MISSING_ID)
        rescored_np = rescored.numpy()
        if keep < k:
            pad = k - keep
            global_ids = np.pad(global_ids, ((0, 0), (0, pad)), constant_values=MISSING_ID)
            rescored_np = np.pad(rescored_np, ((0, 0), (0, pad)), constant_values=-np.inf)
        ids, sims = rank(global_ids, rescored_np, k)
        if bool(unsafe.any()):
            redo = torch.nonzero(unsafe).squeeze(1)
            threshold = kth[redo] - 2 * margin[redo]  # widened: these GEMM scores may differ
            redo_np = redo.cpu().numpy()
            ids[redo_np], sims[redo_np] = self._collect_all(
                queries[redo], local_self[redo], threshold, k
            )
            self.fallback_queries += len(redo_np)
        return ids, sims

    def _collect_all(
        self, queries: torch.Tensor, local_self: torch.Tensor, threshold: torch.Tensor, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Exact fallback: re-score every row whose GEMM score reaches `threshold`."""
        count = queries.shape[0]
        row_block = max(1, min(self.num_rows, self.max_block_elements // max(1, count)))
        query_parts, row_parts = [], []
        for lo in range(0, self.num_rows, row_block):
            hi = min(self.num_rows, lo + row_block)
            scores = self._scores(queries, local_self, lo, hi)
            rows_hit, cols_hit = torch.nonzero(scores >= threshold[:, None], as_tuple=True)
            query_parts.append(rows_hit)
            row_parts.append(cols_hit + lo)
        query_rows = torch.cat(query_parts)
        local_rows = torch.cat(row_parts)
        sims = exact_dot(queries, query_rows, self.rows, local_rows).float().cpu().numpy()
        query_rows = query_rows.cpu().numpy()
        global_rows = local_rows.cpu().numpy() + self.row_offset
        order = np.lexsort((global_rows, -sims, query_rows))
        query_rows, global_rows, sims = query_rows[order], global_rows[order], sims[order]
        first = np.searchsorted(query_rows, np.arange(count))
        position = np.arange(len(query_rows)) - first[query_rows]
        take = position < k
        ids = np.full((count, k), MISSING_ID, dtype=np.int64)
        out = np.full((count, k), -np.inf, dtype=np.float32)
        ids[query_rows[take], position[take]] = global_rows[take]
        out[query_rows[take], position[take]] = sims[take]
        return ids, out
