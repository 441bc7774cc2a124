"""TopK sparsification of FedAvg's client deltas (Aji & Heafield, "Sparse Communication for
Distributed Gradient Descent", EMNLP 2017; Stich, Cordonnier, Jaggi, "Sparsified SGD with
Memory", NeurIPS 2018), as the FRL paper's sparse-communication baseline.

Round t: every sampled client trains locally exactly like FedAvg and keeps only the k =
round(fraction * d) entries of its delta x_i - x_t with the largest magnitude (at least one),
sent as float32 values plus int32 indices: exactly 8k bytes (the `topk` codec,
raysim.core.codecs.TopK). The server scatters each message into a dense delta (zeros
elsewhere), averages them (`aggregator: weighted_mean` by default) and applies FedAvg's server
optimizer. No error feedback (Stich et al.'s memory would need per-client state); the broadcast
stays dense float32 weights. TopK is FedAvg with this codec: `algorithm: fedavg` with
`codec: {name: topk, fraction: 0.1}` runs the same method.
"""

from __future__ import annotations

from raysim.algorithms.fedavg import DeltaAveraging
from raysim.core.codecs import TopK as TopKCodec
from raysim.core.codecs import num_kept, top_k  # noqa: F401 - the wire format's helpers
from raysim.errors import ConfigError


class TopK(DeltaAveraging):
    default_aggregator = "weighted_mean"

    def __init__(self, *, fraction: float = 0.1) -> None:
        if not 0 < fraction <= 1:
            raise ConfigError(f"'algorithm.fraction' must be in (0, 1], got {fraction}")
        super().__init__(proximal_mu=0.0)
        self.default_codec = TopKCodec(fraction=fraction)
        self.fraction = float(fraction)
