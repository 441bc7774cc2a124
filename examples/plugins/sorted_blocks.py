"""A partitioner plug-in: rows sorted by label and cut into contiguous blocks, so each client
holds one or two classes (the pathological non-IID split of McMahan et al. 2017, without
shards). `mix` moves that fraction of rows to random clients first.

A partitioner takes the whole dataset, the number of clients and a seed (derived from the run
seed) positionally, options as keyword-only parameters, and returns a `ClientSplit` (CSR:
client c owns train rows indices[offsets[c]:offsets[c+1]]) or a `PartitionResult` that also
places validation rows. It must be a pure function of its inputs.
Named in a config as `partition: {name: sorted_blocks:sorted_blocks, num_clients: 20}`.
"""

from __future__ import annotations

import numpy as np

import raysim
from raysim import ConfigError
from raysim.data.split import ClientSplit


@raysim.plugin("partitioner")
def sorted_blocks(dataset, num_clients: int, seed: int, *, mix: float = 0.0) -> ClientSplit:
    labels = np.asarray(dataset.train_y)
    if labels.ndim != 1:
        raise ConfigError("partition 'sorted_blocks' needs single-label data (1-D labels)")
    if not 0.0 <= mix <= 1.0:
        raise ConfigError(f"'partition.mix' must be in [0, 1], got {mix}")
    order = np.argsort(labels, kind="stable")
    rng = np.random.default_rng(seed)
    moved = rng.random(len(order)) < mix
    positions = np.arange(len(order))
    positions[moved] = rng.permutation(positions[moved])  # mixed rows swap places at random
    order = order[positions]
    blocks = np.array_split(order, num_clients)
    indices = np.concatenate([np.sort(block) for block in blocks]).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(block) for block in blocks])]).astype(np.int64)
    return ClientSplit(indices, offsets)
