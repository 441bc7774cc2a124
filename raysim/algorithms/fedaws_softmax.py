"""The Softmax oracle of FedAwS (Yu et al., ICML 2020): an upper bound, not a federated method
for the one-class setting.

Every client gets theta AND all of W and minimises the full softmax cross-entropy over all
classes (logits = scale * g(x)^T w_c, unit vectors); theta and W are both averaged (FedAvg)
and stepped by one server optimizer. Shares everything else with FedAwS
(raysim.algorithms.class_embedding, fedaws_wire, fedaws_reduce, fedaws_fast).
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import torch
from torch import nn

from raysim.algorithms.class_embedding import ClassEmbeddingMethod, next_state, normalize_rows
from raysim.algorithms.fedaws_fast import evaluate_class_embeddings
from raysim.algorithms.fedaws_wire import Broadcast, theta_message
from raysim.core.algorithm import RunContext
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.state import ClientUpdate, ServerState
from raysim.errors import ConfigError
from raysim.models.devices import to_numpy
from raysim.models.vector import build_model

# Logits are scale x cosine: past 1e4 the softmax is already a hard max, and past float32's
# 3.4e38 the logits are inf and every client's loss NaN (the paper uses 16).
MAX_SCALE = 1e4


class FedAwSSoftmax(ClassEmbeddingMethod):
    """The Softmax oracle: every client gets theta AND all of W and minimises the full softmax
    cross-entropy over all classes (logits = scale * g(x)^T w_c, unit vectors); theta and W are
    both averaged (FedAvg). Not possible in the real one-class setting, which is the point."""

    def __init__(
        self, *, scale: float = 16.0, class_lr: float | None = None, eval_max_points: int = 5000
    ) -> None:
        super().__init__(class_lr=class_lr, eval_max_points=eval_max_points)
        if not (scale > 0 and math.isfinite(scale)):
            raise ConfigError(f"'algorithm.scale' must be a finite number > 0, got {scale}")
        if scale > MAX_SCALE:
            raise ConfigError(f"'algorithm.scale' must be in (0, 1e4], got {scale}")
        self.scale = float(scale)

    evaluate = evaluate_class_embeddings  # FedAwS's: the same numbers, without a score matrix

    def client_loss(self, embeddings: torch.Tensor, targets, classes: torch.Tensor):
        """The loss of a batch (both client paths): the full softmax over every class,
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
            uuid.uuid4().int & ((1 << 63) - 1),
            state.arrays["class_embeddings"],
        )

    def client_update(
        self, payload: Broadcast, x: torch.Tensor, y: torch.Tensor, client_id, generator, ctx
    ) -> ClientUpdate:
        clients = ctx.config.clients
        device, x, y, model, layout, touched, table, local_x, params = self._client_setup(
            ctx, payload, x, y
        )
        start_classes = np.asarray(payload.classes, dtype=np.float32)
        classes = torch.tensor(start_classes, device=device, requires_grad=True)
        optimizer = torch.optim.SGD(
            [{"params": params}, {"params": [classes], "lr": self.class_lr or clients.lr}],
            lr=clients.lr,
            momentum=clients.momentum,
            weight_decay=clients.weight_decay,
        )

        mean_loss = self._train_locally(
            model, layout, x, y, local_x, table, generator, optimizer, ctx, classes
        )
        message = theta_message(model, layout, payload, touched, table)
        message["classes"] = to_numpy(classes) - start_classes
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            vector=message,
            metrics={"loss": mean_loss},
        )

    def batched_client_updates(self, payload: Broadcast, batch, ctx: RunContext) -> list:
        """`client_update` for a chunk of clients at once: theta and each client's copy of W
        trained together (W at class_lr), each client's loss the full softmax."""
        start_classes = np.asarray(payload.classes, dtype=np.float32)
        shape = start_classes.shape
        rate = self.class_lr or ctx.config.clients.lr
        extras = [start_classes] * len(batch)
        theta, dense, trained_classes, losses, bags = self._train_batched(
            payload, batch, ctx, extras, rate
        )
        updates = []
        for i, client_id in enumerate(batch.client_ids):
            message = {
                "dense": dense[i] - theta,
                **bags[i],  # an embedding bag's touched rows (theta_message's bag_ids, bag_rows)
                "classes": trained_classes[i].reshape(shape) - start_classes,
            }
            updates.append(self._batched_update(client_id, batch.ys[i], message, losses[i]))
        return updates

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
