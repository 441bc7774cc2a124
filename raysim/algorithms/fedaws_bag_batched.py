"""FedAwS / Softmax-oracle clients on the embedding-bag model (`xml_embedding_bag`): the
chunk of the client description that both drivers train (raysim.core.client_step).

A client trains the dense layers, a small table of the bag rows its samples touch
(`XMLEmbeddingBag.touched_rows`: those rows, and the samples' ids re-indexed into the
table; the network run by `forward_rows`) and its own values beside theta (FedAwS: its class
row; the oracle: its copy of W): the full table is never copied or reset. Its message carries
the dense delta, the touched rows' ids and deltas, and those values (raysim.algorithms.fedaws_wire).

`bag_chunk` specialises the method's step to a chunk of such clients (one client for the
sequential driver): the step's network is `_RowsNetwork`, the model's own `forward_rows` with
the client's table one more trained tensor beside the dense ones; every table is `width` rows
(the chunk's widest: the client's own rows first, in `touched` order, then zero rows), and each
client's feature ids are re-indexed into its own table with the padding id `width`, as
`forward_rows` expects for a table of `width` rows. One client alone gets a table of exactly
its rows (the sequential client).

The sequential driver pools a sample's bag with `F.embedding_bag(mode="mean")` over its real
ids. vmap has no batching rule for embedding_bag: it would run it, forward and backward, once
per client (on a GPU ~80 operations a client a step, so a chunk's launches grow with its
clients). The vmapped driver runs the step's `vmapped_model` instead, the gathered twin
(`XMLEmbeddingBag.forward_rows_gathered`): a gather of each id's row (the padding id's row is
zero) and a sum over the bag divided by its count of real ids, operations vmap batches, so a
step is the same few operations for any chunk.

The padded width enters no client's arithmetic, so a batched client's result does not depend
on the chunk (tests/test_batched_bag.py compares chunks of 1, 2 and 3 with ==): the ids are
the same in every chunk except the padding id, which is larger than every real id in any
chunk; the gather reads only the rows the ids name (padding adds exact zeros, over a bag
dimension that is the dataset's, not the chunk's), and the gather's backward (one call over
the chunk, each client's ids offset into its own table) adds each row's contributions on the
CPU one after another in the ids' order; on a GPU by a sort-based kernel without atomic adds,
over the same `batch_chunk` slots in every call (not yet checked on a GPU). The rows past a
client's own are never named, get a gradient of exactly 0, stay 0 under weight decay and
momentum, and are never returned.

Batched against sequential the results agree to float rounding (docs/BATCHED.md gives the
tolerance measured): the bag's sum runs in another order than embedding_bag's, the vmapped
dense layers' batched matrix products, the masked mean over padded batch rows and the batched
SGD's unfused `param - buf * lr` round differently.

Speed: one vmapped step per chunk instead of one training loop per client pays on a GPU,
where a client's step is launch overhead. On a CPU the padded batch rows (every client's
batch holds `ClientBatch.rows`, the split's largest batch), the padded tables and the gathered
rows (a batch row's features x the bag's width) are arithmetic and memory traffic the
sequential path does not have, and it is slower batched (docs/BATCHED.md has the
measurements), so the CPU trains these clients one at a time (`BATCH_ON_CPU`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from raysim.algorithms.fedaws_wire import PerPayload
from raysim.core.client_step import ClientChunk, ClientStep, StartParts
from raysim.models.embedding import XMLEmbeddingBag
from raysim.models.layout import ModelLayout

ROWS = "rows"  # the per-client table among the trained tensors (not one of the model's names)

# The CPU trains bag clients one at a time (see the module docstring); the tests set this to
# run the batched path on the CPU.
BATCH_ON_CPU = False

CPU_REASON = "embedding-bag clients are slower batched than one at a time on a CPU"


class _RowsNetwork(nn.Module):
    """The clients' network: `model.forward_rows(local_x, rows)`, with `rows` (a client's
    table, `width` rows of the bag's width) trained beside the model's dense tensors (named
    `model.<name>`). The sequential driver loads a client's values into it; the vmapped one
    brings every client's own (the module's then only give the shapes) and runs the
    `gathered` twin (`model.forward_rows_gathered`: no embedding_bag, which vmap would run
    client by client)."""

    def __init__(self, model: XMLEmbeddingBag, gathered: bool = False) -> None:
        super().__init__()
        self.model = model
        self.gathered = gathered
        self.with_width(1)

    def with_width(self, width: int) -> _RowsNetwork:
        """This network, its table now `width` rows (values unset)."""
        bag = self.model.bag
        shape = (width, bag.embedding_dim)
        if getattr(self, "rows", None) is None:
            self.rows = nn.Parameter(torch.empty(shape, device=bag.weight.device))
        elif len(self.rows) != width:  # the same parameter object, resized (no module
            # bookkeeping per client: the sequential driver asks for a new width every client)
            self.rows.data = torch.empty(shape, device=bag.weight.device)
        return self

    def forward(self, local_x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return self.model.forward_rows_gathered(local_x, self.rows)
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


# model -> (its layout, its _RowsNetwork, its gathered twin, the trained tensors' names): made
# once per worker model, not once per client (the sequential driver asks for one at a time)
_NETWORKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rows_networks(model: XMLEmbeddingBag, layout: ModelLayout, width: int):
    """(`model`'s _RowsNetwork with a table of `width` rows, its gathered twin, the names of
    what they train)."""
    held = _NETWORKS.get(model)
    if held is None or held[0] is not layout:
        trainable = (*(f"model.{name}" for name in _dense_names(model, layout)), ROWS)
        networks = _RowsNetwork(model), _RowsNetwork(model, gathered=True)
        held = _NETWORKS[model] = (layout, *networks, trainable)
    return held[1].with_width(width), held[2].with_width(width), held[3]


# theta's dense part of the latest payload (and layout)
_DENSE = PerPayload()


def _dense_part(layout: ModelLayout, payload) -> np.ndarray:
    """theta's dense part (float32), gathered once per payload (PerPayload: theta changes in
    place between rounds): every client of a task starts from the same payload, and the
    gather reads all of theta's dense part (8 MB at Amazon-670K scale)."""
    return _DENSE.get(
        payload,
        layout,
        lambda: np.asarray(layout.theta_dense(payload.theta), dtype=np.float32),
    )


@dataclass(frozen=True)
class TableRows:
    """A bag client's note for its messages: the bag rows it trained (`touched`, sorted ids)
    in a table of `width` rows, and where its trained row puts them: the dense part first
    (`dense_size` values), then the table, then its extra values."""

    touched: np.ndarray
    width: int
    dense_size: int

    def split(self, trained: np.ndarray, bag_width: int):
        """(dense part, the touched rows' trained values [len(touched), bag_width], extra)."""
        return (trained[: self.dense_size], *self.split_rest(trained[self.dense_size :], bag_width))

    def split_rest(self, rest: np.ndarray, bag_width: int):
        """(the touched rows' trained values, extra) from a trained row past its dense part."""
        table = rest[: self.width * bag_width].reshape(self.width, bag_width)
        return table[: len(self.touched)], rest[self.width * bag_width :]

    def start_rows(self, start: StartParts, bag_width: int) -> np.ndarray:
        """The touched rows' values the client started from: its start's table piece (theta's
        rows, as `bag_chunk` gathered them; not gathered from theta a second time)."""
        return start.parts[1].reshape(self.width, bag_width)[: len(self.touched)]


def bag_chunk(
    step: ClientStep,
    layout: ModelLayout,
    payload,
    xs: Sequence[torch.Tensor],
    extras: Sequence[np.ndarray],
) -> ClientChunk:
    """`step` (the method's: its loss `loss(embeddings, targets, extra)`, its SGD, the extras at
    `extra_lr`) specialised to clients with inputs `xs` and extra values `extras`, each
    training its own table of touched rows from theta (the module docstring). The notes are
    each client's `TableRows`."""
    model, theta = step.model, payload.theta
    dense_theta = _dense_part(layout, payload)
    pairs = [model.touched_rows(x) for x in xs]  # (touched rows, x re-indexed into them)
    touched = [rows for rows, _ in pairs]
    width = max(1, max((len(rows) for rows in touched), default=0))
    local_xs, starts = [], []
    for (rows, local), extra in zip(pairs, extras, strict=True):
        # padding -> len(rows), moved to the padded table's
        local_xs.append(torch.where(local == len(rows), width, local))
        table = np.zeros((width, layout.bag_width), dtype=np.float32)
        table[: len(rows)] = layout.bag_row_slice(theta, rows)
        starts.append(StartParts(dense_theta, table, extra))
    network, gathered, trainable = _rows_networks(model, layout, width)
    rows_step = replace(step, model=network, trainable=trainable, vmapped_model=gathered)
    notes = tuple(TableRows(rows, width, len(dense_theta)) for rows in touched)
    return ClientChunk(rows_step, tuple(local_xs), tuple(starts), notes)
