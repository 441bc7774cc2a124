"""FedAvg (McMahan et al., AISTATS 2017) and FedProx (Li et al., MLSys 2020).

Round t: every sampled client starts from the global weights x_t, runs E epochs of minibatch
SGD on its own data and returns delta_i = x_i - x_t. The aggregator combines the deltas (FedAvg:
weighted by sample count, `aggregator: weighted_mean`; or uniform, `aggregator: mean`), and the
server optimizer applies the result: x_{t+1} = x_t + lr_s * Delta (FedAvg: SGD with lr_s = 1;
FedAvgM / FedAdagrad / FedAdam via `server.optimizer`, Reddi et al. 2021).
FedProx adds the proximal term (mu / 2) ||x - x_t||^2 to every client's local loss.

The FRL reference code trains its baselines with lr * lr_decay^t in round t, cosine-annealed
over the local epochs (`lr_decay: 0.999`, `lr_schedule: cosine_epochs`); the defaults (1.0,
`constant`) are plain FedAvg's constant learning rate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from raysim.core import server_optimizers
from raysim.core.algorithm import RunContext
from raysim.core.batched_training import (
    ClientBatch,
    client_sgd,
    model_problem,
    overridden_below_batched_twin,
    train_batched,
)
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import check_lr_options, fresh_sgd, local_training, scheduled_lr
from raysim.metrics import evaluate_classifier
from raysim.models.devices import autocast, client_device, server_device
from raysim.models.vector import build_model, cached_model, get_vector, model_layout, set_vector


class DeltaAveraging:
    """The model-delta family: dense float32 weights down, each client's delta up in the run's
    codec, the aggregate applied by the server optimizer. FedAvg, FedProx, SignSGD, TopK and
    the multi-label family (raysim.algorithms.flag) are this class with another local
    training (`train_locally`), declared statistics (`client_stats`), codec, aggregator or
    evaluation. Subclass it for a method of your own (docs/EXTENDING.md)."""

    labels = "single"  # one class per sample (checked when a run starts)

    default_aggregator = "weighted_mean"
    default_codec = "dense"
    update_delta_of = "params"  # updates are deltas of this array (their size is bounded)

    def __init__(
        self,
        proximal_mu: float,
        mixed_precision: bool = False,
        lr_decay: float = 1.0,
        lr_schedule: str = "constant",
    ) -> None:
        from raysim.errors import ConfigError

        if proximal_mu < 0:
            raise ConfigError(f"'algorithm.mu' must be >= 0, got {proximal_mu}")
        check_lr_options(lr_decay, lr_schedule)
        self.proximal_mu = float(proximal_mu)
        self.mixed_precision = bool(mixed_precision)
        self.lr_decay = float(lr_decay)
        self.lr_schedule = lr_schedule

    def init_server(self, ctx: RunContext) -> ServerState:
        params = get_vector(build_model(ctx))
        slots = server_optimizers.from_config(ctx.config).init(params)
        return ServerState(0, {"params": params, **server_optimizers.slot_arrays(slots)})

    def server_payload(self, state: ServerState) -> np.ndarray | dict:
        if self.lr_decay == 1.0:
            return state.arrays["params"]
        # A decaying learning rate needs the round on the client (one int64 more down).
        return {"params": state.arrays["params"], "round": np.array([state.round], np.int64)}

    def client_update(
        self,
        payload: np.ndarray,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        round_lr = None
        if isinstance(payload, dict):  # lr_decay < 1: the round rides along (server_payload)
            round_lr = ctx.config.clients.lr * self.lr_decay ** int(payload["round"][0])
            payload = payload["params"]
        # The task's GPU when clients.num_gpus reserved one, else the CPU (devices.py).
        device = client_device(ctx)
        model = cached_model(ctx, device)
        start = self.client_start(payload, client_id, ctx)
        set_vector(model, start)
        stats = self.client_stats(y, ctx)
        loss = float("nan")
        if len(y):
            x, y = x.to(device), y.to(device)
            if round_lr is None:  # the call every train_locally override already takes
                loss = self.train_locally(model, x, y, generator, ctx)
            else:
                loss = self.train_locally(model, x, y, generator, ctx, lr=round_lr)
        trained = get_vector(model)
        self.client_finished(client_id, trained, ctx)
        # The task encodes the delta with the run's codec (raysim.core.codecs).
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            vector=trained - start,
            metrics={"loss": loss},
            stats=stats,
        )

    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this instance's clients cannot train batched (clients.batched), or None: the
        batched twin below reproduces `client_update` / `train_locally` as written here, so a
        subclass that overrides either without overriding the twin (or mixed precision) trains
        one client at a time."""
        stale = overridden_below_batched_twin(self, ("client_update", "train_locally"))
        if stale:
            return stale
        if self.mixed_precision:
            return "mixed_precision (bfloat16 autocast) is not batched"
        return model_problem(cached_model(ctx, client_device(ctx)), ctx.input_shape)

    def batched_client_updates(self, payload, batch: ClientBatch, ctx: RunContext) -> list:
        """`client_update` for a chunk of clients at once (raysim.core.batched_training)."""
        round_lr = None
        if isinstance(payload, dict):  # lr_decay < 1: the round rides along (server_payload)
            round_lr = ctx.config.clients.lr * self.lr_decay ** int(payload["round"][0])
            payload = payload["params"]
        device = client_device(ctx)
        clients = ctx.config.clients
        starts = [self.client_start(payload, c, ctx) for c in batch.client_ids]
        trained, losses = train_batched(
            cached_model(ctx, device),
            starts,
            batch,
            lr=clients.lr if round_lr is None else round_lr,
            **client_sgd(clients),
            proximal_mu=self.proximal_mu,
            lr_schedule=self.lr_schedule,
            device=device,
        )
        # One subtraction for the chunk when every client starts from the global model (the
        # same values as row by row); personal starts are subtracted row by row, uncopied.
        if all(start is starts[0] for start in starts):
            deltas = trained - starts[0]
        else:
            deltas = [row - start for row, start in zip(trained, starts, strict=True)]
        updates = []
        for i, client_id in enumerate(batch.client_ids):
            self.client_finished(client_id, trained[i], ctx)
            updates.append(
                ClientUpdate(
                    client_id=client_id,
                    num_samples=len(batch.ys[i]),
                    vector=deltas[i],
                    metrics={"loss": losses[i]},
                    stats=self.client_stats(batch.ys[i], ctx),
                )
            )
        return updates

    # --- the steps a variant changes -------------------------------------------------------------
    def client_start(self, payload: np.ndarray, client_id: int, ctx: RunContext) -> np.ndarray:
        """The vector a client starts training from (personal layers: with its own parts)."""
        return payload

    def client_finished(self, client_id: int, trained: np.ndarray, ctx: RunContext) -> None:
        """After local training (personal layers: keep the client's own parts)."""

    def client_stats(self, y: torch.Tensor, ctx: RunContext) -> dict[str, float]:
        """Numbers a client declares beside its delta for the aggregator (none here)."""
        return {}

    def update_layout(self, ctx: RunContext):
        return model_layout(ctx)

    def train_locally(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        generator,
        ctx: RunContext,
        lr: float | None = None,
    ) -> float:
        """E epochs of minibatch SGD (cross-entropy, + FedProx's proximal term) on one client's
        data (raysim.core.training); returns the mean training loss.

        `lr`: this round's base learning rate (clients.lr when None), scheduled within the
        round by `lr_schedule`. The optimizer is new every round (fresh momentum), as in the
        FRL reference code, which rebuilds it for every client.

        The model and the data may live on a GPU (the batch order is drawn on the CPU either
        way); `mixed_precision` runs the forward pass and the loss under bfloat16 autocast.
        """
        clients = ctx.config.clients
        base_lr = clients.lr if lr is None else lr
        optimizer = fresh_sgd(
            model, lr=base_lr, momentum=clients.momentum, weight_decay=clients.weight_decay
        )
        before_step = None
        if self.lr_schedule != "constant":
            steps_per_epoch = -(-len(y) // clients.batch_size)

            def before_step(step: int) -> None:
                rate = scheduled_lr(
                    self.lr_schedule,
                    base_lr,
                    step,
                    steps_per_epoch=steps_per_epoch,
                    epochs=clients.local_epochs,
                )
                for group in optimizer.param_groups:
                    group["lr"] = rate

        def loss_fn(batch: torch.Tensor) -> torch.Tensor:
            with autocast(x.device, self.mixed_precision):
                return nn.functional.cross_entropy(model(x[batch]).float(), y[batch])

        return local_training(
            len(y),
            generator,
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            loss_fn=loss_fn,
            optimizer=optimizer,
            proximal_mu=self.proximal_mu,
            before_step=before_step,
            device=x.device,
        )

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> tuple[ServerState, dict[str, float]]:
        optimizer = server_optimizers.from_config(ctx.config)
        slots = server_optimizers.slots_of(state.arrays)
        params, slots = optimizer.step(state.arrays["params"], aggregate, slots)
        arrays = {"params": params, **server_optimizers.slot_arrays(slots)}
        for key, value in state.arrays.items():  # what subclasses keep beside (client models)
            arrays.setdefault(key, value)
        return ServerState(state.round + 1, arrays), {}

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        model = cached_model(ctx, server_device(ctx))  # the server's GPU when it has one
        set_vector(model, state.arrays["params"])
        return evaluate_classifier(model, x, y)


class FedAvg(DeltaAveraging):
    """FedAvg: local SGD from the global model, deltas averaged by sample count.

    `mixed_precision: true`: clients train under bfloat16 autocast (for heavy models on
    GPUs; weights, optimizer and deltas stay float32)."""

    def __init__(
        self, *, mixed_precision: bool = False, lr_decay: float = 1.0, lr_schedule: str = "constant"
    ) -> None:
        super().__init__(0.0, mixed_precision, lr_decay, lr_schedule)


class FedProx(DeltaAveraging):
    """FedProx: FedAvg with the proximal term (mu / 2) ||x - x_t||^2 in every local loss."""

    def __init__(
        self,
        *,
        mu: float = 0.01,
        mixed_precision: bool = False,
        lr_decay: float = 1.0,
        lr_schedule: str = "constant",
    ) -> None:
        super().__init__(mu, mixed_precision, lr_decay, lr_schedule)
