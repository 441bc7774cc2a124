"""Batched FedAwS / Softmax-oracle clients on the embedding-bag model (`xml_embedding_bag`).

Sequentially (raysim.algorithms.class_embedding) a client trains the dense layers, a small
local table of the bag rows its samples touch (`XMLEmbeddingBag.touched_feature_rows`; its
ids re-indexed into the table by `remap`; the network run by `forward_rows`) and its own
values beside theta (FedAwS: its class row; the oracle: its copy of W). Its message carries
the dense delta, the touched rows' ids and deltas (`theta_message`) and those values.

Here a chunk of such clients trains in one vmapped step per local step
(raysim.core.batched_training.train_batched), each client's table one more trainable tensor
beside the dense ones (`_RowsNetwork`): every table is padded to the chunk's widest, `width`
rows (the client's own rows first, in `touched` order, then zero rows), and each client's
feature ids are re-indexed into its own table with the padding id `width`, as `forward_rows`
expects for a table of `width` rows. The network is the model's own `forward_rows`, so a
sample's bag is `F.embedding_bag(mode="mean")` over its real ids, exactly as sequentially.

The padded width enters no client's arithmetic, so a client's result does not depend on the
chunk (tests/test_batched_bag.py compares chunks of 1, 2 and 3 with ==): vmap runs
`embedding_bag` and its backward once per client (torch has no batching rule for them; its
fallback slices the clients apart and stacks the results, no arithmetic), on ids that are the
same in every chunk except the padding id, which is larger than every real id in any chunk.
The forward reads only the rows a bag's ids name and its backward adds each row's
contributions one after another in sorted-id order (on the CPU a sort whose comparisons, hence
its order of equal ids, are the same whatever the padding id's value; on a GPU a stable
sort); the rows past a client's own are never named, get a gradient of exactly 0, stay 0
under weight decay and momentum, and are never returned.

Against the sequential client the results agree to float rounding (docs/BATCHED.md gives the
tolerance measured): the same embedding_bag kernel, but the vmapped dense layers' batched
matrix products, the masked mean over padded batch rows and the batched SGD's unfused
`param - buf * lr` round differently.

Speed: one vmapped step per chunk instead of one training loop per client pays on a GPU,
where a client's step is launch overhead. On a CPU the padded batch rows (every client's
batch holds `ClientBatch.rows`, the split's largest batch) and the padded tables are
arithmetic the sequential path does not do, and it is slower batched (docs/BATCHED.md has the
measurements), so the CPU trains these clients one at a time (`BATCH_ON_CPU`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from raysim.core.batched_training import ClientBatch, train_batched
from raysim.core.client_step import ClientStep
from raysim.models.embedding import XMLEmbeddingBag
from raysim.models.layout import ModelLayout

ROWS = "rows"  # the per-client table among the trained tensors (not one of the model's names)

# The CPU trains bag clients one at a time (see the module docstring); the tests set this to
# run the batched path on the CPU.
BATCH_ON_CPU = False

CPU_REASON = "embedding-bag clients are slower batched than one at a time on a CPU"


class _RowsNetwork(nn.Module):
    """The vmapped call's network: `model.forward_rows(local_x, rows)`, the sequential
    client's own, with `rows` (the client's table, `width` rows of the bag's width) trained
    beside the model's dense tensors (named `model.<name>`). The module's `rows` only gives
    the table's shape (a meta tensor): every client brings its own values."""

    def __init__(self, model: XMLEmbeddingBag, width: int) -> None:
        super().__init__()
        self.model = model
        self.rows = nn.Parameter(torch.empty((width, model.bag.embedding_dim), device="meta"))

    def forward(self, local_x: torch.Tensor) -> torch.Tensor:
        return self.model.forward_rows(local_x, self.rows)


def bag_batching_problem(model: nn.Module, device: torch.device) -> str | None:
    """Why the batched bag path does not train `model`'s clients on `device` (one line), or
    None."""
    if not isinstance(model, XMLEmbeddingBag):
        return (
            f"an embedding-bag model other than xml_embedding_bag ({type(model).__name__}) "
            f"trains a per-client table of the rows it touches"
        )
    if any(True for _ in model.buffers()):
        return "the model has buffers"
    if not all(p.requires_grad for p in model.parameters()):
        return "the model has frozen parameters"
    if device.type == "cpu" and not BATCH_ON_CPU:
        return CPU_REASON
    return None


def _dense_names(model: nn.Module, layout: ModelLayout) -> list[str]:
    """The dense tensors' names in theta's dense order (`layout.dense`: state-dict order)."""
    names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
    return [names[id(tensor)] for tensor, _, _ in layout.dense]


def train_bag_batched(
    model: XMLEmbeddingBag,
    layout: ModelLayout,
    theta: np.ndarray,
    batch: ClientBatch,
    extras: Sequence[np.ndarray],
    step: ClientStep,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float], list[dict]]:
    """Train a chunk of bag clients from theta, each with its own table of touched rows and
    its own `extras`, by the method's client step (raysim.core.client_step.ClientStep: its
    loss of a batch, `loss(embeddings, targets, extra)`, its SGD, the extras at `extra_lr`).

    Returns (theta's dense part; the trained dense parts and the trained extras, one row per
    client (views of one array); the mean losses; each client's bag part of its message,
    `bag_ids` (int32, its touched rows) and `bag_rows` (float32, their trained values minus
    theta's), as `theta_message` builds them)."""
    dense_theta = np.asarray(layout.theta_dense(theta), dtype=np.float32)
    touched = [model.touched_feature_rows(x) for x in batch.xs]
    width = max(1, max((len(rows) for rows in touched), default=0))
    local_xs = []
    for x, rows in zip(batch.xs, touched, strict=True):
        local = model.remap(x, rows)  # padding -> len(rows), moved to the padded table's
        local_xs.append(torch.where(local == len(rows), width, local))
    dense_size, table_size = len(dense_theta), width * layout.bag_width
    extra_width = extras[0].size if len(extras) else 0
    starts = np.zeros((len(batch), dense_size + table_size + extra_width), dtype=np.float32)
    starts[:, :dense_size] = dense_theta
    for start, rows, extra in zip(starts, touched, extras, strict=True):
        table = start[dense_size : dense_size + table_size].reshape(width, layout.bag_width)
        table[: len(rows)] = layout.bag_row_slice(theta, rows)
        start[dense_size + table_size :] = np.asarray(extra, dtype=np.float32).ravel()
    local_batch = ClientBatch(
        client_ids=batch.client_ids,
        xs=tuple(local_xs),
        ys=batch.ys,
        generators=batch.generators,
        rows=batch.rows,
        slots=batch.slots,
        personal=batch.personal,
    )
    with warnings.catch_warnings():
        # vmap's notice that embedding_bag has no batching rule: running it per client is
        # what makes the results independent of the chunk (module docstring).
        warnings.filterwarnings("ignore", message="There is a performance drop because we")
        rows_step = replace(
            step,
            model=_RowsNetwork(model, width),
            trainable=(*(f"model.{name}" for name in _dense_names(model, layout)), ROWS),
        )
        trained, losses = train_batched(rows_step, list(starts), local_batch)
    del starts
    tables = trained[:, dense_size : dense_size + table_size].reshape(-1, width, layout.bag_width)
    bags = []
    for table, rows in zip(tables, touched, strict=True):
        delta = table[: len(rows)] - layout.bag_row_slice(theta, rows)
        bags.append({"bag_ids": rows.astype(np.int32), "bag_rows": delta.astype(np.float32)})
    dense, trained_extras = trained[:, :dense_size], trained[:, dense_size + table_size :]
    return dense_theta, dense, trained_extras, losses, bags
