"""An algorithm plug-in written from scratch, with per-client state: SCAFFOLD.

SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020; option II of its Algorithm 1) corrects each client's drift on non-IID
data with control variates: the server keeps `c`, each client `c_i`, and every local step
follows `g - c_i + c` instead of the gradient `g`. After K steps of learning rate lr a client
sets `c_i+ = c_i - c + (x - y) / (K lr)` and sends `(y - x, c_i+ - c_i)`; the server moves
`x += server_lr * mean(dy)` and `c += (|S| / N) * mean(dc)`.

What it shows (docs/EXTENDING.md, "An algorithm from scratch"): no FedAvg base class; the
state as named arrays (`params`, `control`); each client's `c_i` in the client-state store
(`uses_client_state = True`: checkpointed with the run, so a resume continues with it); the
gradient correction in the training loop's `backward` hook; an update of two parts declared
by `update_layout`. Named in a config as `scaffold:Scaffold` (see scaffold.yaml).
"""

from __future__ import annotations

import numpy as np
import torch

import raysim
from raysim import ConfigError
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import fresh_sgd, local_training
from raysim.metrics import evaluate_classifier
from raysim.models.devices import client_device, server_device
from raysim.models.layout import VectorLayout
from raysim.models.vector import build_model, cached_model, get_vector, model_layout, set_vector


@raysim.plugin("algorithm")
class Scaffold:
    # SCAFFOLD averages the clients' updates with equal weights
    default_aggregator = "mean"
    uses_client_state = True  # ctx.client_state: each client's control variate c_i

    def __init__(self, *, server_lr: float = 1.0) -> None:
        if not server_lr > 0:
            raise ConfigError(f"'algorithm.server_lr' must be > 0, got {server_lr}")
        self.server_lr = float(server_lr)

    def init_server(self, ctx) -> ServerState:
        params = get_vector(build_model(ctx))  # seeded: the same start on every backend
        return ServerState(0, {"params": params, "control": np.zeros_like(params)})

    def server_payload(self, state: ServerState) -> np.ndarray:
        # one array down: the model and the server's control variate side by side
        return np.concatenate([state.arrays["params"], state.arrays["control"]])

    def update_layout(self, ctx) -> VectorLayout:
        """Two segments per model tensor: the model delta, then the control variate's."""
        model = model_layout(ctx)
        return VectorLayout(2 * model.size, np.dtype(np.float32), model.segments * 2)

    def client_update(self, payload, x, y, client_id, generator, ctx) -> ClientUpdate:
        clients = ctx.config.clients
        device = client_device(ctx)
        model = cached_model(ctx, device)
        size = payload.size // 2
        start, control = payload[:size], payload[size:]
        stored = ctx.client_state.get(client_id)  # None in the client's first round
        own = stored["control"] if stored is not None else np.zeros(size, np.float32)
        set_vector(model, start)
        params = list(model.parameters())
        if sum(p.numel() for p in params) != size:
            raise ConfigError("the SCAFFOLD example needs a model without buffers (e.g. mlp)")
        # c - c_i, cut into the parameters' shapes: added to every gradient
        correction = torch.from_numpy(control - own).to(device).split([p.numel() for p in params])
        correction = [c.view_as(p) for c, p in zip(correction, params, strict=True)]
        optimizer = fresh_sgd(model, lr=clients.lr)  # plain SGD: K lr is the local path length
        loss_fn = torch.nn.CrossEntropyLoss()
        x, y = x.to(device), y.to(device)
        steps = [0]

        def corrected_backward(loss: torch.Tensor) -> None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            for parameter, shift in zip(params, correction, strict=True):
                parameter.grad.add_(shift)
            steps[0] += 1

        loss = float("nan")
        if len(y):
            loss = local_training(
                len(y),
                generator,  # the client's generator: every draw reproducible on any backend
                batch_size=clients.batch_size,
                epochs=clients.local_epochs,
                loss_fn=lambda batch: loss_fn(model(x[batch]), y[batch]),
                optimizer=optimizer,
                backward=corrected_backward,
                device=device,
            )
        trained = get_vector(model)
        new_own = own
        if steps[0]:
            new_own = (
                own - control + (start - trained) / np.float32(steps[0] * clients.lr)
            ).astype(np.float32)
        ctx.client_state.put(client_id, {"control": new_own})
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            vector=np.concatenate([trained - start, new_own - own]),
            metrics={"loss": loss},
        )

    def server_update(self, state: ServerState, aggregate: np.ndarray, ctx):
        size = aggregate.size // 2
        mean_delta, mean_control = aggregate[:size], aggregate[size:]
        share = np.float32(ctx.config.clients.per_round / ctx.config.partition.num_clients)
        params = state.arrays["params"] + np.float32(self.server_lr) * mean_delta
        control = state.arrays["control"] + share * mean_control
        arrays = {"params": params.astype(np.float32), "control": control.astype(np.float32)}
        return ServerState(state.round + 1, arrays), {}  # no phases of its own to report

    def evaluate(self, state: ServerState, x, y, ctx) -> dict[str, float]:
        model = cached_model(ctx, server_device(ctx))
        set_vector(model, state.arrays["params"])
        return evaluate_classifier(model, x, y)
