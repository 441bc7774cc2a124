"""The Softmax oracle of FedAwS (Yu et al., ICML 2020): an upper bound, not a federated method
for the one-class setting.

Every client gets theta AND all of W and minimises the full softmax cross-entropy over all
classes (logits = scale * g(x)^T w_c, unit vectors); theta and W are both averaged (FedAvg)
and stepped by one server optimizer. Shares everything else with FedAwS
(raysim.algorithms.class_embedding, fedaws_wire, fedaws_reduce, fedaws_fast).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from raysim.algorithms.class_embedding import ClassEmbeddingMethod, next_state, normalize_rows
from raysim.algorithms.fedaws_fast import evaluate_class_embeddings
from raysim.algorithms.fedaws_wire import Broadcast
from raysim.core.algorithm import RunContext
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.state import ServerState
from raysim.errors import ConfigError
from raysim.models.vector import build_model

# Logits are scale x cosine: past 1e4 the softmax is already a hard max, and past float32's
# 3.4e38 the logits are inf and every client's loss NaN (the paper uses 16).
MAX_SCALE = 1e4


class FedAwSSoftmax(ClassEmbeddingMethod):
    """The Softmax oracle: every client gets theta AND all of W and minimises the full softmax
    cross-entropy over all classes (logits = scale * g(x)^T w_c, unit vectors); theta and W are
    both averaged (FedAvg). Not possible in the real one-class setting, which is the point.
    Evaluation covers every test (and validation) point unless `eval_max_points` caps it."""

    def __init__(
        self,
        *,
        scale: float = 16.0,
        class_lr: float | None = None,
        eval_max_points: int | None = None,  # None: every test point (an int: the first N)
    ) -> None:
        super().__init__(class_lr=class_lr, eval_max_points=eval_max_points)
        if not (scale > 0 and math.isfinite(scale)):
            raise ConfigError(f"'algorithm.scale' must be a finite number > 0, got {scale}")
        if scale > MAX_SCALE:
            raise ConfigError(f"'algorithm.scale' must be in (0, 1e4], got {scale}")
        self.scale = float(scale)

    evaluate = evaluate_class_embeddings  # FedAwS's: the same numbers, without a score matrix

    def client_loss(self, embeddings: torch.Tensor, targets, classes: torch.Tensor):
        """The loss of a batch: the full softmax over every class,
        logits = scale x cosine (W flat or [classes, dim])."""
        classes = classes.reshape(-1, embeddings.shape[-1])
        unit = classes / classes.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return nn.functional.cross_entropy(self.scale * embeddings @ unit.T, targets)

    def init_server(self, ctx: RunContext) -> ServerState:
        model = build_model(ctx)
        # One server optimizer over theta and W (its slots cover both, theta first).
        return self._initial_state(ctx, model, self._check_model(ctx, model), True)

    def server_payload(self, state: ServerState) -> Broadcast:
        return Broadcast(
            state.arrays["params"],
            state.arrays["class_embeddings"],
        )

    # --- client (described once in raysim.algorithms.class_embedding) ----------------------------
    def client_extras(self, payload: Broadcast, personal, count: int) -> list[np.ndarray]:
        """What each client trains beside theta: its copy of all of W."""
        return [np.asarray(payload.classes, dtype=np.float32)] * count

    def extra_lr(self, ctx: RunContext) -> float:
        return self.class_lr or ctx.config.clients.lr

    def extra_message(self, payload: Broadcast, trained: np.ndarray, y: torch.Tensor) -> dict:
        """The client's delta of W."""
        start = np.asarray(payload.classes, dtype=np.float32)
        return {"classes": trained.reshape(start.shape) - start}

    def server_update(
        self, state: ServerState, aggregate: dict, ctx: RunContext
    ) -> tuple[ServerState, dict[str, float]]:
        classes = state.arrays["class_embeddings"]
        total = float(aggregate["weight"]) * FIXED_SCALE
        mean_delta = (aggregate["classes_dense"] / total).astype(np.float32)
        both, slots = self._theta_step(state, aggregate, ctx, extra=(classes, mean_delta))
        params = both[: len(state.arrays["params"])]
        classes = both[len(params) :].reshape(classes.shape)
        return next_state(state, params, normalize_rows(classes), slots), {}
