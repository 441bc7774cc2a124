"""The explicit client state store: personal layers persist across rounds, are checkpointed
with the server, and give the same results on the local and Ray backends."""

from __future__ import annotations

import numpy as np
import pytest

from raysim import config as config_module
from raysim.assembly import run
from raysim.runtime.client_state import PREFIX, InProcessClientState

CONFIG = {
    "run": {"seed": 3, "rounds": 4, "checkpoint_every": 2, "keep_checkpoints": 3},
    "data": {
        "name": "synthetic_multilabel",
        "num_samples": 240,
        "num_test": 80,
        "num_labels": 6,
        "num_features": 8,
        "num_topics": 3,
    },
    "partition": {"name": "kmodes", "num_clients": 4},
    "clients": {"per_round": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.01},
    "model": {"name": "mlp", "hidden": [8]},
    "algorithm": {"name": "personal_classifier"},
    "runtime": {"backend": "local"},
}


def make_config(**overrides):
    return config_module.from_dict(CONFIG, [f"{k}={v}" for k, v in overrides.items()])


def store_of(state):
    return {k: v for k, v in state.arrays.items() if k.startswith(PREFIX)}


def test_in_process_store_round_trips_a_snapshot():
    store = InProcessClientState()
    store.put(2, {"personal": np.arange(3, dtype=np.float32)})
    assert store.get(5) is None
    copy = InProcessClientState()
    copy.restore(store.snapshot())
    np.testing.assert_array_equal(copy.get(2)["personal"], [0, 1, 2])
    with pytest.raises(ValueError):
        store.put(1, {"a/b": np.zeros(1)})


def test_personal_layer_is_kept_across_rounds_and_never_averaged(tmp_path):
    from raysim.seeds import sample_clients

    one = run(make_config(**{"run.rounds": 1}), tmp_path / "one", progress=False, tensorboard=False)
    four = run(make_config(), tmp_path / "four", progress=False, tensorboard=False)
    after_one, after_four = store_of(one.state), store_of(four.state)
    sampled = [set(sample_clients(3, r, 4, 2).tolist()) for r in range(4)]
    first = sampled[0]
    assert {int(k.split("/")[1]) for k in after_one} == first
    for client in first:
        key = f"{PREFIX}{client}/personal"
        if any(client in s for s in sampled[1:]):  # trained again: it moved on from its layer
            assert not np.array_equal(after_one[key], after_four[key])
        else:  # never sampled again: its personal layer is exactly what it left
            np.testing.assert_array_equal(after_one[key], after_four[key])
    # The classifier is personal: the global copy of it stays at its initial value.
    classifier = slice(-(8 * 6 + 6), None)
    initial = run(
        make_config(**{"run.rounds": 1, "clients.per_round": 1}),
        tmp_path / "x",
        progress=False,
        tensorboard=False,
    ).state.arrays["params"]
    np.testing.assert_array_equal(four.state.arrays["params"][classifier], initial[classifier])
    assert not np.array_equal(four.state.arrays["params"][:-54], initial[:-54])
    final = four.summary["final"]
    assert {"amap", "wmap"} <= set(final) and "gmap" not in final  # global classifier untrained


def test_store_survives_checkpoint_and_resume(tmp_path):
    config = make_config()
    full = run(config, tmp_path / "run", progress=False, tensorboard=False)
    (tmp_path / "run" / "checkpoints" / "round_000004.npz").unlink()
    resumed = run(
        config, tmp_path / "run", progress=False, tensorboard=False, resume_from_checkpoint=True
    )
    assert resumed.summary["resumed_from_round"] == 2
    assert set(full.state.arrays) == set(resumed.state.arrays)
    assert store_of(full.state)  # the checkpoint holds the store
    for key, value in full.state.arrays.items():
        np.testing.assert_array_equal(value, resumed.state.arrays[key], err_msg=key)


@pytest.mark.ray
def test_ray_backend_store_matches_local(tmp_path, ray_session):
    local = run(make_config(), tmp_path / "local", progress=False, tensorboard=False)
    remote = run(
        make_config(**{"runtime.backend": "ray"}),
        tmp_path / "ray",
        progress=False,
        tensorboard=False,
    )
    assert local.summary["final"] == remote.summary["final"]  # AmAP/WmAP on validation rows
    assert set(local.state.arrays) == set(remote.state.arrays)
    for key, value in local.state.arrays.items():
        np.testing.assert_array_equal(value, remote.state.arrays[key], err_msg=key)


def test_a_backend_without_a_store_is_refused_for_a_method_that_keeps_client_state(tmp_path):
    """A backend brings the client-state store (RuntimeAttachments.client_state); a plug-in
    that brings none, for a method that keeps per-client state, is refused in one line when
    the server is built, before any round trains (not an AttributeError inside a client)."""
    from raysim import registry
    from raysim.core.backend import RuntimeAttachments
    from raysim.errors import ConfigError
    from raysim.runtime.local import LocalBackend

    original_start = vars(LocalBackend)["start"].__func__

    class BringsNothing(LocalBackend):
        @classmethod
        def start(cls, config, address, prepare):
            def without_store(dataset, attachments):
                return prepare(dataset, RuntimeAttachments())

            return original_start(cls, config, address, without_store)

    registry.backends.register("no_store_test", BringsNothing)
    try:
        with pytest.raises(ConfigError) as caught:
            run(
                make_config(**{"runtime.backend": "no_store_test"}),
                tmp_path / "out",
                progress=False,
                tensorboard=False,
            )
    finally:
        registry.backends.unregister("no_store_test")
    message = str(caught.value)
    assert "\n" not in message
    assert "'personal_classifier' keeps per-client state" in message
    assert "'no_store_test' backend brought no client-state store" in message
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
