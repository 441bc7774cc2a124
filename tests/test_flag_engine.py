"""FLAG through the engine: label-weighted aggregation and multi-label metrics (the Ray backend
with per-client validation and the client state store: tests/test_client_state.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raysim import config as config_module
from raysim.algorithms.flag import FLAG, label_weights
from raysim.core.loop import run
from raysim.errors import ConfigError

CONFIG = {
    "run": {"seed": 1, "rounds": 3, "checkpoint_every": 0},
    "data": {
        "name": "synthetic_multilabel",
        "num_samples": 300,
        "num_test": 120,
        "num_labels": 6,
        "num_features": 8,
        "num_topics": 3,
    },
    "partition": {"name": "kmodes", "num_clients": 3},
    "clients": {"per_round": 3, "local_epochs": 1, "batch_size": 16, "lr": 0.01},
    "model": {"name": "mlp", "hidden": [8]},
    "algorithm": {"name": "flag", "alpha": 0.3},
    "runtime": {"backend": "local"},
}


def make_config(*overrides):
    return config_module.from_dict(CONFIG, list(overrides))


def test_flag_server_update_uses_the_label_weights():
    """Three hand-made client updates: the new model is sum_c w_c delta_c."""
    from types import SimpleNamespace

    from raysim.core.state import ServerState

    algorithm = FLAG(alpha=0.3)
    ctx = SimpleNamespace(num_classes=4, config=make_config())
    deltas = [np.array([1.0, 0.0]), np.array([0.0, 1.0]), np.array([1.0, 1.0])]
    stats = [(4, 10), (1, 30), (2, 10)]  # (distinct labels, positive labels)
    updates = [np.concatenate([d, s]) for d, s in zip(deltas, stats, strict=True)]
    state = ServerState(0, {"params": np.zeros(2, dtype=np.float32)})
    aggregate = {
        "updates": updates,
        "num_samples": np.array([5.0, 30.0, 5.0]),
        "client_ids": np.array([0, 1, 2]),
    }
    new = algorithm.server_update(state, aggregate, ctx)
    weights = label_weights(np.array([4, 1, 2]) / 4, np.array([10, 30, 10]), 0.3)
    expected = sum(w * d for w, d in zip(weights, deltas, strict=True))
    np.testing.assert_allclose(new.arrays["params"], expected, rtol=1e-6)
    # each client's local model is kept for AmAP
    np.testing.assert_allclose(new.arrays["client_model.1"], deltas[1])


def test_flag_refuses_another_aggregator(tmp_path):
    with pytest.raises(ConfigError, match="aggregator.name' must be auto"):
        run(make_config("aggregator.name=weighted_mean"), tmp_path, progress=False)


def test_flag_run_reports_multilabel_metrics(tmp_path):
    result = run(make_config(), tmp_path, progress=False, tensorboard=False)
    final = result.summary["final"]
    assert {"map", "gmap", "gmap_worst", "amap", "wmap"} <= set(final)
    assert final["gmap"] > 0.5 and final["wmap"] <= final["amap"]
