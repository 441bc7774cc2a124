"""Personalised multi-label baselines of FLAG's paper, all on the explicit client state store.

- Local only: every client trains its own model and never shares it.
- Personal BN (FedBN, Li et al., ICLR 2021): BatchNorm parameters and statistics stay on the
  client; everything else is averaged.
- Personal classifier (FedPer, Arivazhagan et al. 2019): the last linear layer stays on the
  client; the body is averaged.
- Per-FedAvg, first-order (Fallah et al., NeurIPS 2020): MAML-style local steps
  w <- w - beta * grad L_D'(w - alpha * grad L_D(w)) with the outer gradient taken at the
  adapted point (first-order approximation); a client's personal model is the global model
  after one adaptation step (alpha) on its data, made when it is sampled.

Personal parts live in the client state store (`ctx.client_state`, raysim.runtime.client_state)
keyed by client id: a client task reads them before training and writes them back after, and
the store is checkpointed with the server. Only the shared entries cross the wire. AmAP / WmAP
use each client's personalised model; GmAP uses the shared global model (Local only has none:
its GmAP is not reported; nor is Personal classifier's, whose global classifier is
never trained).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from raysim.algorithms.flag import (
    MultiLabelAveraging,
    declared_stats,
    evaluate_multilabel,
)
from raysim.core.algorithm import RunContext
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import local_training
from raysim.errors import ConfigError
from raysim.models.devices import client_device, server_device
from raysim.models.vector import _tensors, cached_model, get_vector, set_vector

PERSONAL_PARTS = ("all", "bn", "classifier")
_MASK_CACHE: dict[tuple[str, str], np.ndarray] = {}


def personal_mask(model: nn.Module, part: str) -> np.ndarray:
    """Boolean mask over the model's flat vector (raysim.models.vector order) of the entries
    that stay on the client: 'all', 'bn' (every BatchNorm tensor) or 'classifier' (the last
    Linear layer)."""
    if part not in PERSONAL_PARTS:
        raise ConfigError(f"personal part must be one of {', '.join(PERSONAL_PARTS)}: {part!r}")
    if part == "bn":
        keep = {
            id(t)
            for m in model.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for t in m.state_dict(keep_vars=True).values()
        }
        if not keep:
            raise ConfigError(
                "'personal_bn' needs a model with BatchNorm layers (e.g. model.name: mlp_bn)"
            )
    elif part == "classifier":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise ConfigError("'personal_classifier' needs a model ending in a Linear layer")
        keep = {id(t) for t in linears[-1].state_dict(keep_vars=True).values()}
    pieces = []
    for tensor in _tensors(model):
        personal = part == "all" or id(tensor) in keep
        pieces.append(np.full(tensor.numel(), personal, dtype=bool))
    return np.concatenate(pieces)


class PersonalizedAveraging(MultiLabelAveraging):
    """Averaging of the shared entries; `part` of the model is kept per client in the store."""

    uses_client_state = True
    part = "all"

    def __init__(
        self,
        *,
        weighting: str = "samples",
        mu: float = 0.0,
        loss: str = "asl",
        gamma_neg: float = 4.0,
        gamma_pos: float = 0.0,
        clip: float = 0.05,
        optimizer: str = "adam",
        schedule: str = "onecycle",
    ) -> None:
        super().__init__(
            weighting=weighting,
            mu=mu,
            loss=loss,
            gamma_neg=gamma_neg,
            gamma_pos=gamma_pos,
            clip=clip,
            optimizer=optimizer,
            schedule=schedule,
            keep_client_models=False,  # client models come from the store
        )

    def mask(self, ctx: RunContext) -> np.ndarray:
        key = (ctx.model_key(), self.part)
        if key not in _MASK_CACHE:
            _MASK_CACHE[key] = personal_mask(cached_model(ctx), self.part)
        return _MASK_CACHE[key]

    def personal_model(self, global_params: np.ndarray, stored: dict | None, ctx) -> np.ndarray:
        """The client's model: the global vector with its personal entries (if any) in place."""
        params = np.array(global_params, dtype=np.float32, copy=True)
        if stored is not None:
            params[self.mask(ctx)] = stored["personal"]
        return params

    def client_start(self, payload: np.ndarray, client_id: int, ctx: RunContext) -> np.ndarray:
        """The global vector with the client's personal entries (from the store) in place."""
        return self.personal_model(payload, ctx.client_state.get(client_id), ctx)

    def client_finished(self, client_id: int, trained: np.ndarray, ctx: RunContext) -> None:
        """The personal entries go back to the store; only the rest is sent (shared_mask)."""
        ctx.client_state.put(client_id, {"personal": trained[self.mask(ctx)]})

    def shared_mask(self, ctx: RunContext) -> np.ndarray:
        """The entries that cross the wire; the personal part stays in the store."""
        return ~self.mask(ctx)

    def client_models(self, state: ServerState, ctx: RunContext) -> dict[int, np.ndarray]:
        store = ctx.client_state
        return {
            client: self.personal_model(state.arrays["params"], store.get(client), ctx)
            for client in store.client_ids()
        }

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        # Local only has no global model; with a personal classifier the global copy of the
        # classifier is never trained, so neither has a meaningful GmAP.
        global_params = None if self.part in ("all", "classifier") else state.arrays["params"]
        model = cached_model(ctx, server_device(ctx))  # the server's GPU when it has one
        return evaluate_multilabel(model, global_params, self.client_models(state, ctx), x, y, ctx)


class LocalOnly(PersonalizedAveraging):
    """Every client trains only its own model (kept in the store); nothing is shared."""

    part = "all"


class PersonalBN(PersonalizedAveraging):
    """FedBN: BatchNorm layers stay on the client."""

    part = "bn"


class PersonalClassifier(PersonalizedAveraging):
    """FedPer: the last linear layer stays on the client."""

    part = "classifier"


class PerFedAvg(MultiLabelAveraging):
    """Per-FedAvg, first-order (Fallah et al. 2020); personal models kept in the store."""

    uses_client_state = True
    # Its client is its own (an inner adaptation step, then outer steps on pairs of batches):
    # written as client_update, trained one at a time.
    client_step = None

    def __init__(
        self,
        *,
        inner_lr: float = 0.01,
        weighting: str = "samples",
        loss: str = "asl",
        gamma_neg: float = 4.0,
        gamma_pos: float = 0.0,
        clip: float = 0.05,
        optimizer: str = "adam",
    ) -> None:
        super().__init__(
            weighting=weighting,
            loss=loss,
            gamma_neg=gamma_neg,
            gamma_pos=gamma_pos,
            clip=clip,
            optimizer=optimizer,
            keep_client_models=False,  # personal models come from the store
        )
        if not inner_lr > 0:
            raise ConfigError(f"'algorithm.inner_lr' must be > 0, got {inner_lr}")
        self.inner_lr = float(inner_lr)

    def _adapt(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch) -> None:
        """One SGD step of size inner_lr on `batch` (the inner MAML step), in place."""
        loss = self.loss_fn(model(x[batch]), y[batch])
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for p, g in zip(model.parameters(), grads, strict=True):
                p -= self.inner_lr * g

    def client_update(
        self,
        payload: np.ndarray,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        clients = ctx.config.clients
        # The task's GPU when clients.num_gpus reserved one, else the CPU (models.devices).
        device = client_device(ctx)
        model = cached_model(ctx, device)
        stats = declared_stats(y.numpy(), ctx.num_classes)
        x, targets = x.to(device), y.float().to(device)
        loss = float("nan")
        set_vector(model, payload)
        if len(y):
            # The personal model: one adaptation step from the received global model.
            model.train()
            first = torch.randperm(len(y), generator=generator)[: clients.batch_size]
            self._adapt(model, x, targets, first.to(device))
            ctx.client_state.put(client_id, {"personal": get_vector(model)})
            set_vector(model, payload)
            params = list(model.parameters())
            optimizer = torch.optim.Adam(params, lr=clients.lr)
            if self.optimizer == "sgd":
                optimizer = torch.optim.SGD(params, lr=clients.lr, momentum=clients.momentum)
            saved: list[torch.Tensor] = []

            def outer_loss(inner: torch.Tensor, outer: torch.Tensor) -> torch.Tensor:
                """The loss on `outer` after one adaptation step on `inner`."""
                saved[:] = [p.detach().clone() for p in params]
                self._adapt(model, x, targets, inner)
                return self.loss_fn(model(x[outer]), targets[outer])

            def first_order_gradient(loss: torch.Tensor) -> None:
                """The gradient at the adapted point, applied from the saved one."""
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    for p, s, g in zip(params, saved, grads, strict=True):
                        p.copy_(s)
                        p.grad = g

            loss = local_training(
                len(y),
                generator,
                batch_size=clients.batch_size,
                epochs=clients.local_epochs,
                loss_fn=outer_loss,
                optimizer=optimizer,
                backward=first_order_gradient,
                batches_per_step=2,  # (inner, outer) pairs of consecutive batches
                device=device,
                loss_without_steps=float("nan"),
            )
        delta = get_vector(model) - payload
        return ClientUpdate(
            client_id=client_id,
            num_samples=len(y),
            vector=delta,
            metrics={"loss": loss},
            stats=stats,
        )

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        store = ctx.client_state
        personal = {c: store.get(c)["personal"] for c in store.client_ids()}
        model = cached_model(ctx, server_device(ctx))
        return evaluate_multilabel(model, state.arrays["params"], personal, x, y, ctx)
