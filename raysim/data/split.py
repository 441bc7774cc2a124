"""The result types of partitioners: `ClientSplit` (CSR) and `PartitionResult` (train + validation).

A split is two int64 arrays (`indices` grouped by client, `offsets`), never one object per client,
so a million clients cost two object-store entries and partitioning is vectorised numpy. This
module holds only the types and the CSR builder shared by the single-label partitioners
(raysim.data.partition) and the multi-label ones (raysim.data.cmda), so neither imports the other
in a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ClientSplit:
    """Client c owns train samples `indices[offsets[c]:offsets[c + 1]]` (ascending)."""

    indices: np.ndarray  # int64 train-sample ids grouped by client, ascending within each client
    offsets: np.ndarray  # int64 (num_clients + 1,)

    def __post_init__(self) -> None:
        indices, offsets = self.indices, self.offsets
        if indices.ndim != 1 or offsets.ndim != 1 or len(offsets) < 2:
            raise ValueError("ClientSplit needs 1-D indices and at least 2 offsets")
        if indices.dtype != np.int64 or offsets.dtype != np.int64:
            raise ValueError(
                f"ClientSplit arrays must be int64, got {indices.dtype}, {offsets.dtype}"
            )
        if offsets[0] != 0 or offsets[-1] != len(indices) or np.any(np.diff(offsets) < 0):
            raise ValueError("ClientSplit offsets must rise from 0 to len(indices)")

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        """Number of samples of each client (int64, length num_clients)."""
        return np.diff(self.offsets)

    def client_indices(self, client: int) -> np.ndarray:
        """The train-sample ids of one client (a view, no copy)."""
        return self.indices[self.offsets[client] : self.offsets[client + 1]]

    def client_ids(self) -> np.ndarray:
        """The client of each entry of `indices` (int64, same length)."""
        return np.repeat(np.arange(self.num_clients, dtype=np.int64), self.sizes)


@dataclass(frozen=True)
class PartitionResult:
    """What a partitioner produces: every client's training rows and, optionally, its
    validation rows of the dataset's test set (the multi-label splits place the test set's rows
    on the same clients, because FLAG's metrics are measured on each client's own data)."""

    train: ClientSplit  # rows of dataset.train_*
    validation: ClientSplit | None = None  # rows of dataset.test_*, same number of clients
    # rows of dataset.val_* (the validation split), placed as the test rows are: the built-in
    # multi-label partitioners give it in the same call; without it the run places them by
    # a second call with the validation rows as the test set (raysim.assembly.plan)
    validation_of_val: ClientSplit | None = None


def from_assignment(client_of: np.ndarray, num_clients: int) -> ClientSplit:
    """CSR from 'client of each sample' (-1: unassigned); a stable sort keeps ids ascending."""
    assigned = np.flatnonzero(client_of >= 0)
    owners = client_of[assigned]
    order = np.argsort(owners, kind="stable")
    counts = np.bincount(owners, minlength=num_clients)
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return ClientSplit(indices=assigned[order].astype(np.int64), offsets=offsets)
