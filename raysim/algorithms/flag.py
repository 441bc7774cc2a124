"""FLAG (Chang et al., "FLAG: Fast Label-Adaptive Aggregation for Multi-label Classification in
Federated Learning", arXiv 2302.13571) and the multi-label averaging baselines it is compared
with (FedAvg, uniform averaging, FedProx), on one training and evaluation path.

Round t: every sampled client starts from the global weights, trains E local epochs with the
multi-label loss (Asymmetric Loss by default; Adam + OneCycleLR as in the paper) and sends its
delta together with its label statistics: the share of the labels present in its data and its
number of positive labels, declared beside the update (`ClientUpdate.stats`), not inside it.
The aggregator (`label_weighted`, this module) combines the deltas with one weight per client:

    FLAG     w_c = label_weights(D, O, alpha)_c   (see `label_weights`: a reconstruction;
             O_c is the positive-label count, or with `occurrence: per_sample` that count
             over the client's sample count n_c, which every update carries as num_samples)
    FedAvg   w_c = n_c / sum n                    (samples)
    uniform  w_c = 1 / K

FLAG needs its weighting (another aggregator would ignore the statistics and is refused);
the samples / uniform variants compose with any aggregator (e.g. trimmed_mean). The server
also keeps each client's latest local model (`observe_contributions`) so that AmAP / WmAP
(each client's own model on its own validation split) can be measured; GmAP evaluates the
global model on every client's validation split (raysim.metrics.multilabel).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from raysim.algorithms.fedavg import DeltaAveraging
from raysim.core.algorithm import RunContext
from raysim.core.client_step import ClientStep
from raysim.core.state import Contribution, RoundInfo, ServerState
from raysim.errors import ConfigError
from raysim.losses import multilabel_loss
from raysim.metrics.multilabel import (
    mean_average_precision,
    per_client_map,
    predict_scores,
    summarise_clients,
)
from raysim.models.devices import server_device
from raysim.models.vector import cached_model, set_vector

WEIGHTINGS = ("flag", "samples", "uniform")
# How FLAG's label occurrence O_c is read (see `label_weights` and `client_occurrence`).
OCCURRENCES = ("count", "per_sample")
OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("onecycle", "constant")
CLIENT_MODEL_PREFIX = "client_model."


def label_weights(wideness: np.ndarray, occurrence: np.ndarray, alpha: float) -> np.ndarray:
    """FLAG's client weights from label statistics - a RECONSTRUCTION.

    The paper's exact formula is not available in this repository (nor its PDF); this is our
    reading of its description:
      wideness   D_c = |{l : count_c(l) > 0}| / L   (how many labels client c covers)
      occurrence O_c, one of two readings (`client_occurrence`, option `occurrence`):
        count      O_c = sum_l count_c(l)           (how many positive labels it holds; the
                   default, raysim's first reconstruction)
        per_sample O_c = sum_l count_c(l) / N_i^c   (positive labels per sample of client c,
                   N_i^c its sample count: the paper's wording as transcribed in the
                   project's audit - "label occurrence" as the frequency of positive labels
                   per sample, with N_c clients, N_l labels and N_i^c samples of client c in
                   its formula; with equal client sizes it gives the same weights as count)
      w_c = (1 - alpha) * D_c / sum_k D_k + alpha * O_c / sum_k O_k
    alpha in [0, 1] (0: wideness only; 1: occurrence only - with `count` close to FedAvg's
    sample weights, with `per_sample` close to uniform when clients have alike label
    cardinalities). The weights sum to 1. Swap this one function to try another reading.
    """
    wideness = np.asarray(wideness, dtype=np.float64)
    occurrence = np.asarray(occurrence, dtype=np.float64)
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"'algorithm.alpha' must be in [0, 1], got {alpha}")
    if wideness.sum() <= 0 or occurrence.sum() <= 0:
        raise ValueError("label weights need at least one client with a positive label")
    return (1.0 - alpha) * wideness / wideness.sum() + alpha * occurrence / occurrence.sum()


def client_occurrence(
    positive_labels: np.ndarray, num_samples: np.ndarray, occurrence: str = "count"
) -> np.ndarray:
    """FLAG's label occurrence O_c per client, float64, under one reading (`label_weights`):
    `count` returns the positive-label counts as they are (the default: the same numbers as
    before the option existed); `per_sample` divides them by the clients' sample counts
    N_i^c (mean positive labels per sample; 0 for a client without samples)."""
    positives = np.asarray(positive_labels, dtype=np.float64)
    if occurrence == "count":
        return positives
    if occurrence != "per_sample":
        raise ConfigError(
            f"'occurrence' must be one of {', '.join(OCCURRENCES)}, got {occurrence!r}"
        )
    samples = np.asarray(num_samples, dtype=np.float64)
    if samples.shape != positives.shape or (samples < 0).any():
        raise ValueError(f"need one sample count >= 0 per client, got {samples.tolist()}")
    return np.divide(positives, samples, out=np.zeros_like(positives), where=samples > 0)


def label_statistics(y: torch.Tensor | np.ndarray) -> np.ndarray:
    """A client's label counts: [distinct labels present, positive labels] int64."""
    y = np.asarray(y) != 0
    if y.ndim != 2:
        raise ConfigError(
            f"multi-label algorithms need multi-hot targets (n, L), got shape {y.shape}; use a "
            f"multi-label dataset (e.g. data.name: synthetic_multilabel)"
        )
    counts = y.sum(axis=0)
    return np.array([int((counts > 0).sum()), int(counts.sum())], dtype=np.int64)


def declared_stats(y: torch.Tensor | np.ndarray, num_labels: int) -> dict[str, float]:
    """What a client declares beside its update: its label wideness D_c (share of the labels
    it holds) and occurrence O_c (positive labels)."""
    distinct, positives = label_statistics(y).tolist()
    return {"label_wideness": distinct / num_labels, "positive_labels": float(positives)}


class LabelWeightedMean:
    """Aggregator 'label_weighted': sum_c w_c * update_c with one weight per client from the
    round's declared statistics (`weighting`: flag = FLAG's label weights, samples = n_c / sum
    n, uniform = 1 / K), in client-id order, in float64. Non-linear: FLAG's weights are
    normalised over the round, so the whole round is needed. `occurrence` (flag only): how
    FLAG's label occurrence is read, `count` (positive labels) or `per_sample` (positive
    labels over the client's num_samples; see `label_weights`)."""

    linear = False

    def __init__(
        self, *, weighting: str = "flag", alpha: float = 0.3, occurrence: str = "count"
    ) -> None:
        self.weighting = _check_choice("weighting", weighting, WEIGHTINGS)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"'alpha' must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)
        self.occurrence = _check_choice("occurrence", occurrence, OCCURRENCES, "aggregator")

    def client_weights(self, contributions: Sequence[Contribution]) -> np.ndarray:
        """One weight per contribution (summing to 1)."""
        if self.weighting == "flag":
            missing = [c.client_id for c in contributions if "label_wideness" not in c.stats]
            if missing:
                raise ConfigError(
                    f"aggregator 'label_weighted' (weighting flag) needs each client's declared "
                    f"label statistics; client {missing[0]} sent none (use a multi-label "
                    f"algorithm such as flag)"
                )
            wideness = np.array([c.stats["label_wideness"] for c in contributions])
            positives = np.array([c.stats["positive_labels"] for c in contributions])
            if self.occurrence == "count":  # the default path, unchanged
                return label_weights(wideness, positives, self.alpha)
            samples = np.array([c.num_samples for c in contributions], dtype=np.float64)
            occurrence = client_occurrence(positives, samples, self.occurrence)
            return label_weights(wideness, occurrence, self.alpha)
        num_samples = np.array([c.num_samples for c in contributions], dtype=np.float64)
        if self.weighting == "samples":
            return num_samples / num_samples.sum()
        return np.full(len(num_samples), 1.0 / len(num_samples))

    def aggregate(
        self, contributions: Sequence[Contribution], info: RoundInfo | None = None
    ) -> np.ndarray:
        weights = self.client_weights(contributions)
        combined = np.zeros(len(contributions[0].update), dtype=np.float64)
        for weight, contribution in zip(weights, contributions, strict=True):  # client-id order
            combined += weight * contribution.update.astype(np.float64)
        return combined.astype(np.float32)


def evaluate_multilabel(
    model: nn.Module,
    global_params: np.ndarray | None,
    client_params: dict[int, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    ctx: RunContext,
) -> dict[str, float]:
    """mAP of the global model on the whole test set, GmAP over the clients' validation splits,
    and AmAP / WmAP of the given client models on their own splits."""
    result: dict[str, float] = {}
    validation = getattr(ctx, "client_validation", None)
    if global_params is not None:
        set_vector(model, global_params)
        scores = predict_scores(model, x)
        result["map"] = mean_average_precision(scores, y)
        if validation is not None:
            gmap, worst = summarise_clients(
                per_client_map(scores, y, validation.indices, validation.offsets)
            )
            result["gmap"], result["gmap_worst"] = gmap, worst
    if validation is not None and client_params:
        maps = []
        for client, params in sorted(client_params.items()):
            rows = validation.client_indices(client)
            if not len(rows):
                continue
            set_vector(model, params)
            maps.append(mean_average_precision(predict_scores(model, x[rows]), y[rows]))
        amap, wmap = summarise_clients(np.asarray(maps, dtype=np.float64))
        result["amap"], result["wmap"] = amap, wmap
    return result


def _check_choice(key: str, value: str, choices: Sequence[str], section: str = "algorithm") -> str:
    if value not in choices:
        raise ConfigError(f"'{section}.{key}' must be one of {', '.join(choices)}, got {value!r}")
    return value


class MultiLabelAveraging(DeltaAveraging):
    """Multi-label FedAvg family: FedAvg (weighting 'samples'), uniform, FLAG, FedProx (mu).
    The model-delta method with a multi-label local training, declared label statistics, the
    label-weighted aggregator, per-client models for AmAP and multi-label metrics."""

    labels = "multi"  # multi-hot targets (checked when a run starts)

    def __init__(
        self,
        *,
        weighting: str = "samples",
        alpha: float = 0.3,
        mu: float = 0.0,
        loss: str = "asl",
        gamma_neg: float = 4.0,
        gamma_pos: float = 0.0,
        clip: float = 0.05,
        optimizer: str = "adam",
        schedule: str = "onecycle",
        keep_client_models: bool = True,
    ) -> None:
        super().__init__(proximal_mu=mu)
        self.weighting = _check_choice("weighting", weighting, WEIGHTINGS)
        if not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"'algorithm.alpha' must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)
        multilabel_loss(loss)  # validates the name
        self.loss_options = (loss, float(gamma_neg), float(gamma_pos), float(clip))
        self.optimizer = _check_choice("optimizer", optimizer, OPTIMIZERS)
        self.schedule = _check_choice("schedule", schedule, SCHEDULES)
        # AmAP/WmAP need each client's latest local model: kept in the server state (K x model).
        self.keep_client_models = keep_client_models
        # `aggregator: auto`: the weighting named by this algorithm's options.
        self.default_aggregator = LabelWeightedMean(weighting=self.weighting, alpha=self.alpha)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return multilabel_loss(*self.loss_options)(logits, targets)

    def batch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(outputs, targets.float())

    def client_step(self, payload, ctx: RunContext) -> ClientStep:
        """E epochs of minibatch training with the multi-label loss (the model delta family's
        step with another loss and optimizer): Adam + OneCycleLR (max lr = clients.lr) by
        default, as in FLAG's paper; optimizer state is fresh every round (clients are
        stateless). FedProx's proximal term when mu > 0."""
        clients = ctx.config.clients
        epochs = clients.local_epochs

        def optimizer(params, steps_per_epoch):
            if self.optimizer == "adam":
                opt = torch.optim.Adam(params, lr=clients.lr, weight_decay=clients.weight_decay)
            else:
                opt = torch.optim.SGD(
                    params,
                    lr=clients.lr,
                    momentum=clients.momentum,
                    weight_decay=clients.weight_decay,
                )
            scheduler = None
            if self.schedule == "onecycle" and steps_per_epoch * epochs > 1:
                scheduler = torch.optim.lr_scheduler.OneCycleLR(
                    opt, max_lr=clients.lr, total_steps=steps_per_epoch * epochs
                )
            return opt, scheduler

        return replace(super().client_step(payload, ctx), loss=self.batch_loss, optimizer=optimizer)

    def batching_problem(self, ctx: RunContext) -> str | None:
        return "the multi-label local optimizer (torch's Adam / SGD, OneCycleLR) is not batched"

    def check_aggregator(self, aggregator, ctx: RunContext) -> str | None:
        """FLAG's weighting needs the declared label statistics, which only label_weighted
        uses; the samples / uniform variants compose with any aggregator."""
        if self.weighting == "flag" and not isinstance(aggregator, LabelWeightedMean):
            return (
                "FLAG weights clients by their declared label statistics, which this "
                "aggregator ignores; use aggregator auto (or label_weighted)"
            )
        return None

    def client_stats(self, y: torch.Tensor, ctx: RunContext) -> dict[str, float]:
        """The label statistics FLAG's weighting needs (declared beside the delta)."""
        return declared_stats(y.numpy(), ctx.num_classes)

    def asynchronous_problem(self, config) -> str | None:
        """AmAP / WmAP's client models are kept beside the aggregate: asynchronously they
        would be written out of order; without them the server step is FedAvg's."""
        if self.keep_client_models:
            return (
                "keeps each client's local model beside the aggregate (observe_contributions): "
                "its server step is not a function of the aggregate; "
                "algorithm.keep_client_models: false runs it without them"
            )
        return None

    def observe_contributions(
        self,
        previous: ServerState,
        state: ServerState,
        contributions: Sequence[Contribution],
        ctx: RunContext,
    ) -> ServerState:
        """Keep each client's latest local model (global + its delta) for AmAP / WmAP."""
        if not self.keep_client_models:
            return state
        params = previous.arrays["params"]
        arrays = dict(state.arrays)
        for contribution in contributions:
            local = params.astype(np.float64) + contribution.update.astype(np.float64)
            arrays[f"{CLIENT_MODEL_PREFIX}{contribution.client_id}"] = local.astype(np.float32)
        return ServerState(state.round, arrays)

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        client_params = {
            int(key.removeprefix(CLIENT_MODEL_PREFIX)): value
            for key, value in state.arrays.items()
            if key.startswith(CLIENT_MODEL_PREFIX)
        }
        return evaluate_multilabel(
            cached_model(ctx, server_device(ctx)), state.arrays["params"], client_params, x, y, ctx
        )


class FLAG(MultiLabelAveraging):
    """FLAG: clients weighted by label wideness and occurrence (`label_weights`).

    `occurrence`: how the label occurrence O_c is read - `count` (default: the client's
    positive labels, raysim's first reconstruction, bit-identical to the runs before the
    option) or `per_sample` (positive labels per sample, O_c = positives / N_i^c, the paper's
    wording; N_i^c is the update's num_samples, which every client already sends). Neither
    is checked against the paper's exact formula, which is not available in this repository.
    An explicit `aggregator: label_weighted` uses its own options (alpha, occurrence)."""

    def __init__(
        self,
        *,
        alpha: float = 0.3,
        occurrence: str = "count",
        loss: str = "asl",
        gamma_neg: float = 4.0,
        gamma_pos: float = 0.0,
        clip: float = 0.05,
        optimizer: str = "adam",
        schedule: str = "onecycle",
    ) -> None:
        super().__init__(
            weighting="flag",
            alpha=alpha,
            loss=loss,
            gamma_neg=gamma_neg,
            gamma_pos=gamma_pos,
            clip=clip,
            optimizer=optimizer,
            schedule=schedule,
        )
        self.occurrence = _check_choice("occurrence", occurrence, OCCURRENCES)
        if self.occurrence != "count":
            self.default_aggregator = LabelWeightedMean(
                weighting="flag", alpha=self.alpha, occurrence=self.occurrence
            )


class MultiLabelFedProx(MultiLabelAveraging):
    """FedProx (Li et al., MLSys 2020) on multi-label data: FedAvg plus (mu/2)||w - w_t||^2."""

    def __init__(
        self,
        *,
        mu: float = 0.01,
        weighting: str = "samples",
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
        )
