"""FedAvg (McMahan et al., AISTATS 2017) and FedProx (Li et al., MLSys 2020).

Round t: every sampled client starts from the global weights x_t, runs E epochs of minibatch
SGD on its own data and returns delta_i = x_i - x_t. The aggregator combines the deltas (FedAvg:
weighted by sample count, `aggregator: weighted_mean`; or uniform, `aggregator: mean`), and the
server optimizer applies the result: x_{t+1} = x_t + lr_s * Delta (FedAvg: SGD with lr_s = 1;
FedAvgM / FedAdagrad / FedAdam via `server.optimizer`, Reddi et al. 2021).
FedProx adds the proximal term (mu / 2) ||x - x_t||^2 to every client's local loss.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.state import ClientUpdate, ServerState
from raysim.metrics import evaluate_classifier
from raysim.models.vector import build_model, cached_model, get_vector, model_layout, set_vector
from raysim.runtime.devices import autocast, client_device


def local_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    generator: torch.Generator,
    ctx: RunContext,
    proximal_mu: float = 0.0,
    mixed_precision: bool = False,
) -> float:
    """E epochs of minibatch SGD on one client's data; returns the mean training loss.

    Batches are shuffled with the client's own generator, so the result depends only on
    (seed, round, client id), never on which worker ran the client. The model and the data
    may live on a GPU (the batch order is drawn on the CPU either way); `mixed_precision`
    runs the forward pass and the loss under bfloat16 autocast.
    """
    clients = ctx.config.clients
    optimizer = torch.optim.SGD(
        model.parameters(),
        lr=clients.lr,
        momentum=clients.momentum,
        weight_decay=clients.weight_decay,
    )
    anchors = [p.detach().clone() for p in model.parameters()] if proximal_mu else None
    loss_sum, steps = 0.0, 0
    for _ in range(clients.local_epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), clients.batch_size):
            batch = order[start : start + clients.batch_size].to(x.device)
            with autocast(x.device, mixed_precision):
                loss = nn.functional.cross_entropy(model(x[batch]).float(), y[batch])
            if anchors is not None:
                proximal = sum(
                    ((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchors, strict=True)
                )
                loss = loss + 0.5 * proximal_mu * proximal
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            loss_sum += float(loss.detach())
            steps += 1
    return loss_sum / max(1, steps)


class _DeltaAveraging:
    """Shared by FedAvg, FedProx, SignSGD and TopK: dense float32 weights down, the delta up
    in the run's codec (`codec:`; default dense float32, SignSGD's signs, TopK's top-k)."""

    default_aggregator = "weighted_mean"
    default_codec = "dense"

    def __init__(self, proximal_mu: float, mixed_precision: bool = False) -> None:
        if proximal_mu < 0:
            from raysim.errors import ConfigError

            raise ConfigError(f"'algorithm.mu' must be >= 0, got {proximal_mu}")
        self.proximal_mu = float(proximal_mu)
        self.mixed_precision = bool(mixed_precision)

    def init_server(self, ctx: RunContext) -> ServerState:
        params = get_vector(build_model(ctx))
        slots = server_optimizers.from_config(ctx.config).init(params)
        return ServerState(0, {"params": params, **server_optimizers.slot_arrays(slots)})

    def server_payload(self, state: ServerState) -> np.ndarray:
        return state.arrays["params"]

    def client_update(
        self,
        payload: np.ndarray,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        # The task's GPU when clients.num_gpus reserved one, else the CPU (devices.py).
        device = client_device(ctx)
        model = cached_model(ctx, device)
        set_vector(model, payload)
        loss = float("nan")
        if len(y):
            x, y = x.to(device), y.to(device)
            loss = local_sgd(model, x, y, generator, ctx, self.proximal_mu, self.mixed_precision)
        delta = get_vector(model) - payload
        # The task encodes the delta with the run's codec (raysim.core.codecs).
        return ClientUpdate(
            client_id=client_id, num_samples=len(y), message=delta, metrics={"loss": loss}
        )

    def update_layout(self, ctx: RunContext):
        return model_layout(ctx)

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> ServerState:
        optimizer = server_optimizers.from_config(ctx.config)
        slots = server_optimizers.slots_of(state.arrays)
        params, slots = optimizer.step(state.arrays["params"], aggregate, slots)
        return ServerState(
            state.round + 1, {"params": params, **server_optimizers.slot_arrays(slots)}
        )

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        model = cached_model(ctx)
        set_vector(model, state.arrays["params"])
        return evaluate_classifier(model, x, y)


class FedAvg(_DeltaAveraging):
    """`mixed_precision: true`: clients train under bfloat16 autocast (for heavy models on
    GPUs; weights, optimizer and deltas stay float32)."""

    def __init__(self, *, mixed_precision: bool = False) -> None:
        super().__init__(proximal_mu=0.0, mixed_precision=mixed_precision)


class FedProx(_DeltaAveraging):
    def __init__(self, *, mu: float = 0.01, mixed_precision: bool = False) -> None:
        super().__init__(proximal_mu=mu, mixed_precision=mixed_precision)
