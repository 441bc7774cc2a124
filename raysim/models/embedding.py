"""Embedding networks for FedAwS (Yu et al., ICML 2020): the model is g_theta(x), an L2-normalised
instance embedding; the class embeddings W are the algorithm's state, never part of the module.

Every factory has the signature `factory(input_shape, num_classes, num_features=None, *,
options)`: `num_features` is positional because `raysim.models.vector.build_model` passes the
vocabulary size of sparse bag-of-words data positionally; the keyword-only parameters are the
options a config's `model:` section may set. Every returned module has `embedding_dim: int`
(for a ResNet in classifier mode, None).

- `xml_embedding_bag`: the paper's extreme-classification network, sparse feature ids ->
  EmbeddingBag(mean) -> 1024 -> 1024 -> embedding_dim (ReLU on the hidden layers) -> L2 norm.
- `resnet8/32/56`: He et al. (2016) CIFAR ResNets, 3 stages of n = (depth - 2) / 6 basic blocks
  with 16/32/64 channels and option-A (parameter-free: subsample + zero-pad channels) shortcuts,
  as in the paper's CIFAR experiments; embedding head (FedAwS) or logits (FedAvg).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"'model.{name}' must be a positive integer, got {value!r}")
    return value


class XMLEmbeddingBag(nn.Module):
    """Bag of feature ids -> L2-normalised embedding (the Amazon-670K network of FedAwS).

    Input: int (batch, P) feature ids padded with `num_features`; padding ids are excluded from
    the mean and their row stays zero. Output: float (batch, embedding_dim), unit norm.

    At Amazon-670K scale the bag table is 135,909 x 512 (278 MB), so a client should not carry
    a dense gradient of it: `touched_feature_rows` + `remap` + `forward_rows` run the same
    network on a small table of just the rows a batch uses (gradients and deltas then touch
    only those rows); or build with `sparse_gradients=True` for torch's sparse gradients.
    """

    def __init__(
        self,
        num_features: int,
        embedding_dim: int,
        bag_dim: int,
        hidden: Sequence[int],
        sparse_gradients: bool,
    ) -> None:
        super().__init__()
        self.num_features = num_features
        self.embedding_dim = embedding_dim
        self.bag = nn.EmbeddingBag(
            num_features + 1,
            bag_dim,
            mode="mean",
            padding_idx=num_features,
            sparse=sparse_gradients,
        )
        layers: list[nn.Module] = []
        width = bag_dim
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, embedding_dim))
        self.head = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.head(self.bag(x)), dim=-1)

    def touched_feature_rows(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """Sorted unique feature ids < num_features in the batch: the bag rows it can change."""
        ids = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        ids = np.unique(ids)
        return ids[(ids >= 0) & (ids < self.num_features)].astype(np.int64)

    def remap(self, x: torch.Tensor | np.ndarray, rows: np.ndarray) -> torch.Tensor:
        """x with every id replaced by its index in `rows` (padding -> len(rows)), as int64."""
        ids = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        rows = np.asarray(rows, dtype=np.int64)
        local = np.searchsorted(rows, ids)
        if len(rows):
            found = (local < len(rows)) & (rows[np.minimum(local, len(rows) - 1)] == ids)
        else:
            found = np.zeros(ids.shape, dtype=bool)
        padding = ids == self.num_features
        if not np.all(found | padding):
            raise ValueError("x holds feature ids that are not in `rows`")
        return torch.from_numpy(np.where(found, local, len(rows)).astype(np.int64))

    def touched_rows(self, x: torch.Tensor | np.ndarray) -> tuple[np.ndarray, torch.Tensor]:
        """`touched_feature_rows(x)` and `remap(x, rows)` from one sort of x's ids (a client's
        start pays for it once, not twice)."""
        ids = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
        values, inverse = np.unique(ids, return_inverse=True)
        if len(values) and (values[0] < 0 or values[-1] > self.num_features):
            raise ValueError(
                f"x holds feature ids outside [0, {self.num_features}] (the padding id "
                f"is {self.num_features})"
            )
        rows = values[: len(values) - int(len(values) > 0 and values[-1] == self.num_features)]
        # the padding id, the largest, is the last unique value: its index is len(rows)
        local = torch.from_numpy(inverse.reshape(ids.shape).astype(np.int64, copy=False))
        return rows.astype(np.int64), local

    def forward_rows(self, local_x: torch.Tensor, rows_table: torch.Tensor) -> torch.Tensor:
        """forward() with the bag table replaced by `rows_table` = bag.weight[rows] (trainable).

        `local_x` comes from `remap(x, rows)`; the result equals `forward(x)`, and the gradient
        w.r.t. `rows_table` is (len(rows), bag_dim) instead of the whole table.
        """
        table = _with_padding_row(rows_table)
        pooled = F.embedding_bag(local_x, table, mode="mean", padding_idx=len(rows_table))
        return F.normalize(self.head(pooled), dim=-1)

    def forward_rows_gathered(
        self, local_x: torch.Tensor, rows_table: torch.Tensor
    ) -> torch.Tensor:
        """forward_rows() with each bag's mean taken as a gather of its rows and a sum over
        the bag, divided by its count of real ids: operations torch.func.vmap batches (it has
        no batching rule for embedding_bag and runs that one client at a time, forward and
        backward). The same function as forward_rows; the sum's order differs, so the values
        agree to float rounding. The padding row is zero, so padding ids add exact zeros: the
        result does not depend on the table's width beyond the rows the ids name."""
        summed = F.embedding(local_x, _with_padding_row(rows_table)).sum(dim=-2)
        count = (local_x != len(rows_table)).sum(dim=-1).clamp(min=1).to(summed.dtype)
        return F.normalize(self.head(summed / count.unsqueeze(-1)), dim=-1)


def _with_padding_row(rows_table: torch.Tensor) -> torch.Tensor:
    """`rows_table` and a zero row after it: the row of the padding id len(rows_table)."""
    return torch.cat([rows_table, rows_table.new_zeros((1, rows_table.shape[1]))])


def xml_embedding_bag(
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None = None,
    *,
    embedding_dim: int = 512,
    bag_dim: int = 512,
    hidden: Sequence[int] = (1024, 1024),
    sparse_gradients: bool = False,
) -> XMLEmbeddingBag:
    """FedAwS's extreme-classification embedding network (bag 512 -> 1024 -> 1024 -> 512)."""
    del num_classes  # the class embeddings live in the algorithm's state
    if num_features is None:
        raise ValueError(
            "model 'xml_embedding_bag' needs sparse bag-of-words inputs (feature ids with a "
            f"vocabulary size), but the dataset gives dense inputs of shape {tuple(input_shape)}; "
            "use an extreme-classification dataset (extreme_classification, synthetic_xml)"
        )
    if len(input_shape) != 1:
        raise ValueError(
            f"model 'xml_embedding_bag' needs inputs of shape (features per point,), got "
            f"{tuple(input_shape)}"
        )
    hidden = [_positive("hidden", size) for size in hidden]
    return XMLEmbeddingBag(
        _positive("num_features", num_features),
        _positive("embedding_dim", embedding_dim),
        _positive("bag_dim", bag_dim),
        hidden,
        bool(sparse_gradients),
    )


# --- CIFAR ResNets ------------------------------------------------------------------------------


class _ShortcutA(nn.Module):
    """Option A: subsample by the stride and zero-pad the new channels (no parameters)."""

    def __init__(self, stride: int, extra_channels: int) -> None:
        super().__init__()
        self.stride = stride
        self.extra_channels = extra_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        half = self.extra_channels // 2
        return F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))


NORMS = ("batch", "group")


def _norm(kind: str, channels: int) -> nn.Module:
    """BatchNorm, or GroupNorm (groups of 8 channels): without batch statistics, for clients
    whose batches hold a single class, where BatchNorm subtracts the class's own mean."""
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(channels // 8, channels)


class _BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = _norm(norm, channels)
        if stride != 1 or in_channels != channels:
            self.shortcut: nn.Module = _ShortcutA(stride, channels - in_channels)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """He et al. (2016) section 4.2: conv 16 -> 3 stages x n blocks (16/32/64) -> pool -> head.

    With `embedding_dim` the head is Linear(64, embedding_dim) + L2 normalisation (FedAwS);
    with None it is Linear(64, num_classes) logits.
    """

    def __init__(
        self,
        in_channels: int,
        blocks_per_stage: int,
        num_classes: int,
        embedding_dim: int | None,
        norm: str = "batch",
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.conv = nn.Conv2d(in_channels, 16, 3, padding=1, bias=False)
        self.bn = _norm(norm, 16)
        stages: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                stages.append(_BasicBlock(channels, width, stride, norm))
                channels = width
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(64, embedding_dim if embedding_dim is not None else num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn(self.conv(x)))
        out = self.stages(out)
        out = torch.flatten(F.adaptive_avg_pool2d(out, 1), 1)
        out = self.head(out)
        return F.normalize(out, dim=-1) if self.embedding_dim is not None else out


def _resnet(
    depth: int,
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None,
    embedding_dim: int | None,
    norm: str,
) -> CifarResNet:
    name = f"resnet{depth}"
    if norm not in NORMS:
        raise ValueError(f"'model.norm' must be one of {', '.join(NORMS)}, got {norm!r}")
    if num_features is not None:
        raise ValueError(
            f"model '{name}' needs image inputs, but the dataset gives sparse feature ids; "
            f"use 'xml_embedding_bag'"
        )
    if len(input_shape) != 3:
        raise ValueError(
            f"model '{name}' needs image inputs (channels, height, width), got shape "
            f"{tuple(input_shape)}"
        )
    if embedding_dim is not None:
        embedding_dim = _positive("embedding_dim", embedding_dim)
    return CifarResNet(int(input_shape[0]), (depth - 2) // 6, num_classes, embedding_dim, norm)


def resnet8(
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None = None,
    *,
    embedding_dim: int | None = 64,
    norm: str = "batch",
) -> CifarResNet:
    """ResNet-8 (1 block per stage, 78k parameters): embedding (FedAwS) or logits (None)."""
    return _resnet(8, input_shape, num_classes, num_features, embedding_dim, norm)


def resnet32(
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None = None,
    *,
    embedding_dim: int | None = 64,
    norm: str = "batch",
) -> CifarResNet:
    """ResNet-32 (5 blocks per stage, 0.46M parameters): the paper's CIFAR network."""
    return _resnet(32, input_shape, num_classes, num_features, embedding_dim, norm)


def resnet56(
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None = None,
    *,
    embedding_dim: int | None = 64,
    norm: str = "batch",
) -> CifarResNet:
    """ResNet-56 (9 blocks per stage, 0.85M parameters)."""
    return _resnet(56, input_shape, num_classes, num_features, embedding_dim, norm)


class MLPEmbedding(nn.Module):
    """Flattened input -> hidden layers (ReLU) -> embedding_dim -> L2 normalisation: a cheap
    FedAwS network for small images or dense features, where a ResNet costs more than the
    study can afford (Fashion-MNIST on CPUs)."""

    def __init__(self, in_features: int, hidden: Sequence[int], embedding_dim: int) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            width = size
        layers.append(nn.Linear(width, embedding_dim))
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.body(x), dim=-1)


def mlp_embedding(
    input_shape: Sequence[int],
    num_classes: int,
    num_features: int | None = None,
    *,
    hidden: Sequence[int] = (256,),
    embedding_dim: int = 64,
) -> MLPEmbedding:
    """MLP embedding for FedAwS (flattened dense inputs; hidden 256, embedding 64)."""
    del num_classes  # the class embeddings are the algorithm's state, not the module's
    if num_features is not None:
        raise ValueError(
            "model 'mlp_embedding' needs dense inputs, but the dataset gives sparse feature ids; "
            "use 'xml_embedding_bag'"
        )
    hidden = [_positive("hidden", size) for size in hidden]
    return MLPEmbedding(
        int(np.prod(input_shape)), hidden, _positive("embedding_dim", embedding_dim)
    )
