"""FRL: Federated Rank Learning (Mozaffari, Shejwalkar, Houmansadr; USENIX Security 2023,
arXiv 2110.04350).

Clients never train weights. Everyone regenerates the same random supernetwork (fixed weights w,
initial scores s0) from the run seed, and the federation learns which edges to keep: a global
ranking R_g of each layer's edges, the top-k fraction of which form the subnetwork.

Round t, per layer (everything is per layer):
    server -> client   R_g (bit-packed: ceil(log2 n_l) bits per entry)
    client             s[R_g[j]] = sort(s0)[j]                      (scores reordered by R_g)
                       E epochs of edge-popup on its data: SGD on s only (momentum, weight decay),
                       lr = clients.lr * lr_decay**t, cosine-annealed over the round's steps;
                       forward uses w * m, m = 1 for the top-k scores, straight-through backward
                       R_u = argsort(s)                                 (ascending, stable)
    client -> server   V_u = argsort(R_u)   (each edge's position in R_u; bit-packed)
    server             A = sum_u V_u (the vote, exact int64 sum),  R_g <- argsort(A) (stable)

Only bit-packed rankings travel. The weights and initial scores are never sent: every
participant regenerates them from the seed in the config it already has (one supernet per
worker process, cached). The round number travels with the rankings (8 bytes) because the
learning-rate decay depends on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from raysim.core.algorithm import RunContext
from raysim.core.codecs import VectorLayout
from raysim.core.rankcodec import pack, unpack
from raysim.core.sampling import model_init_seed
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import local_training, set_lr
from raysim.errors import ConfigError
from raysim.metrics import evaluate_classifier
from raysim.models.supermask import WEIGHT_INITS, Supernet, cached_supernet
from raysim.runtime.devices import client_device, server_device, to_numpy

# --- the math, as pure functions -----------------------------------------------------------------


def ranking_of(scores: np.ndarray) -> np.ndarray:
    """R = argsort(scores), ascending and stable: R[j] is the edge with the j-th lowest score."""
    return np.argsort(np.asarray(scores).reshape(-1), kind="stable").astype(np.int64)


def positions_of(ranking: np.ndarray) -> np.ndarray:
    """V = argsort(R) for a permutation R: V[e] is the position of edge e in the ranking."""
    ranking = np.asarray(ranking, dtype=np.int64)
    positions = np.empty_like(ranking)
    positions[ranking] = np.arange(len(ranking), dtype=np.int64)
    return positions


def vote(position_sums: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The new global ranking per layer: R_g = argsort(A), A = sum over clients of positions."""
    return [ranking_of(summed) for summed in position_sums]


def split_layers(vector: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Cut a concatenated per-edge vector back into its layers."""
    if len(vector) != sum(sizes):
        raise ValueError(f"vector has {len(vector)} entries, the supernet has {sum(sizes)} edges")
    return np.split(np.asarray(vector), np.cumsum(sizes)[:-1])


def cosine_lr(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine annealing within one round: base_lr at step 0, towards 0 at the last step."""
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * step / max(1, total_steps)))


# --- the plug-in ---------------------------------------------------------------------------------


class FRL:
    """Federated Rank Learning; aggregate with `sum` (the vote), the default."""

    labels = "single"  # one class per sample (checked when a run starts)

    default_aggregator = "sum"
    default_codec = "ranks"
    configurable_codec = False  # rank positions only make sense bit-packed as ranks

    def __init__(
        self,
        *,
        k: float = 0.5,
        mask_by_abs: bool = False,
        weight_init: str = "signed_kaiming_constant",
        lr_decay: float = 0.999,
    ) -> None:
        if not 0 < k <= 1:
            raise ConfigError(f"'algorithm.k' must be in (0, 1] (fraction of edges kept), got {k}")
        if not 0 < lr_decay <= 1:
            raise ConfigError(f"'algorithm.lr_decay' must be in (0, 1], got {lr_decay}")
        if weight_init not in WEIGHT_INITS:
            raise ConfigError(
                f"unknown 'algorithm.weight_init' {weight_init!r}; "
                f"choices: {', '.join(WEIGHT_INITS)}"
            )
        self.k = float(k)
        self.mask_by_abs = bool(mask_by_abs)
        self.weight_init = weight_init
        self.lr_decay = float(lr_decay)

    # --- the supernetwork, regenerated from the seed once per process ---------------------------
    def supernet(self, ctx: RunContext, device: torch.device | None = None) -> Supernet:
        """The run's supernet in this process, on `device` (None: the CPU)."""
        model = ctx.config.model
        return cached_supernet(
            model.name,
            ctx.input_shape,
            ctx.num_classes,
            model_init_seed(ctx.seed),
            k=self.k,
            mask_by_abs=self.mask_by_abs,
            weight_init=self.weight_init,
            device=device,
            **model.options,
        )

    def layer_sizes(self, ctx: RunContext) -> list[int]:
        """Edges per supermask layer, in the order of rankings, positions and decoded vectors."""
        return list(self.supernet(ctx).layer_sizes)

    @staticmethod
    def rankings(state: ServerState) -> list[np.ndarray]:
        count = sum(1 for name in state.arrays if name.startswith("ranking."))
        return [state.arrays[f"ranking.{i}"] for i in range(count)]

    @staticmethod
    def _state(round_index: int, rankings: Sequence[np.ndarray]) -> ServerState:
        return ServerState(round_index, {f"ranking.{i}": r for i, r in enumerate(rankings)})

    # --- server --------------------------------------------------------------------------------
    def init_server(self, ctx: RunContext) -> ServerState:
        """R_g of round 0 = argsort(s0) per layer, so the first reordering gives s = s0."""
        return self._state(0, self.supernet(ctx).initial_rankings())

    def server_payload(self, state: ServerState) -> dict:
        return {
            "round": np.array([state.round], dtype=np.int64),
            "rankings": [pack(ranking, len(ranking)) for ranking in self.rankings(state)],
        }

    def update_layout(self, ctx: RunContext) -> VectorLayout:
        """Rank positions of every layer in one int64 vector (layer order); the `ranks` codec
        bit-packs each layer (ceil(log2 n_l) bits an entry) and checks it is a permutation."""
        sizes = tuple(int(n) for n in self.layer_sizes(ctx))
        return VectorLayout(sum(sizes), np.dtype(np.int64), sizes)

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> ServerState:
        return self._state(state.round + 1, vote(split_layers(aggregate, self.layer_sizes(ctx))))

    def model_of(self, state: ServerState, ctx: RunContext) -> nn.Module:
        """The global subnetwork: the seed's supernet masked by the voted rankings."""
        supernet = self.supernet(ctx)
        supernet.load_rankings(self.rankings(state))
        return supernet.model

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]:
        supernet = self.supernet(ctx, server_device(ctx))  # the server's GPU when it has one
        supernet.load_rankings(self.rankings(state))
        return evaluate_classifier(supernet.model, x, y)

    def train_locally(
        self,
        supernet: Supernet,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        ctx: RunContext,
        lr: float,
    ) -> float:
        """Edge-popup: E epochs of SGD on the scores only, the learning rate cosine-annealed
        from `lr` over the round's steps (raysim.core.training); returns the mean loss."""
        clients = ctx.config.clients
        scores = [layer.scores for layer in supernet.layers]
        optimizer = torch.optim.SGD(
            scores, lr=lr, momentum=clients.momentum, weight_decay=clients.weight_decay
        )
        total_steps = clients.local_epochs * math.ceil(len(y) / clients.batch_size)
        model = supernet.model
        return local_training(
            len(y),
            generator,
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            loss_fn=lambda batch: nn.functional.cross_entropy(model(x[batch]), y[batch]),
            optimizer=optimizer,
            before_step=lambda step: set_lr(optimizer, cosine_lr(lr, step, total_steps)),
            device=x.device,
        )

    # --- client --------------------------------------------------------------------------------
    def client_update(
        self,
        payload: dict,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        # The task's GPU when clients.num_gpus reserved one, else the CPU (runtime.devices).
        device = client_device(ctx)
        supernet = self.supernet(ctx, device)
        sizes = supernet.layer_sizes
        global_rankings = [
            unpack(packed, n, n) for packed, n in zip(payload["rankings"], sizes, strict=True)
        ]
        round_index = int(np.asarray(payload["round"]).reshape(-1)[0])
        loss = float("nan")
        if len(y):
            supernet.load_rankings(global_rankings)
            lr = ctx.config.clients.lr * self.lr_decay**round_index
            loss = self.train_locally(supernet, x.to(device), y.to(device), generator, ctx, lr)
            rankings = [ranking_of(to_numpy(layer.scores)) for layer in supernet.layers]
        else:  # nothing to learn from: vote for the current global ranking
            rankings = global_rankings
        # Positions of every layer, concatenated; the task bit-packs them (codec 'ranks').
        message = np.concatenate([positions_of(ranking) for ranking in rankings])
        return ClientUpdate(
            client_id=client_id, num_samples=len(y), message=message, metrics={"loss": loss}
        )
