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

import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from raysim.core.algorithm import RunContext
from raysim.core.batched_training import client_sgd, overridden_below_batched_twin, train_batched
from raysim.core.codecs import VectorLayout
from raysim.core.rankcodec import pack, unpack
from raysim.core.state import ClientUpdate, ServerState
from raysim.core.training import (
    check_lr_options,
    fresh_sgd,
    local_training,
    scheduled_lr,
    set_lr,
)
from raysim.errors import ConfigError
from raysim.metrics import evaluate_classifier
from raysim.models.devices import client_device, server_device
from raysim.models.supermask import WEIGHT_INITS, Supernet, cached_supernet, top_k_masks
from raysim.seeds import model_init_seed

# --- the math, as pure functions -----------------------------------------------------------------


_INT32_MAX = 2**31 - 1


def float_order_key(values: torch.Tensor) -> torch.Tensor:
    """int32 keys that compare exactly as the float32 `values` do under numpy's sort: equal
    keys for equal values (-0.0 and 0.0 too), every NaN last and equal to every other NaN.

    A non-negative float's bits, read as an int32, already grow with its value; a negative
    float's bits grow with its magnitude, so its 31 value bits are flipped (the sign bit stays,
    keeping it below every non-negative one). Integer keys let torch's stable sort use its
    radix sort (~9 ms instead of numpy's ~60 ms for 262,144 scores on one thread); a stable sort
    of keys that order as the values do is the same permutation as any stable sort of them."""
    values = values.reshape(-1) + 0.0  # -0.0 + 0.0 is +0.0 (IEEE 754), so both get key 0
    bits = values.view(torch.int32)
    keys = bits ^ ((bits >> 31) & _INT32_MAX)  # >> is arithmetic: all ones for a negative
    nan = torch.isnan(values)
    if bool(nan.any()):  # NaN payloads and signs differ; numpy puts them all last, in order
        keys = torch.where(nan, _INT32_MAX, keys)  # above +inf (0x7F800000)
    return keys


# The numpy dtypes ranking_of sorts with torch (as integer keys); others keep numpy's sort.
_TORCH_SORTED = {np.dtype(t) for t in ("<f4", "int8", "int16", "<i4", "<i8", "uint8")}


def ranking_of(scores: np.ndarray | torch.Tensor) -> np.ndarray:
    """R = argsort(scores), ascending and stable: R[j] is the edge with the j-th lowest score.

    The same permutation as `np.argsort(scores, kind="stable")` (tests/test_frl.py checks ties,
    signed zeros, NaN and infinities); float32 and integer scores sort as integers (radix)."""
    if isinstance(scores, torch.Tensor):
        values = scores.detach().reshape(-1)
    else:
        array = np.asarray(scores).reshape(-1)
        if array.dtype not in _TORCH_SORTED:  # e.g. float64 (never FRL's scores): numpy's sort
            return np.argsort(array, kind="stable").astype(np.int64)
        # native byte order here; a copy only of a read-only array (torch would warn)
        values = torch.from_numpy(np.require(array, requirements="W"))
    if values.dtype == torch.float32:
        keys = float_order_key(values)
    elif values.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        keys = values
        if keys.dtype == torch.int64 and len(keys):
            low, high = int(keys.min()), int(keys.max())
            if -(2**31) <= low and high <= _INT32_MAX:  # vote sums: half the bytes to sort
                keys = keys.to(torch.int32)
    else:
        return np.argsort(values.cpu().numpy(), kind="stable").astype(np.int64)
    return torch.sort(keys, stable=True).indices.cpu().numpy()


def positions_of(ranking: np.ndarray) -> np.ndarray:
    """V = argsort(R) for a permutation R: V[e] is the position of edge e in the ranking."""
    ranking = np.asarray(ranking, dtype=np.int64)
    positions = np.empty_like(ranking)
    positions[ranking] = np.arange(len(ranking), dtype=np.int64)
    return positions


def batched_positions(scores: torch.Tensor, sizes: Sequence[int]) -> np.ndarray:
    """`positions_of(ranking_of(layer))` of every client's layers, concatenated: `scores` is
    [clients, edges] (float32, any device), the result [clients, edges] int64 on the CPU. The
    same stable sort of the same integer keys as `ranking_of`, for all clients at once."""
    count = len(scores)
    positions = []
    for layer in torch.split(scores, list(sizes), dim=1):
        keys = float_order_key(layer).view(count, -1)
        order = torch.sort(keys, dim=1, stable=True).indices
        rank = torch.arange(order.shape[1], device=order.device).expand(count, -1)
        positions.append(torch.empty_like(order).scatter_(1, order, rank))
    return torch.cat(positions, dim=1).cpu().numpy()


def vote(position_sums: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The new global ranking per layer: R_g = argsort(A), A = sum over clients of positions."""
    return [ranking_of(summed) for summed in position_sums]


def split_layers(vector: np.ndarray, sizes: Sequence[int]) -> list[np.ndarray]:
    """Cut a concatenated per-edge vector back into its layers."""
    if len(vector) != sum(sizes):
        raise ValueError(f"vector has {len(vector)} entries, the supernet has {sum(sizes)} edges")
    return np.split(np.asarray(vector), np.cumsum(sizes)[:-1])


class _RoundRankings:
    """A worker's copy of one round's global rankings, unpacked, and the scores they give.

    Every client of a round gets the same payload, so its rankings are unpacked and the
    initial scores reordered once per worker and round; later clients only copy the scores in.
    The packed bytes are kept (a copy) and compared, so a different payload is never mistaken
    for the cached one."""

    def __init__(self, packed: Sequence[np.ndarray], supernet: Supernet) -> None:
        sizes = supernet.layer_sizes
        self.packed = [np.array(p, dtype=np.uint8, copy=True) for p in packed]
        self.rankings = [unpack(p, n, n) for p, n in zip(self.packed, sizes, strict=True)]
        self.scores = supernet.scores_for(self.rankings)

    def matches(self, packed: Sequence[np.ndarray]) -> bool:
        return len(packed) == len(self.packed) and all(
            np.array_equal(np.asarray(a), b) for a, b in zip(packed, self.packed, strict=True)
        )


# One entry per supernet (per process and device), dropped with it.
_ROUND_RANKINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def round_rankings(packed: Sequence[np.ndarray], supernet: Supernet) -> _RoundRankings:
    """The unpacked global rankings of `packed` for `supernet`, cached for the round."""
    cached = _ROUND_RANKINGS.get(supernet)
    if cached is None or not cached.matches(packed):
        cached = _ROUND_RANKINGS[supernet] = _RoundRankings(packed, supernet)
    return cached


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

    def train_locally(
        self,
        supernet: Supernet,
        x: torch.Tensor,
        y: torch.Tensor,
        generator: torch.Generator,
        ctx: RunContext,
        lr: float,
    ) -> float:
        """Edge-popup: E epochs of SGD on the scores only (the model's only parameters), the
        learning rate annealed from `lr` by `lr_schedule` (raysim.core.training.scheduled_lr);
        returns the mean loss.

        The optimizer is in the state of a new one every round, for every client (fresh_sgd:
        momentum buffers cleared, hyperparameters set again), as the reference code builds a
        new SGD per client per round; on the CPU it is a LeanSGD, torch SGD's arithmetic
        without its per-step overhead."""
        clients = ctx.config.clients
        model = supernet.model
        optimizer = fresh_sgd(
            model, lr=lr, momentum=clients.momentum, weight_decay=clients.weight_decay
        )
        steps_per_epoch = -(-len(y) // clients.batch_size)
        schedule, epochs = self.lr_schedule, clients.local_epochs

        def before_step(step: int) -> None:
            rate = scheduled_lr(schedule, lr, step, steps_per_epoch=steps_per_epoch, epochs=epochs)
            set_lr(optimizer, rate)

        return local_training(
            len(y),
            generator,
            batch_size=clients.batch_size,
            epochs=clients.local_epochs,
            loss_fn=lambda batch: nn.functional.cross_entropy(model(x[batch]), y[batch]),
            optimizer=optimizer,
            before_step=before_step,
            device=x.device,
        )

    # --- batched clients (clients.batched; raysim.core.batched_training) ------------------------
    def batching_problem(self, ctx: RunContext) -> str | None:
        """Why this run's clients cannot train batched, or None: the batched twin below
        reproduces `client_update` and `train_locally` as written here. It batches on a GPU
        only (clients.num_gpus)."""
        stale = overridden_below_batched_twin(self, ("client_update", "train_locally"))
        if stale:
            return stale
        if client_device(ctx).type == "cpu":
            # A client's step is arithmetic over every score (the top-k threshold, the SGD
            # step), not launch overhead, and the sequential path finds the threshold in a
            # window around the last one (ThresholdHint) where the batched one selects over all
            # scores: frl_digits, 6 clients, 0.35 s batched vs 0.20 s one at a time.
            return "supermask clients are slower batched than one at a time on a CPU"
        return None

    def batched_client_updates(self, payload: dict, batch, ctx: RunContext) -> list:
        """`client_update` for a chunk of clients at once: every client's scores start from
        the global ranking's and train by edge-popup in one vmapped step for all (each
        layer's top-k mask computed for every client before the step, exactly as
        `top_k_mask`, and passed straight through); then each client's rankings."""
        device = client_device(ctx)
        supernet = self.supernet(ctx, device)
        global_rankings = round_rankings(payload["rankings"], supernet)
        round_index = int(np.asarray(payload["round"]).reshape(-1)[0])
        clients = ctx.config.clients
        start = torch.cat([s.reshape(-1) for s in global_rankings.scores]).cpu().numpy()
        names = [name for name, _ in supernet.model.named_parameters()]  # the layers' scores
        layers = dict(zip(names, supernet.layers, strict=True))

        def masks(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                name.rsplit(".", 1)[0] + ".given_mask" if "." in name else "given_mask": (
                    top_k_masks(params[name], layer.k, layer.mask_by_abs)
                )
                for name, layer in layers.items()
            }

        trained, losses = train_batched(
            supernet.model,
            [start] * len(batch),
            batch,
            lr=clients.lr * self.lr_decay**round_index,
            **client_sgd(clients),
            lr_schedule=self.lr_schedule,
            device=device,
            trainable=names,
            step_inputs=masks,
            as_tensor=True,
        )
        # Every client's rankings in one stable sort per layer on the chunk's device (a CPU
        # sort per client and layer cost more than the GPU's training of the chunk).
        trained_positions = batched_positions(trained, self.layer_sizes(ctx))
        global_positions = None  # only for a client without samples
        if any(len(y) == 0 for y in batch.ys):
            global_positions = np.concatenate([positions_of(r) for r in global_rankings.rankings])
        updates = []
        for i, client_id in enumerate(batch.client_ids):
            # a client without samples votes for the current global ranking
            positions = trained_positions[i] if len(batch.ys[i]) else global_positions
            updates.append(
                ClientUpdate(
                    client_id=client_id,
                    num_samples=len(batch.ys[i]),
                    vector=positions,
                    metrics={"loss": losses[i]},
                )
            )
        return updates

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
        # The task's GPU when clients.num_gpus reserved one, else the CPU (models.devices).
        device = client_device(ctx)
        supernet = self.supernet(ctx, device)
        global_rankings = round_rankings(payload["rankings"], supernet)
        round_index = int(np.asarray(payload["round"]).reshape(-1)[0])
        loss = float("nan")
        if len(y):
            supernet.set_scores(global_rankings.scores)  # = load_rankings(R_g), cached
            lr = ctx.config.clients.lr * self.lr_decay**round_index
            loss = self.train_locally(supernet, x.to(device), y.to(device), generator, ctx, lr)
            rankings = [ranking_of(layer.scores) for layer in supernet.layers]
        else:  # nothing to learn from: vote for the current global ranking
            rankings = global_rankings.rankings
        # Positions of every layer, concatenated; the task bit-packs them (codec 'ranks').
        positions = np.concatenate([positions_of(ranking) for ranking in rankings])
        return ClientUpdate(
            client_id=client_id, num_samples=len(y), vector=positions, metrics={"loss": loss}
        )
