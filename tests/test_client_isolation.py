"""One client cannot end a run: a client that kills its process (a segfault) while training
inside the Ray server actor (`clients.per_task: auto`, the server place) costs that client,
never the server. Before, the actor died each time the round was replayed (in the server
again) and the run ended in a ServerLost traceback."""

from __future__ import annotations

import sys

import pytest

from raysim import config as config_module
from raysim.assembly import run
from raysim.runtime.ray_backend import RayBackend

BAD_CLIENT = 39  # sampled in round 2 only (seed 0, 100 clients, 10 a round)

PLUGIN = f'''
import os
import signal

import raysim
from raysim.algorithms.fedavg import FedAvg


@raysim.plugin("algorithm")
class SegfaultingFedAvg(FedAvg):
    """FedAvg whose client {BAD_CLIENT} segfaults its process."""

    # (FedAvg describes its client once: a change to one client goes into one of its pieces)
    def client_start(self, payload, client_id, ctx):
        if int(client_id) == {BAD_CLIENT}:
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().client_start(payload, client_id, ctx)
'''


@pytest.mark.ray
def test_a_client_segfaulting_inside_the_server_actor_is_dropped_and_the_run_finishes(
    ray_session, tmp_path, monkeypatch
):
    (tmp_path / "segv_fedavg.py").write_text(PLUGIN)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Every round after the first (which starts the workers) trains in the server actor.
    monkeypatch.setattr(RayBackend, "_place", lambda self, round_index: round_index >= 1)
    try:
        config = config_module.from_dict(
            {
                "run": {"name": "segv", "rounds": 2, "checkpoint_every": 0},
                "data": {"name": "digits"},
                "partition": {"name": "dirichlet", "num_clients": 100, "alpha": 0.5},
                "clients": {"per_round": 10, "local_epochs": 1, "max_retries": 0},
                "model": {"name": "mlp", "hidden": [16]},
                "algorithm": {"name": "segv_fedavg:SegfaultingFedAvg"},
                "runtime": {"backend": "ray"},
            }
        )
        assert config.clients.per_task == "auto"
        result = run(config, tmp_path / "out", progress=False, tensorboard=False)
    finally:
        sys.modules.pop("segv_fedavg", None)
    assert result.state.round == 2
    assert result.summary["clients_dropped"] == 1
    assert result.summary["clients_failed"] == 1
    assert result.summary["clients_done"] == 19
