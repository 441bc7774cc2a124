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
from raysim.core.batched_training import model_problem
from raysim.core.client_step import ClientStep, DescribedClient, TrainedClients
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import check_lr_options
from raysim.losses import cross_entropy_rows
from raysim.metrics import evaluate_classifier
from raysim.models.devices import client_device, server_device
from raysim.models.vector import build_model, cached_model, get_vector, model_layout, set_vector


def global_params(payload) -> np.ndarray:
    """The global model of a payload (`server_payload`: the vector, or with the round)."""
    return payload["params"] if isinstance(payload, dict) else payload


class DeltaAveraging(DescribedClient):
    """The model-delta family: dense float32 weights down, each client's delta up in the run's
    codec, the aggregate applied by the server optimizer. FedAvg, FedProx, SignSGD, TopK and
    the multi-label family (raysim.algorithms.flag) are this class with another local
    training (`client_step`), declared statistics (`client_stats`), codec, aggregator or
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

    # --- the client, described once (raysim.core.client_step) ---------------------------------
    def client_step(self, payload, ctx: RunContext) -> ClientStep:
        """E epochs of minibatch SGD (cross-entropy, + FedProx's proximal term) from the
        round's base rate (clients.lr, x lr_decay^round when it decays), scheduled within the
        round by `lr_schedule`; momentum and weight decay from `clients`. The optimizer is new
        every round (fresh momentum), as in the FRL reference code, which rebuilds it for every
        client. The model lives on the task's GPU when clients.num_gpus reserved one, else on
        the CPU; `mixed_precision` runs the forward pass and the loss under bfloat16 autocast
        (one client at a time only)."""
        clients = ctx.config.clients
        lr = clients.lr
        if isinstance(payload, dict):  # lr_decay < 1: the round rides along (server_payload)
            lr = clients.lr * self.lr_decay ** int(payload["round"][0])
        # cross_entropy_rows is batch_loss row by row, in one call; a subclass with a loss of
        # its own has it vmapped over the rows instead
        own_loss = type(self).batch_loss is not DeltaAveraging.batch_loss
        return ClientStep.of(
            clients,
            model=cached_model(ctx, client_device(ctx)),
            loss=self.batch_loss,
            row_loss=None if own_loss else cross_entropy_rows,
            lr=lr,
            lr_schedule=self.lr_schedule,
            proximal_mu=self.proximal_mu,
            mixed_precision=self.mixed_precision,
        )

    @staticmethod
    def batch_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of a batch (in float32 under mixed precision)."""
        return nn.functional.cross_entropy(outputs.float(), targets)

    def client_start(self, payload, client_id: int, ctx: RunContext) -> np.ndarray:
        """The vector a client starts training from: the global model (personal layers:
        with the client's own parts, raysim.algorithms.personalized)."""
        return global_params(payload)

    def client_messages(self, payload, trained: TrainedClients, ctx: RunContext) -> list:
        """Each client's delta (trained - start; the task encodes it with the run's codec,
        raysim.core.codecs), its mean loss and its declared statistics."""
        starts, rows = trained.starts, trained.trained
        # One subtraction for the chunk when every client starts from the global model (the
        # same values as row by row); personal starts are subtracted row by row, uncopied.
        if all(start is starts[0] for start in starts):
            deltas = rows - starts[0]
        else:
            deltas = [row - start for row, start in zip(rows, starts, strict=True)]
        updates = []
        for i, client_id in enumerate(trained.client_ids):
            self.client_finished(client_id, rows[i], ctx)
            updates.append(
                ClientUpdate(
                    client_id=client_id,
                    num_samples=trained.ys[i].shape[0],
                    vector=deltas[i],
                    metrics={"loss": trained.losses[i]},
                    stats=self.client_stats(trained.ys[i], ctx),
                )
            )
        return updates

    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this instance's clients cannot train vmapped (clients.batched), or None."""
        if self.client_step is None:
            return f"{type(self).__name__} trains its clients in its own client_update"
        if self.mixed_precision:
            return "mixed_precision (bfloat16 autocast) is not batched"
        return model_problem(cached_model(ctx, client_device(ctx)), ctx.input_shape)

    # --- the steps a variant changes -------------------------------------------------------------
    def client_finished(self, client_id: int, trained: np.ndarray, ctx: RunContext) -> None:
        """After local training (personal layers: keep the client's own parts)."""

    def client_stats(self, y: torch.Tensor, ctx: RunContext) -> dict[str, float]:
        """Numbers a client declares beside its delta for the aggregator (none here)."""
        return {}

    def update_layout(self, ctx: RunContext):
        return model_layout(ctx)

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
