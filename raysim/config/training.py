"""The sections that say how the model is trained: `clients:` (local training and its
resources), `server:` (the server optimizer), `attack:` (malicious clients), and the plug-in
sections `model:`, `algorithm:`, `aggregator:`, `codec:` (a name plus its options), each with
its own checks. The plug-ins' option values are checked by building them (raysim.config.build)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raysim import registry
from raysim.config.limits import (
    MAX_BATCH_CHUNK,
    MAX_LEARNING_RATE,
    MAX_LOCAL_EPOCHS,
    MAX_TASK_RESOURCES,
    MAX_WEIGHT_DECAY,
    MIN_EPS,
    finite,
    require,
)


@dataclass(frozen=True, kw_only=True)
class ClientsConfig:
    per_round: int = 10
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    per_task: int | str = "auto"  # clients trained one after another inside one Ray task
    num_cpus: float = 1.0  # per client task; torch threads inside the task = max(1, int(num_cpus))
    num_gpus: float = 0.0
    # A client whose training fails (worker crash, injected fault) is retried up to this many
    # times in the same round, then dropped for the round.
    max_retries: int = 3
    # Train a task's clients `batch_chunk` at a time in one vmapped step (torch.func) instead
    # of one after another, for algorithms that opt in (docs/BATCHED.md); the others say so
    # once and train sequentially. Off by default: the sequential path is the reference.
    batched: bool = False
    # Clients per vmapped call: bounds the memory. `auto` sizes it from the device's memory
    # and the model (raysim.core.batch_chunk; docs/BATCHED.md); an integer fixes it.
    batch_chunk: int | str = "auto"

    def check(self, source: str, resolve: bool = True) -> None:
        """`per_round` against `partition.num_clients`: raysim.config.cross_checks."""
        require(source, self.per_round >= 1, "clients.per_round", ">= 1", self.per_round)
        epochs = self.local_epochs
        require(source, epochs >= 1, "clients.local_epochs", ">= 1", epochs)
        require(
            source,
            epochs <= MAX_LOCAL_EPOCHS,
            "clients.local_epochs",
            f"at most {MAX_LOCAL_EPOCHS:,} (epochs of one client in one round)",
            epochs,
        )
        require(source, self.batch_size >= 1, "clients.batch_size", ">= 1", self.batch_size)
        lr = self.lr
        require(source, lr > 0, "clients.lr", "> 0", lr)
        require(source, finite(lr), "clients.lr", "finite", lr)
        require(source, lr <= MAX_LEARNING_RATE, "clients.lr", "in (0, 1e4]", lr)
        require(source, 0 <= self.momentum < 1, "clients.momentum", "in [0, 1)", self.momentum)
        decay = self.weight_decay
        require(source, decay >= 0, "clients.weight_decay", ">= 0", decay)
        require(source, finite(decay), "clients.weight_decay", "finite", decay)
        require(source, decay <= MAX_WEIGHT_DECAY, "clients.weight_decay", "in [0, 1e4]", decay)
        per_task = self.per_task
        require(
            source,
            per_task == "auto" or (isinstance(per_task, int) and per_task >= 1),
            "clients.per_task",
            "'auto' or an integer >= 1",
            per_task,
        )
        require(source, self.num_cpus > 0, "clients.num_cpus", "> 0", self.num_cpus)
        require(source, finite(self.num_cpus), "clients.num_cpus", "finite", self.num_cpus)
        require(source, self.num_gpus >= 0, "clients.num_gpus", ">= 0", self.num_gpus)
        require(source, finite(self.num_gpus), "clients.num_gpus", "finite", self.num_gpus)
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            require(
                source,
                value <= MAX_TASK_RESOURCES,
                f"clients.{key}",
                f"at most {MAX_TASK_RESOURCES:.0f} (one client task runs on one machine)",
                value,
            )
        require(source, self.max_retries >= 0, "clients.max_retries", ">= 0", self.max_retries)
        chunk = self.batch_chunk
        require(
            source,
            chunk == "auto" or (isinstance(chunk, int) and chunk >= 1),
            "clients.batch_chunk",
            "'auto' or an integer >= 1",
            chunk,
        )
        if chunk == "auto":
            return
        # Every chunk holds its clients' parameters a few times over (docs/BATCHED.md); a
        # million clients of even a 10k-parameter model would be 200 GB.
        require(
            source,
            chunk <= MAX_BATCH_CHUNK,
            "clients.batch_chunk",
            f"at most {MAX_BATCH_CHUNK:,}",
            chunk,
        )


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def check(self, source: str, resolve: bool = True) -> None:
        """Nothing beyond the name and options' types, checked when the section is built."""


BENIGN_SETS = ("sampled_and_pool", "pool")


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    """Malicious clients: the lowest `fraction * num_clients` ids run attack `name`."""

    name: str = "none"
    fraction: float = 0.0
    redraw_majority: bool = True  # redraw rounds where >= half the sampled clients are malicious
    # malicious clients the attacker also trains each round (never sent) to estimate benign
    # updates; FRL's code uses 25. 0: only the round's sampled malicious clients.
    pool_size: int = 0
    # Whose honest updates a pool-informed attack (frl_reversal, agr_tailored) averages:
    # `sampled_and_pool`: the round's sampled malicious clients and the pool; `pool`: the
    # pool's draw only (its members sampled this round included), as the FRL reference code
    # (FL_train.py averages the rand_mal_clients pool alone). Attacks that change their own
    # update (naive_scaling, sign_flip) read only their own.
    benign_set: str = "sampled_and_pool"
    options: Mapping[str, Any] = field(default_factory=dict)

    def check(self, source: str, resolve: bool = True) -> None:
        """Whether an honest majority can be drawn: raysim.config.cross_checks."""
        require(source, 0 <= self.fraction < 1, "attack.fraction", "in [0, 1)", self.fraction)
        require(source, self.pool_size >= 0, "attack.pool_size", ">= 0", self.pool_size)
        require(
            source,
            self.benign_set in BENIGN_SETS,
            "attack.benign_set",
            " or ".join(repr(name) for name in BENIGN_SETS),
            self.benign_set,
        )
        if self.benign_set == "pool" and self.name != "none":
            require(
                source,
                self.pool_size > 0,
                "attack.pool_size",
                "> 0 with attack.benign_set 'pool' (the pool is the attacker's only benign set)",
                self.pool_size,
            )


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Server optimizer applied to the aggregated client delta (FedOpt, Reddi et al. 2021).

    optimizer 'sgd' with lr 1 and momentum 0 is plain FedAvg.
    """

    optimizer: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    # An update whose norm is more than this many times the model's (at least 1) is refused:
    # for algorithms whose updates are deltas of the model (`update_delta_of`). Honest deltas
    # are far smaller; a finite 3e38 or 1e20 would wreck the model or Adam's moments. 0: off.
    max_update_ratio: float = 1000.0
    # GPUs of the server (on Ray, reserved for the server actor): evaluation and the
    # algorithm's server-side tensor work (FedAwS: exact index search, spreadout) run there.
    # 0: the CPU. Without a GPU in the cluster the server runs on the CPU, with a notice.
    num_gpus: float = 0.0

    def check(self, source: str, resolve: bool = True) -> None:
        ratio = self.max_update_ratio
        require(source, ratio >= 0 and finite(ratio), "server.max_update_ratio", ">= 0", ratio)
        gpus = self.num_gpus
        require(source, gpus >= 0 and finite(gpus), "server.num_gpus", ">= 0", gpus)
        require(
            source,
            gpus <= MAX_TASK_RESOURCES,
            "server.num_gpus",
            f"at most {MAX_TASK_RESOURCES:.0f} (the server runs on one machine)",
            gpus,
        )
        if resolve:
            registry.server_optimizers.get(self.optimizer)  # unknown name: lists the choices
        lr = self.lr
        require(source, lr > 0, "server.lr", "> 0", lr)
        require(source, finite(lr), "server.lr", "finite", lr)
        require(source, lr <= MAX_LEARNING_RATE, "server.lr", "in (0, 1e4]", lr)
        require(source, 0 <= self.momentum < 1, "server.momentum", "in [0, 1)", self.momentum)
        require(source, 0 <= self.beta1 < 1, "server.beta1", "in [0, 1)", self.beta1)
        require(source, 0 <= self.beta2 < 1, "server.beta2", "in [0, 1)", self.beta2)
        eps = self.eps
        require(source, eps > 0, "server.eps", "> 0", eps)
        require(source, finite(eps), "server.eps", "finite", eps)
        require(source, eps >= MIN_EPS, "server.eps", ">= 1e-30 (and finite)", eps)
