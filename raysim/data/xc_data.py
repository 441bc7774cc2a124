"""One Extreme Classification Repository data file in memory (`XCData`, CSR arrays), and its writer.

What raysim.data.xml's parser returns and raysim.data.synthetic_xml's generator makes; the
conversions to a `Dataset` are in raysim.data.xc_datasets.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class XCData:
    """One XC data file as CSR arrays: row i's labels are label_ids[label_indptr[i]:...[i+1]]."""

    num_features: int
    num_labels: int
    label_indptr: np.ndarray  # int64 (points + 1,)
    label_ids: np.ndarray  # int64 (total labels,)
    feature_indptr: np.ndarray  # int64 (points + 1,)
    feature_ids: np.ndarray  # int32 (total features,)
    feature_values: np.ndarray  # float32 (total features,)

    @property
    def num_points(self) -> int:
        return len(self.label_indptr) - 1

    def take(self, rows: np.ndarray) -> XCData:
        """The given rows (any order, repeats allowed) as a new XCData."""
        rows = np.asarray(rows, dtype=np.int64)
        label_indptr, label_source = _gather_csr(self.label_indptr, rows)
        feature_indptr, feature_source = _gather_csr(self.feature_indptr, rows)
        return XCData(
            self.num_features,
            self.num_labels,
            label_indptr,
            self.label_ids[label_source],
            feature_indptr,
            self.feature_ids[feature_source],
            self.feature_values[feature_source],
        )


def _gather_csr(indptr: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(new indptr, source positions) of the CSR rows `rows`, without a Python loop."""
    counts = (indptr[rows + 1] - indptr[rows]).astype(np.int64)
    new_indptr = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_indptr[1:])
    shift = np.repeat(indptr[rows].astype(np.int64) - new_indptr[:-1], counts)
    return new_indptr, shift + np.arange(new_indptr[-1], dtype=np.int64)


def label_sets_to_multi_hot(
    label_indptr: np.ndarray, label_ids: np.ndarray, num_labels: int
) -> np.ndarray:
    """CSR label lists -> uint8 (points, num_labels) 0/1 matrix (for small label counts)."""
    label_indptr = np.asarray(label_indptr, dtype=np.int64)
    label_ids = np.asarray(label_ids, dtype=np.int64)
    points = len(label_indptr) - 1
    multi_hot = np.zeros((points, int(num_labels)), dtype=np.uint8)
    rows = np.repeat(np.arange(points), np.diff(label_indptr))
    multi_hot[rows, label_ids] = 1
    return multi_hot


def write_xc_file(path: str | os.PathLike, data: XCData) -> None:
    """Write `data` in the XC text format (tests, benchmarks, exporting synthetic data)."""
    with open(path, "w", encoding="ascii") as handle:
        handle.write(f"{data.num_points} {data.num_features} {data.num_labels}\n")
        labels = data.label_ids.tolist()
        ids = data.feature_ids.tolist()
        values = data.feature_values.tolist()
        li, fi = data.label_indptr.tolist(), data.feature_indptr.tolist()
        for row in range(data.num_points):
            label_text = ",".join(map(str, labels[li[row] : li[row + 1]]))
            pairs = " ".join(f"{ids[k]}:{values[k]:.6g}" for k in range(fi[row], fi[row + 1]))
            handle.write(f"{label_text} {pairs}\n" if pairs else f"{label_text}\n")
