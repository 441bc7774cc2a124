"""FRL: Federated Rank Learning (Mozaffari, Shejwalkar, Houmansadr; USENIX Security 2023,
arXiv 2110.04350).

Clients never train weights. Everyone regenerates the same random supernetwork (fixed weights w,
initial scores s0) from the run seed, and the federation learns which edges to keep: a global
ranking R_g of each layer's edges, the top-k fraction of which form the subnetwork.

Round t, per layer (everything is per layer):
    server -> client   R_g (bit-packed: ceil(log2 n_l) bits per entry)
    client             s[R_g[j]] = sort(s0)[j]                      (scores reordered by R_g)
                       E epochs of edge-popup on its data: SGD on s only (momentum, weight decay),
                       lr = clients.lr * lr_decay**t, annealed by `lr_schedule` (default
                       cosine over the round's steps; `cosine_epochs`: the reference code's
                       CosineAnnealingLR over the E epochs); a fresh optimizer every round;
                       forward uses w * m, m = 1 for the top-k scores, straight-through backward
                       R_u = argsort(s)                                 (ascending, stable)
    client -> server   V_u = argsort(R_u)   (each edge's position in R_u; bit-packed)
    server             A = sum_u V_u (the vote, exact int64 sum),  R_g <- argsort(A) (stable)

Only bit-packed rankings travel. The weights and initial scores are never sent: every
participant regenerates them from the seed in the config it already has (one supernet per
worker process, cached). The round number travels with the rankings (8 bytes) because the
learning-rate decay depends on it.

Cost (benchmarks/frl_floor.py measures a round against plain torch doing the same arithmetic):
rankings are stable sorts of int32 keys that order exactly as the float32 scores do (torch's
radix sort, ~6x numpy's float argsort), and a worker unpacks the round's global rankings and
reorders the scores once, for all its clients of the round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from raysim.algorithms.frl_ranking import (  # noqa: F401 - the ranking math, re-exported
    batched_positions,
    float_order_key,
    positions_of,
    ranking_of,
    round_rankings,
    split_layers,
    vote,
)
from raysim.core.algorithm import RunContext
from raysim.core.client_step import ClientChunk, ClientStep, DescribedClient, TrainedClients
from raysim.core.codecs import VectorLayout
from raysim.core.rankcodec import pack
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import check_lr_options
from raysim.errors import ConfigError
from raysim.losses import cross_entropy_rows
from raysim.metrics import evaluate_classifier
from raysim.models.devices import client_device, server_device
from raysim.models.supermask import WEIGHT_INITS, Supernet, cached_supernet, top_k_masks
from raysim.seeds import model_init_seed

# --- the plug-in ---------------------------------------------------------------------------------


class FRL(DescribedClient):
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
        lr_schedule: str = "cosine_steps",
    ) -> None:
        if not 0 < k <= 1:
            raise ConfigError(f"'algorithm.k' must be in (0, 1] (fraction of edges kept), got {k}")
        check_lr_options(lr_decay, lr_schedule)
        if weight_init not in WEIGHT_INITS:
            raise ConfigError(
                f"unknown 'algorithm.weight_init' {weight_init!r}; "
                f"choices: {', '.join(WEIGHT_INITS)}"
            )
        self.k = float(k)
        self.mask_by_abs = bool(mask_by_abs)
        self.weight_init = weight_init
        self.lr_decay = float(lr_decay)
        self.lr_schedule = lr_schedule

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
    ) -> tuple[ServerState, dict[str, float]]:
        rankings = vote(split_layers(aggregate, self.layer_sizes(ctx)))
        return self._state(state.round + 1, rankings), {}

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

    # --- the client, described once (raysim.core.client_step) ---------------------------------
    def client_step(self, payload: dict, ctx: RunContext) -> ClientStep:
        """Edge-popup: E epochs of SGD on the scores only (the supernet's only parameters;
        its weights are shared), the learning rate clients.lr * lr_decay^round annealed by
        `lr_schedule` (raysim.core.training.scheduled_lr), momentum and weight decay on the
        scores; a fresh optimizer every round, for every client, as the reference code builds
        a new SGD per client per round. One client at a time the supernet computes each
        layer's top-k mask itself (with its threshold hint); vmapped, every client's masks
        are computed before the step, exactly as `top_k_mask`, and passed straight through."""
        clients = ctx.config.clients
        supernet = self.supernet(ctx, client_device(ctx))
        names = tuple(name for name, _ in supernet.model.named_parameters())  # the scores
        layers = dict(zip(names, supernet.layers, strict=True))

        def masks(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                name.rsplit(".", 1)[0] + ".given_mask" if "." in name else "given_mask": (
                    top_k_masks(params[name], layer.k, layer.mask_by_abs)
                )
                for name, layer in layers.items()
            }

        round_index = int(np.asarray(payload["round"]).reshape(-1)[0])
        return ClientStep.of(
            clients,
            model=supernet.model,
            loss=nn.functional.cross_entropy,
            row_loss=cross_entropy_rows,  # the loss of each row alone, in one call
            lr=clients.lr * self.lr_decay**round_index,
            lr_schedule=self.lr_schedule,
            trainable=names,
            step_inputs=masks,
            as_tensor=True,
        )

    def client_start(self, payload: dict, client_id: int, ctx: RunContext) -> torch.Tensor:
        """s[R_g[j]] = sort(s0)[j]: the scores the global rankings give (every layer's,
        concatenated; unpacked and reordered once per worker and round)."""
        supernet = self.supernet(ctx, client_device(ctx))
        return round_rankings(payload["rankings"], supernet).flat_scores

    def client_chunk(self, payload, step, client_ids, xs, personal, ctx) -> ClientChunk:
        """Every client of a round starts from the same scores, the global ranking's
        (`client_start` ignores the client): one start for the chunk, shared by all (one
        lookup of the round's scores, not one a client: ~36 us each, 1,000 clients a round)."""
        start = self.client_start(payload, client_ids[0], ctx) if client_ids else None
        count = len(client_ids)
        return ClientChunk(step, tuple(xs), (start,) * count, (None,) * count)

    def client_messages(self, payload: dict, trained: TrainedClients, ctx: RunContext) -> list:
        """V_u = argsort(argsort(s)) per layer, concatenated (the task bit-packs them, codec
        'ranks'): every client's in one stable sort per layer on the step's device. A client
        without samples has nothing to learn from and votes for the current global ranking."""
        positions = batched_positions(trained.trained, self.layer_sizes(ctx))
        global_positions = None
        if any(len(y) == 0 for y in trained.ys):
            supernet = self.supernet(ctx, client_device(ctx))
            global_rankings = round_rankings(payload["rankings"], supernet).rankings
            global_positions = np.concatenate([positions_of(r) for r in global_rankings])
        return [
            ClientUpdate(
                client_id=client_id,
                num_samples=len(trained.ys[i]),
                vector=positions[i] if len(trained.ys[i]) else global_positions,
                metrics={"loss": trained.losses[i]},
            )
            for i, client_id in enumerate(trained.client_ids)
        ]

    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this run's clients cannot train vmapped, or None: they batch on a GPU only."""
        if client_device(ctx).type == "cpu":
            # A client's step is arithmetic over every score (the top-k threshold, the SGD
            # step), not launch overhead, and the sequential path finds the threshold in a
            # window around the last one (ThresholdHint) where the batched one selects over all
            # scores: frl_digits, 6 clients, 0.35 s batched vs 0.20 s one at a time.
            return "supermask clients are slower batched than one at a time on a CPU"
        return None
