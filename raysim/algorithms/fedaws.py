"""FedAwS: Federated Averaging with Spreadout (Yu, Rawat, Menon, Kumar; ICML 2020).

Every client holds the data of ONE class and so can only learn from positives. The model is
f(x) = W g_theta(x) with L2-normalised instance embeddings g_theta(x) and class embeddings w_c.

Round t (DESIGN.md §4.3):
  down   theta to every sampled client, and to client i only its own class row w_i;
  client E epochs of SGD on the positive-only squared hinge
         l_pos = max(0, 0.9 - g(x)^T w_y)^2 over (theta, w_i);
  up     the theta delta (embedding-bag rows: only the rows of features the client saw) and
         its new row;
  server theta <- theta + server optimizer(weighted mean of the deltas); rows <- the returned
         rows (never averaged across classes); then one spreadout step on W,
         W <- W - lambda * eta * grad reg(W), with reg the full Eq. 7 (small C) or Eq. 8 with
         negative mining: the k nearest classes of each updated class, found by the sharded
         nearest-class index (raysim.index), margin nu_c = distance to the (k+1)-th.

Baselines, same code: Baseline-1 `spreadout: none` (positive loss only; the class rows
collapse), Baseline-2 `train_class_embeddings: false` (W frozen at its random init). The
Softmax oracle `fedaws_softmax` (every client sees all of W and trains a full softmax; W is
averaged like theta) is in raysim.algorithms.fedaws_softmax; what both share (the worker-side
model, local training, evaluation) is in raysim.algorithms.class_embedding, what a client sends
in raysim.algorithms.fedaws_wire and how a task's clients are folded in
raysim.algorithms.fedaws_reduce. This module is the reference server step; the same numbers
written in place, for Amazon-670K scale, are in raysim.algorithms.fedaws_fast.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch

from raysim.algorithms import spreadout as reg
from raysim.algorithms.class_embedding import (
    ClassEmbeddingMethod,
    next_state,
    normalize_rows,
    returned_class_rows,
)
from raysim.algorithms.fedaws_fast import InPlaceServerUpdate, evaluate_class_embeddings
from raysim.algorithms.fedaws_wire import Broadcast, ClassRow
from raysim.algorithms.spreadout import DISTANCES
from raysim.config import MAX_LEARNING_RATE
from raysim.core.algorithm import RunContext
from raysim.core.state import ServerState
from raysim.errors import ConfigError
from raysim.index.base import server_threads
from raysim.models.devices import server_device
from raysim.models.vector import build_model

SPREADOUT_MODES = ("topk", "full", "none")
# The spreadout step is lambda x spreadout_lr x gradient; beyond these the class rows turn
# inf/NaN at the first step and every round's aggregate is refused (the paper uses lambda 10).
MAX_LAMBDA = 1e6
# Distances between unit rows are at most 2: a margin past 1e3 only makes the squared hinge
# (nu - d)^2 overflow, it cannot separate classes further.
MAX_NU = 1e3


def positive_loss(embeddings: torch.Tensor, row: torch.Tensor, margin: float) -> torch.Tensor:
    """FedAwS's client loss, positives only: mean over the batch of
    max(0, margin - g(x)^T w / |w|)^2 (the row is used as a unit vector)."""
    unit_row = row / row.norm().clamp_min(1e-12)
    return torch.relu(margin - embeddings @ unit_row).pow(2).mean()


class FedAwS(InPlaceServerUpdate, ClassEmbeddingMethod):
    """FedAwS (and its Baseline-1 / Baseline-2 via options); see the module docstring.
    Evaluation covers every test (and validation) point unless `eval_max_points` caps it."""

    def __init__(
        self,
        *,
        spreadout: str = "topk",
        lambda_: float = 10.0,
        k: int = 10,  # the paper's headline setting (with lambda 10); 100 for more negatives
        nu: float = 1.0,
        distance: str = "cosine",
        spreadout_lr: float | None = None,
        positive_margin: float = 0.9,
        train_class_embeddings: bool = True,
        class_lr: float | None = None,
        eval_max_points: int | None = None,  # None: every test point (an int: the first N)
    ) -> None:
        super().__init__(class_lr=class_lr, eval_max_points=eval_max_points)
        if spreadout not in SPREADOUT_MODES:
            raise ConfigError(
                f"'algorithm.spreadout' must be one of {', '.join(SPREADOUT_MODES)}, "
                f"got {spreadout!r}"
            )
        if distance not in DISTANCES:
            raise ConfigError(
                f"'algorithm.distance' must be one of {', '.join(DISTANCES)}, got {distance!r}"
            )
        if not (lambda_ >= 0 and math.isfinite(lambda_)):
            raise ConfigError(f"'algorithm.lambda' must be a finite number >= 0, got {lambda_}")
        if lambda_ > MAX_LAMBDA:
            raise ConfigError(f"'algorithm.lambda' must be in [0, 1e6], got {lambda_}")
        if k < 1:
            raise ConfigError(f"'algorithm.k' must be >= 1, got {k}")
        if not (nu > 0 and math.isfinite(nu)):
            raise ConfigError(f"'algorithm.nu' must be a finite number > 0, got {nu}")
        if nu > MAX_NU:
            raise ConfigError(f"'algorithm.nu' must be in (0, 1e3], got {nu}")
        if spreadout_lr is not None and not 0 < spreadout_lr <= MAX_LEARNING_RATE:
            raise ConfigError(f"'algorithm.spreadout_lr' must be in (0, 1e4], got {spreadout_lr}")
        if not 0 < positive_margin <= 2:
            raise ConfigError(
                f"'algorithm.positive_margin' must be in (0, 2], got {positive_margin}"
            )
        self.spreadout = spreadout if train_class_embeddings else "none"
        self.lambda_ = float(lambda_)
        self.k = int(k)
        self.nu = float(nu)
        self.distance = distance
        self.spreadout_lr = spreadout_lr
        self.positive_margin = float(positive_margin)
        self.train_class_embeddings = bool(train_class_embeddings)
        self._index = None
        self._index_round = -1

    evaluate = evaluate_class_embeddings

    def client_loss(self, embeddings: torch.Tensor, _targets, row: torch.Tensor) -> torch.Tensor:
        """The loss of a batch: the positive loss against the client's own class row."""
        return positive_loss(embeddings, row, self.positive_margin)

    # --- server -----------------------------------------------------------------------------------
    def init_server(self, ctx: RunContext) -> ServerState:
        model = build_model(ctx)
        dim = self._check_model(ctx, model)
        if self.spreadout == "topk" and self.k >= ctx.num_classes - 1:
            raise ConfigError(
                f"'algorithm.k' must be < num_classes - 1 = {ctx.num_classes - 1} (the "
                f"(k+1)-th nearest class sets the margin), got {self.k}"
            )
        return self._initial_state(ctx, model, dim, optimize_classes=False)

    def server_payload(self, state: ServerState) -> Broadcast:
        return Broadcast(state.arrays["params"])

    def client_payload(self, state: ServerState, client_ids: np.ndarray, client_classes):
        """Only each client's own class row goes down (DESIGN §4.3), tagged with its class:
        the task's reducer refuses a message writing any other class's row."""
        if len(client_classes) and client_classes.min() < 0:
            bad = int(client_ids[np.flatnonzero(client_classes < 0)[0]])
            raise ConfigError(
                f"FedAwS needs one class per client (partition.name: one_class); client {bad} "
                f"holds several classes or no data"
            )
        rows = state.arrays["class_embeddings"][client_classes]
        return [ClassRow(int(c), row) for c, row in zip(client_classes, rows, strict=True)]

    # --- client (described once in raysim.algorithms.class_embedding) ----------------------------
    def client_extras(self, payload: Broadcast, personal, count: int) -> list[np.ndarray]:
        """What each client trains beside theta: its own class row (its personal payload)."""
        return [np.asarray(sent, dtype=np.float32) for sent in personal]

    def extra_lr(self, ctx: RunContext) -> float:
        """The row's rate: class_lr (default clients.lr); 0 (held fixed) when class
        embeddings are not trained."""
        if not self.train_class_embeddings:
            return 0.0
        return self.class_lr or ctx.config.clients.lr

    def extra_message(self, payload: Broadcast, trained_row: np.ndarray, y: torch.Tensor) -> dict:
        """The client's class and its new row, as a unit vector (none when W is frozen)."""
        if not self.train_class_embeddings:
            return {}
        return {
            "class": int(y[0]) if len(y) else -1,
            "row": normalize_rows(trained_row[None, :])[0],
        }

    # --- server update ----------------------------------------------------------------------------
    def server_update(self, state: ServerState, aggregate: dict, ctx: RunContext):
        """The next state and the seconds of the phases timed here (index_s, spreadout_s).

        theta, its optimizer slots and W's changed rows are updated in place
        (raysim.algorithms.fedaws_fast), with the same arithmetic as the copying update
        (`_copying_update`) on every element, when the new state is certainly finite;
        otherwise (a user's optimizer, a step that could overflow, spreadout 'full', read-only
        arrays) the copying update runs and the previous state stays intact for the server to
        keep if it refuses the new one. The server's phases use every CPU the process may use
        (raysim.index.base.server_threads)."""
        with server_threads():
            result = self._in_place_update(state, aggregate, ctx)
            return result if result is not None else self._copying_update(state, aggregate, ctx)

    def _copying_update(self, state: ServerState, aggregate: dict, ctx: RunContext):
        """The reference server step: theta + server optimizer(weighted mean delta); the
        returned rows written back (never averaged across classes); one spreadout step."""
        times: dict[str, float] = {}
        params, slots = self._theta_step(state, aggregate, ctx)
        classes = state.arrays["class_embeddings"]
        if self.train_class_embeddings and len(aggregate["class_ids"]):
            classes = classes.copy()
            ids = aggregate["class_ids"]
            classes[ids] = returned_class_rows(aggregate)
            classes = self._spreadout_step(classes, ids, state.round, ctx, times)
        return next_state(state, params, classes, slots), times

    def _spreadout_step_size(self, ctx: RunContext) -> float | None:
        """lambda x eta of the spreadout step; None when there is none."""
        if self.spreadout == "none" or self.lambda_ == 0:
            return None
        return self.lambda_ * (self.spreadout_lr or ctx.config.clients.lr)

    def _spreadout_step(
        self,
        classes: np.ndarray,
        updated: np.ndarray,
        round_index: int,
        ctx: RunContext,
        times: dict[str, float],
    ) -> np.ndarray:
        """W <- W - lambda * eta * grad reg(W), changed rows re-normalised; the phases'
        seconds go into `times`."""
        step = self._spreadout_step_size(ctx)
        if step is None:
            return classes
        if self.spreadout == "full":
            started = time.perf_counter()
            _, grad = reg.spreadout_full(classes, self.nu, self.distance, server_device(ctx))
            classes = normalize_rows(classes - step * np.asarray(grad, dtype=np.float32))
            times["spreadout_s"] = time.perf_counter() - started
            return classes
        index, grad_rows, grad_ids, started = self._mined_gradient(
            classes, updated, round_index, ctx, times
        )
        classes[grad_ids] = normalize_rows(
            classes[grad_ids] - step * np.asarray(grad_rows, dtype=np.float32)
        )
        self._sync_index_rows(index, grad_ids, classes[grad_ids], started, times)
        return classes

    def _mined_gradient(self, classes, updated, round_index: int, ctx: RunContext, times):
        """Top-k negative mining for the updated rows, then the sparse spreadout gradient
        (Eq. 8): (index, gradient rows, their class ids, when the spreadout phase started).
        `times["index_s"]` gets the mining's seconds."""
        started = time.perf_counter()
        index = self._synced_index(classes, updated, round_index, ctx)
        neighbor_ids, neighbor_nu = reg.mine_negatives(
            index, classes, updated, self.k, self.distance
        )
        times["index_s"] = time.perf_counter() - started
        started = time.perf_counter()
        _, grad_rows, grad_ids = reg.spreadout_topk(  # products on the server's GPU if any
            classes, updated, neighbor_ids, neighbor_nu, self.distance, server_device(ctx)
        )
        return index, grad_rows, grad_ids, started

    def _sync_index_rows(self, index, ids, rows, started: float, times) -> None:
        """The spreadout phase (begun at `started`) ends; the index takes W's new rows."""
        times["spreadout_s"] = time.perf_counter() - started
        started = time.perf_counter()
        index.update(ids, rows)  # keep the index equal to W
        times["index_s"] += time.perf_counter() - started

    def _synced_index(self, classes, updated, round_index: int, ctx: RunContext):
        """The nearest-class index, holding exactly `classes` (rebuilt when new or stale).

        Trained indexes retrain themselves (faiss IVF: every `index.retrain_every` updates)."""
        settings = ctx.config.index
        if self._index is None:
            from raysim.index import build_index

            options = dict(settings.options)
            if settings.backend == "faiss_ivf":
                options.setdefault("retrain_every", settings.retrain_every)
            # The backend decides where shards live (ctx.index_builder: the Ray backend's puts
            # several shards in actors); by default every shard lives inside the server.
            build = ctx.index_builder or build_index
            self._index = build(
                settings.backend,
                len(classes),
                classes.shape[1],
                shards=settings.shards,
                num_cpus=settings.num_cpus,
                num_gpus=settings.num_gpus,
                **options,
            )
        if self._index_round != round_index:  # new, or the state was restored
            self._index.reset(classes)
        else:
            self._index.update(updated, classes[updated])
        self._index_round = round_index + 1
        return self._index

    def state_restored(self, state: ServerState, ctx: RunContext) -> None:
        self._index_round = -1  # rebuilt from the restored W at the next round

    def shutdown(self) -> None:
        if self._index is not None and hasattr(self._index, "close"):
            self._index.close()
        self._index = None
