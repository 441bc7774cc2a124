"""Nearest-class indexes for FedAwS negative mining (Yu et al., ICML 2020, Eq. 8).

`build_index(backend, num_rows, dim, shards=..., use_ray=..., **options)` returns a
`ShardedIndex` over contiguous row blocks, run in this process or as one Ray actor per shard.
Backends (registry `raysim.registry.indexes`):

    exact      blocked float32 GEMM + top-k, re-scored in float64: the reference; identical
               answers for any shard layout and on CPU or GPU
    faiss_ivf  faiss IndexIVFFlat with an array direct map (in-place updates), re-trained
               every `retrain_every` updates
    hnsw       hnswlib graph with in-place updates (existing labels are replaced and re-linked)

Backend classes are imported lazily, so importing this package loads neither faiss nor hnswlib.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raysim.index.base import MISSING_ID, NearestClassIndex, merge, rank
from raysim.index.sharded import ShardedIndex, build_index, shard_bounds

if TYPE_CHECKING:
    from raysim.index.exact import ExactIndex
    from raysim.index.faiss_ivf import FaissIVFIndex
    from raysim.index.hnsw import HNSWIndex

__all__ = [
    "MISSING_ID",
    "ExactIndex",
    "FaissIVFIndex",
    "HNSWIndex",
    "NearestClassIndex",
    "ShardedIndex",
    "build_index",
    "merge",
    "rank",
    "shard_bounds",
]

_LAZY = {
    "ExactIndex": "raysim.index.exact",
    "FaissIVFIndex": "raysim.index.faiss_ivf",
    "HNSWIndex": "raysim.index.hnsw",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'raysim.index' has no attribute {name!r}")
