"""The clients' generators derived together (`seeds.client_generators`, numpy's SeedSequence
hash run elementwise over many clients) are each client's own `client_generator`, for any run
seed (one of 2^32 or more takes the one-at-a-time path), round and client ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.seeds import _torch_seed, _torch_seeds, client_generator, client_generators


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5, 2**32 - 1, 2**32, 2**40 + 3])
def test_generators_derived_together_equal_each_clients_own(seed):
    rng = np.random.default_rng(seed % 1000)
    for round_index in (0, 1, 2**32 - 1, int(rng.integers(0, 10**6))):
        ids = np.sort(rng.choice(10**6, size=37, replace=False)).astype(np.int64)
        together = client_generators(seed, round_index, ids)
        for client_id, generator in zip(ids, together, strict=True):
            own = client_generator(seed, round_index, int(client_id))
            assert generator.initial_seed() == own.initial_seed()
            assert torch.equal(
                torch.randperm(50, generator=generator), torch.randperm(50, generator=own)
            )


def test_the_elementwise_hash_is_numpys_seed_sequence_for_every_word_size():
    rng = np.random.default_rng(3)
    for trial in range(200):
        prefix = [
            int(rng.integers(0, 2**32)),
            int(rng.integers(0, 50)),
            int(rng.integers(0, 2**32)),
        ]
        # every last word under 2^32 (the elementwise hash), or some of 2^32 or more
        high = 2**32 if trial % 2 else 2**33
        last = rng.integers(0, high, size=int(rng.integers(0, 60)))  # both sides of 16
        assert _torch_seeds(prefix, last) == [_torch_seed(*prefix, int(w)) for w in last]
    assert client_generators(0, 0, []) == []
