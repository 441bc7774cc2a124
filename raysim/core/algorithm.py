"""The Algorithm protocol and the run context shared by the server and the client tasks.

An algorithm is a plug-in with five pure-ish methods (DESIGN.md §3). The engine never looks
inside payloads or states; it only moves them, counts their bytes and reduces updates in
client-id order. How clients are executed (in-process or as Ray tasks) is the backend's job,
never the algorithm's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from raysim.config import Config
from raysim.core.state import ClientUpdate, ServerState


@dataclass(frozen=True)
class RunContext:
    """What every participant knows about the run: the resolved config and the data's shape."""

    config: Config
    input_shape: tuple[int, ...]
    num_classes: int
    # Vocabulary size of sparse bag-of-words inputs (Dataset.num_features); None: dense inputs.
    num_features: int | None = None
    # Multi-label data: each client's validation rows of the test set (a ClientSplit over
    # test_x; FLAG's AmAP/GmAP). None when the split has no per-client validation.
    client_validation: Any = field(default=None, compare=False)
    # The explicit client state store (raysim.runtime.client_state) when the algorithm
    # declares `uses_client_state = True`; None otherwise.
    client_state: Any = field(default=None, compare=False)

    @property
    def seed(self) -> int:
        return self.config.run.seed

    @property
    def client_threads(self) -> int:
        """Torch threads inside a client task = the CPUs the task reserves (at least one)."""
        return max(1, int(self.config.clients.num_cpus))

    def model_key(self) -> str:
        model = self.config.model
        return json.dumps(
            [
                model.name,
                dict(model.options),
                list(self.input_shape),
                self.num_classes,
                self.num_features,
            ],
            sort_keys=True,
        )


class Algorithm(Protocol):
    # Aggregator used when the config says `aggregator.name: auto` (e.g. FedAvg:
    # 'weighted_mean'; FRL: 'sum', the vote over rank positions).
    default_aggregator: str

    def init_server(self, ctx: RunContext) -> ServerState: ...

    def server_payload(self, state: ServerState) -> Any:
        """What every sampled client receives this round (put in the object store once)."""

    def client_update(
        self,
        payload: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        """Local training of one client; pure given its inputs (runs inside a task)."""

    def decode_update(self, message: Any, ctx: RunContext) -> np.ndarray:
        """The dense vector the aggregator sees for one client's message (server side)."""

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> ServerState:
        """Apply the aggregated update; returns the next round's state."""

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]: ...


# Optional hooks. The engine checks for them with `getattr`, so the five methods above are all a
# plain algorithm needs.
#
# Per-client payloads (FedAwS sends each client only its own class row):
#     def client_payload(self, state, client_ids, client_classes) -> Sequence:
#         one personal payload per client id, in the same order; `client_classes[i]` is the one
#         class client_ids[i] holds (-1 unless the split puts one class per client). The
#         client's `client_update` then receives `(broadcast_payload, personal_payload)`.
#
# In-task reduction (updates too large to send one per client):
#     def task_reducer(self, ctx) -> reducer with .add(update: ClientUpdate) and
#         .result() -> message; the task returns one ReducedUpdate instead of its updates.
#     def merge_reduced(self, accumulated | None, message, ctx) -> accumulated;
#         folded on the server in task order, must be exact (integer) so packing cannot matter.
#     def finish_reduced(self, accumulated, ctx) -> aggregate handed to server_update.
#     Such algorithms own their aggregation: `aggregator.name` must stay `auto`.
#
# Server-side phase timings: an algorithm may set `self.server_times = {"index_s": ...}` in
# server_update; the server copies it into the round's time split.
