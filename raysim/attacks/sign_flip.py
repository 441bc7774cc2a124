"""Sign flipping against SignSGD with majority vote.

Each malicious client sends the negation of its honest signs, voting against what its own data
says: the adversary Bernstein et al. ("signSGD with Majority Vote is Communication Efficient and
Fault Tolerant", ICLR 2019) analyse, and the FRL paper's attack on its SignSGD baseline. Works
on any decoded update (it negates the vector), but is meant for `algorithm: signsgd`.
"""

from __future__ import annotations

import numpy as np


class SignFlip:
    def craft(self, honest, info, aggregator, algorithm, ctx) -> list[np.ndarray]:
        return [np.negative(vector) for vector in honest[: info.num_malicious]]  # own signs only
