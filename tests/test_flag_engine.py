"""FLAG through the engine: label-weighted aggregation and multi-label metrics (the Ray backend
with per-client validation and the client state store: tests/test_client_state.py)."""

from __future__ import annotations

import numpy as np
import pytest

from raysim import config as config_module
from raysim.algorithms.flag import FLAG, label_weights
from raysim.assembly import run
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


def test_flag_aggregator_uses_the_declared_label_weights():
    """Three hand-made client contributions: the new model is sum_c w_c delta_c, and each
    client's local model is kept for AmAP."""
    from types import SimpleNamespace

    from raysim.core.state import Contribution, ServerState

    algorithm = FLAG(alpha=0.3)
    ctx = SimpleNamespace(num_classes=4, config=make_config())
    deltas = [np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)]
    deltas.append(np.array([1.0, 1.0], np.float32))
    stats = [(4, 10), (1, 30), (2, 10)]  # (distinct labels, positive labels)
    contributions = [
        Contribution(c, d, n, {"label_wideness": s[0] / 4, "positive_labels": s[1]})
        for c, (d, s, n) in enumerate(zip(deltas, stats, (5, 30, 5), strict=True))
    ]
    aggregate = algorithm.default_aggregator.aggregate(contributions)
    state = ServerState(0, {"params": np.zeros(2, dtype=np.float32)})
    new, diagnostics = algorithm.server_update(state, aggregate, ctx)
    assert diagnostics == {}
    weights = label_weights(np.array([4, 1, 2]) / 4, np.array([10, 30, 10]), 0.3)
    expected = sum(w * d for w, d in zip(weights, deltas, strict=True))
    np.testing.assert_allclose(new.arrays["params"], expected, rtol=1e-6)
    new = algorithm.observe_contributions(state, new, contributions, ctx)
    np.testing.assert_allclose(new.arrays["client_model.1"], deltas[1])


def test_flag_refuses_an_aggregator_that_ignores_its_weights(tmp_path):
    with pytest.raises(ConfigError, match="FLAG weights clients by their declared label"):
        run(make_config("aggregator.name=trimmed_mean"), tmp_path, progress=False)


def test_multilabel_fedavg_composes_with_a_robust_aggregator(tmp_path):
    """The samples-weighted variant needs no statistics: trimmed mean applies as is, and the
    reported update norm is that of the deltas (no label counts inside the vector)."""
    config = make_config(
        "algorithm.name=multilabel_fedavg", "aggregator.name=trimmed_mean", "aggregator.beta=1"
    )
    result = run(config, tmp_path, progress=False, tensorboard=False)
    assert result.summary["rounds"] == 3
    records = (tmp_path / "metrics.jsonl").read_text().splitlines()
    import json

    norms = [json.loads(line)["update_norm_mean"] for line in records]
    assert all(0 < n < 50 for n in norms), norms


def test_flag_run_reports_multilabel_metrics(tmp_path):
    result = run(make_config(), tmp_path, progress=False, tensorboard=False)
    final = result.summary["final"]
    assert {"map", "gmap", "gmap_worst", "amap", "wmap"} <= set(final)
    assert final["gmap"] > 0.5 and final["wmap"] <= final["amap"]
