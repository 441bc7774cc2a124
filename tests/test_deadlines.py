"""Deadlines drop only the late: with `run.round_deadline_s` and automatic packing, a hanging
client's task is cancelled with that client alone (one client per task), and a round with no
slow client loses no update. Before, the honest clients packed into a straggler's task were
dropped with it, and a 1 s deadline with no slow client lost 4 of 8 clients in some rounds
(a slot whose worker was still starting)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysim import config as config_module
from raysim.assembly import run
from raysim.core.faults import FaultPlan
from raysim.seeds import sample_clients

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.ray
def test_a_hanging_client_is_dropped_alone_and_a_round_without_one_loses_nothing(
    ray_session, tmp_path
):
    config = config_module.load(
        REPO_ROOT / "configs" / "fedavg_digits.yaml",
        [
            "runtime.backend=ray",
            "run.rounds=2",
            "run.checkpoint_every=0",
            "model.hidden=[16]",
            "clients.local_epochs=1",
            "clients.num_cpus=0.5",  # 4 slots on the test's 2 CPUs: the straggler blocks one
            "faults.straggler_rate=0.1",
            "faults.straggler_delay_s=30",
            "faults.seed=4",  # one straggler in round 1 (client 86), none in round 2
            "run.round_deadline_s=5",
        ],
    )
    assert config.clients.per_task == "auto"
    plan = FaultPlan.from_config(config)
    late = [
        [int(c) for c in sample_clients(0, r, 100, 10) if plan.straggles(r, int(c), 0)]
        for r in range(2)
    ]
    assert late == [[86], []]
    run(config, tmp_path, progress=False, tensorboard=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["clients_done"], r["clients_late"]) for r in records] == [(9, 1), (10, 0)]
    assert [r["clients_dropped"] for r in records] == [1, 0]
