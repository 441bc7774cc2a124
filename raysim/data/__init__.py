"""Datasets, client partitions and their on-disk cache.

Loaders return plain numpy arrays (`Dataset`) so that the engine can put them in the Ray object
store once per run; partitions are CSR (`ClientSplit`: one index array + offsets) so that a
million clients cost two arrays, not a million objects.
"""

from raysim.data.datasets import Dataset
from raysim.data.split import ClientSplit, PartitionResult

__all__ = ["ClientSplit", "Dataset", "PartitionResult"]
