"""The Algorithm protocol and the run context shared by the server and the client tasks.

An algorithm is a plug-in with five pure-ish methods (DESIGN.md §3). The engine never looks
inside payloads or states; it only moves them, counts their bytes and reduces updates in
client-id order. How clients are executed (in-process or as Ray tasks) is the backend's job,
never the algorithm's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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
