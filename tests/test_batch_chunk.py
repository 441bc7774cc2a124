"""`clients.batch_chunk: auto`: the clients of one vmapped call sized from the device's memory
and the model, capped at a round's clients (raysim.core.batch_chunk)."""

from __future__ import annotations

import pytest
import torch

from raysim import config as config_module
from raysim.core import batch_chunk
from raysim.errors import ConfigError
from raysim.models.embedding import XMLEmbeddingBag


def _config(**clients):
    return config_module.from_dict(
        {"data": {"name": "digits"}, "partition": {"num_clients": 1000}, "clients": clients}
    )


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_auto_is_capped_at_a_round_and_bounded_by_memory(monkeypatch):
    cpu = torch.device("cpu")
    model = _mlp()
    per_client = batch_chunk.client_bytes(model, (64,), 16, 20)
    parameters = 64 * 128 + 128 + 128 * 10 + 10
    # parameters 40 bytes each, plus 3 copies of the batch's activations and inputs
    assert per_client == 40 * parameters + 4 * 3 * 16 * (128 + 128 + 10 + 64)
    config = _config(per_round=1000, batched=True)
    monkeypatch.setattr(batch_chunk, "memory_budget", lambda config, device: 10**12)
    assert batch_chunk.chunk_clients(config, cpu, model, (64,), 16, 20) == 1000  # a round
    monkeypatch.setattr(batch_chunk, "memory_budget", lambda config, device: 7 * per_client + 1)
    assert batch_chunk.chunk_clients(config, cpu, model, (64,), 16, 20) == 7  # memory
    monkeypatch.setattr(batch_chunk, "memory_budget", lambda config, device: 1)
    assert batch_chunk.chunk_clients(config, cpu, model, (64,), 16, 20) == 1  # at least one
    # an integer is kept as it is
    fixed = _config(per_round=1000, batched=True, batch_chunk=3)
    assert batch_chunk.chunk_clients(fixed, cpu, model, (64,), 16, 20) == 3


def test_an_embedding_table_counts_the_rows_a_client_can_touch():
    bag = XMLEmbeddingBag(100_000, 16, 32, [32], sparse_gradients=False)
    dense = sum(p.numel() for name, p in bag.named_parameters() if not name.startswith("bag."))
    # 5 samples of 8 feature ids: at most 40 rows of 32, not the table's 100,001; each of the
    # 5 padded batch rows gathers 8 rows of 32 to pool its bag
    estimate = batch_chunk.client_bytes(bag, (8,), 5, 5)
    activations = batch_chunk.activation_values(bag, (8,))
    assert estimate == 40 * (dense + 40 * 32) + 4 * 3 * 5 * (activations + 8 + 8 * 32)


def test_the_config_takes_auto_or_a_positive_integer():
    assert config_module.ClientsConfig().batch_chunk == "auto"
    for bad in (0, "big", -2):
        with pytest.raises(ConfigError, match="clients.batch_chunk"):
            _config(batch_chunk=bad)
