"""SignSGD with majority vote (Bernstein, Wang, Azizzadenesheli, Anandkumar: "signSGD: Compressed
Optimisation for Non-Convex Problems", ICML 2018; "signSGD with Majority Vote is Communication
Efficient and Fault Tolerant", ICLR 2019), as the FRL paper's 1-bit baseline.

Round t: every sampled client trains locally exactly like FedAvg (E epochs of minibatch SGD
from the global weights x_t) and sends only the sign of its delta, sign(x_i - x_t): one bit per
parameter on the wire (np.packbits; ceil(d / 8) bytes; a zero delta is sent as +1 since one
bit has no room for 0). The server sums the signs (`aggregator: sum`, exact in int64) and
steps along the majority:

    x_{t+1} = x_t + server_lr * sign(sum_i sign_i)        (a tie, sum = 0, gives 0)

Every coordinate moves by exactly `server_lr` (or not at all), whatever the magnitude of the
clients' deltas, so `server_lr` plays the role of signSGD's learning rate. Default 0.01: the
MLP on digits has weights of order 0.1 (Kaiming bounds 1/sqrt(fan_in)), and a step of 0.01
moves them by a tenth of that. Measured on configs/signsgd_digits.yaml (30 rounds, seeds 0-2):
0.001 -> 0.75-0.80 and 0.002 -> 0.84-0.88 (too slow), 0.01 -> 0.94-0.96, 0.02 -> 0.97 but
noisier later, 0.05 -> 0.90-0.92 and 0.1 -> 0.83-0.88 (oscillating).
The broadcast stays dense float32 weights (as in FedAvg). The `server:` optimizer is not used,
so its settings must stay at their defaults (checked when the run starts).
"""

from __future__ import annotations

import numpy as np

from raysim.algorithms.fedavg import DeltaAveraging
from raysim.core.algorithm import RunContext
from raysim.core.codecs import pack_signs, unpack_signs  # noqa: F401 - the wire format
from raysim.core.state import ServerState
from raysim.errors import ConfigError
from raysim.models.vector import build_model, cached_model, get_vector, vector_size


def majority_vote(signs: list[np.ndarray]) -> np.ndarray:
    """sign(sum of the clients' signs), int8; 0 where the vote is tied."""
    return np.sign(np.sum(np.stack(signs).astype(np.int64), axis=0)).astype(np.int8)


def num_params(ctx: RunContext) -> int:
    return vector_size(cached_model(ctx))


class SignSGD(DeltaAveraging):
    default_aggregator = "sum"
    default_codec = "signs"  # one bit per parameter (raysim.core.codecs.Signs)

    def __init__(self, *, server_lr: float = 0.01) -> None:
        if not server_lr > 0:
            raise ConfigError(f"'algorithm.server_lr' must be > 0, got {server_lr}")
        super().__init__(proximal_mu=0.0)
        self.server_lr = float(server_lr)

    def init_server(self, ctx: RunContext) -> ServerState:
        server = ctx.config.server
        if (server.optimizer, server.lr, server.momentum) != ("sgd", 1.0, 0.0):
            raise ConfigError(
                "algorithm 'signsgd' steps by algorithm.server_lr * sign(vote) itself; leave "
                "server.optimizer/lr/momentum at sgd/1.0/0.0 (got "
                f"{server.optimizer}/{server.lr}/{server.momentum})"
            )
        return ServerState(0, {"params": get_vector(build_model(ctx))})

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> tuple[ServerState, dict[str, float]]:
        # sign() of any aggregate of the signs: the int64 vote count of `sum`, or a (weighted)
        # mean or median when another aggregator is configured.
        step = self.server_lr * np.sign(aggregate)
        params = (state.arrays["params"] + step).astype(np.float32)
        return ServerState(state.round + 1, {"params": params}), {}
