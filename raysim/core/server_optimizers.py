"""Server optimizers applied to the aggregated client delta (FedOpt: Reddi et al., ICLR 2021).

The aggregated delta Delta (mean of client `local - global`) is treated as a pseudo-gradient
step direction: x <- x + lr * direction. With SGD, lr = 1 and momentum = 0 this is FedAvg.
Each optimizer is a pure `step(params, delta, slots) -> (params, slots)` over named numpy
arrays, so its state is checkpointed with the server like everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

Slots = dict[str, np.ndarray]


@dataclass(frozen=True)
class ServerSGD:
    lr: float = 1.0
    momentum: float = 0.0

    def init(self, params: np.ndarray) -> Slots:
        return {"momentum": np.zeros_like(params)} if self.momentum else {}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        if self.momentum:
            velocity = self.momentum * slots["momentum"] + delta
            return (params + self.lr * velocity).astype(np.float32), {"momentum": velocity}
        return (params + self.lr * delta).astype(np.float32), slots


@dataclass(frozen=True)
class ServerAdagrad:
    lr: float = 0.1
    eps: float = 1e-3

    def init(self, params: np.ndarray) -> Slots:
        return {"sum_squares": np.zeros_like(params)}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        sum_squares = slots["sum_squares"] + delta * delta
        new = params + self.lr * delta / (np.sqrt(sum_squares) + self.eps)
        return new.astype(np.float32), {"sum_squares": sum_squares}


@dataclass(frozen=True)
class ServerAdam:
    """FedAdam as in Reddi et al. (no bias correction; eps = tau controls adaptivity)."""

    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    def init(self, params: np.ndarray) -> Slots:
        return {"first_moment": np.zeros_like(params), "second_moment": np.zeros_like(params)}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        first = self.beta1 * slots["first_moment"] + (1 - self.beta1) * delta
        second = self.beta2 * slots["second_moment"] + (1 - self.beta2) * delta * delta
        new = params + self.lr * first / (np.sqrt(second) + self.eps)
        return new.astype(np.float32), {"first_moment": first, "second_moment": second}


def sgd(config) -> ServerSGD:  # config: raysim.config.ServerConfig
    return ServerSGD(lr=config.lr, momentum=config.momentum)


def adagrad(config) -> ServerAdagrad:
    return ServerAdagrad(lr=config.lr, eps=config.eps)


def adam(config) -> ServerAdam:
    return ServerAdam(lr=config.lr, beta1=config.beta1, beta2=config.beta2, eps=config.eps)


# --- how every algorithm keeps its server-optimizer state ------------------------------------
SLOT_PREFIX = "optimizer."


def from_config(config) -> ServerSGD | ServerAdagrad | ServerAdam:  # config: raysim Config
    """The server optimizer the config's `server:` section names."""
    from raysim import registry

    return registry.server_optimizers.build(config.server.optimizer, config.server)


def slot_arrays(slots: Slots) -> dict[str, np.ndarray]:
    """Optimizer slots as named server-state arrays ('optimizer.<slot>'), checkpointed with it."""
    return {SLOT_PREFIX + name: value for name, value in slots.items()}


def slots_of(arrays: dict[str, np.ndarray]) -> Slots:
    """The optimizer slots held in a server state's arrays (inverse of `slot_arrays`)."""
    return {
        name.removeprefix(SLOT_PREFIX): value
        for name, value in arrays.items()
        if name.startswith(SLOT_PREFIX)
    }
