"""Training a batch of clients: the body of a client task, shared by every backend.

Client data arrives as the whole training array plus CSR (indices, offsets): client c owns rows
indices[offsets[c]:offsets[c+1]]. Slicing copies only that client's rows, so a task touches
nothing but its own clients' data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raysim.core.algorithm import RunContext
from raysim.core.sampling import client_generator
from raysim.core.state import ClientUpdate


def train_clients(
    ctx: RunContext,
    algorithm,
    payload,
    train_x: np.ndarray,
    train_y: np.ndarray,
    indices: np.ndarray,
    offsets: np.ndarray,
    round_index: int,
    client_ids: Sequence[int],
) -> list[ClientUpdate]:
    """Run local training for `client_ids` one after another; updates in the same order."""
    previous_threads = torch.get_num_threads()
    if previous_threads != ctx.client_threads:
        # Same thread count on every backend: float results can depend on it.
        torch.set_num_threads(ctx.client_threads)
    try:
        updates = []
        for client_id in client_ids:
            client_id = int(client_id)
            rows = indices[offsets[client_id] : offsets[client_id + 1]]
            x = torch.from_numpy(train_x[rows])
            y = torch.from_numpy(train_y[rows].astype(np.int64, copy=False))
            generator = client_generator(ctx.seed, round_index, client_id)
            updates.append(algorithm.client_update(payload, x, y, client_id, generator, ctx))
        return updates
    finally:
        if previous_threads != ctx.client_threads:
            torch.set_num_threads(previous_threads)


def chunk_clients(client_ids: np.ndarray, num_chunks: int) -> list[np.ndarray]:
    """Split ascending ids into `num_chunks` contiguous runs of near-equal length."""
    num_chunks = max(1, min(num_chunks, len(client_ids)))
    return [chunk for chunk in np.array_split(client_ids, num_chunks) if len(chunk)]
