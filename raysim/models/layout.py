"""Where a model's tensors sit in its flat parameter vector (raysim.models.vector order): the
update vector's `VectorLayout` (size, dtype, segments; what codecs and checks see), and the
split into the embedding-bag table (if the model has one) and the dense rest.

Methods that never copy a whole embedding-bag table (FedAwS and its softmax oracle at
Amazon-670K scale) use it to load and send only the dense layers and the bag rows a client
touched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class VectorLayout:
    """What an algorithm's update vector looks like (fixed for a run)."""

    size: int | None  # entries (None: not known, not checked)
    dtype: np.dtype | None = None  # dtype of the vector the algorithm produces
    segments: tuple[int, ...] = ()  # sizes of consecutive pieces (tensors, layers); sum = size

    def pieces(self, vector: np.ndarray) -> list[np.ndarray]:
        """`vector` cut into its segments (views); of a 2-D array of vectors, one per row,
        each segment's columns."""
        bounds = np.cumsum((0, *self.segments))
        return [vector[..., a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


class ModelLayout:
    """Where the embedding-bag table sits in the flat theta vector (if the model has one)."""

    def __init__(self, model: nn.Module) -> None:
        self.bag: nn.EmbeddingBag | None = getattr(model, "bag", None)
        self.embedding_dim = int(getattr(model, "embedding_dim", 0))
        self.dense: list[tuple[torch.Tensor, int, int]] = []  # (tensor, offset, numel)
        self.bag_offset = -1
        offset = 0
        for tensor in model.state_dict(keep_vars=True).values():
            if not tensor.is_floating_point():
                continue
            if self.bag is not None and tensor is self.bag.weight:
                self.bag_offset = offset
            else:
                self.dense.append((tensor, offset, tensor.numel()))
            offset += tensor.numel()
        self.size = offset
        if self.bag is not None:
            self.bag_rows, self.bag_width = self.bag.weight.shape
            self.padding_id = self.bag.padding_idx
            self.dense_index = np.concatenate(
                [np.arange(o, o + n) for _, o, n in self.dense]
            ).astype(np.int64)

    def dense_delta(self, base: torch.Tensor) -> np.ndarray:
        """The dense parameters minus `base` (theta's dense part, as `theta_dense` orders it, on
        the parameters' device), float32: each tensor is subtracted straight into the result
        (no concatenated copy of the parameters, no gather of theta per call)."""
        out = torch.empty(len(base), dtype=torch.float32, device=base.device)
        position = 0
        with torch.no_grad():
            for tensor, _, count in self.dense:
                end = position + count
                torch.sub(tensor.detach().reshape(-1), base[position:end], out=out[position:end])
                position = end
        return out.numpy() if out.device.type == "cpu" else out.cpu().numpy()

    def dense_arrays(self) -> list[tuple[int, int, np.ndarray]]:
        """(position in the dense vector, size, flat numpy view) of each dense CPU tensor: the
        parameters themselves, read without torch's per-call overhead (kept while the tensors
        keep their storage, which in-place updates and loads do)."""
        views = getattr(self, "_dense_arrays", None)
        pointers = [tensor.data_ptr() for tensor, _, _ in self.dense]
        if views is None or views[0] != pointers:
            arrays, position = [], 0
            for tensor, _, count in self.dense:
                arrays.append((position, count, tensor.detach().reshape(-1).numpy()))
                position += count
            views = self._dense_arrays = (pointers, arrays)
        return views[1]

    def load_dense_from(self, base: torch.Tensor) -> None:
        """Set the dense parameters from theta's dense part (`theta_dense` order, on their
        device): a client's reset, without reading the full theta."""
        position = 0
        with torch.no_grad():
            for tensor, _, count in self.dense:
                tensor.copy_(base[position : position + count].view_as(tensor))
                position += count

    def theta_dense(self, theta: np.ndarray) -> np.ndarray:
        return theta if self.bag is None else theta[self.dense_index]

    def bag_row_slice(self, theta: np.ndarray, ids: np.ndarray) -> np.ndarray:
        table = theta[self.bag_offset : self.bag_offset + self.bag_rows * self.bag_width]
        return table.reshape(self.bag_rows, self.bag_width)[ids]


def layout_of(model: nn.Module) -> ModelLayout:
    """The layout of a (cached, per-process) model, computed once."""
    layout = getattr(model, "_raysim_layout", None)
    if layout is None:
        layout = model._raysim_layout = ModelLayout(model)
    return layout
