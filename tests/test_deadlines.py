"""Deadlines drop only the late: with `run.round_deadline_s` a client task is late when it has
trained for longer than the deadline since its own start (its STARTED marker), so a client that
waited for a CPU slot, or for its worker to start on a loaded machine, is never cut; each client
trains in a task of its own, so a hanging client is cancelled alone; and a round with several
hanging clients still ends in bounded time (each frees its slot at its own deadline). Before, the
deadline counted from the dispatch and the updates' arrivals: a 1 s deadline with no slow client
lost 4 of 8 clients in some rounds, and the honest clients packed into a straggler's task were
dropped with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raysim import config as config_module
from raysim.assembly import run
from raysim.core.faults import FaultPlan
from raysim.seeds import sample_clients

REPO_ROOT = Path(__file__).resolve().parents[1]


def _config(*overrides: str) -> config_module.Config:
    return config_module.load(
        REPO_ROOT / "configs" / "fedavg_digits.yaml",
        [
            "runtime.backend=ray",
            "run.checkpoint_every=0",
            "model.hidden=[16]",
            "clients.local_epochs=1",
            *overrides,
        ],
    )


def _records(config, out: Path) -> list[dict]:
    run(config, out, progress=False, tensorboard=False)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _stragglers(config, round_index: int) -> list[int]:
    plan = FaultPlan.from_config(config)
    per_round, clients = config.clients.per_round, config.partition.num_clients
    ids = sample_clients(config.run.seed, round_index, clients, per_round)
    return [int(c) for c in ids if plan.straggles(round_index, int(c), 0)]


@pytest.mark.ray
def test_a_short_deadline_with_clients_queued_for_slots_drops_no_honest_client(
    ray_session, tmp_path
):
    """A 1 s deadline, no slow client, 10 clients a round on 4 slots of 2 CPUs (most of them
    queue for a slot; round 1 starts 4 workers at once, seconds each, more when the suite's
    other worker process shares the CPUs): none is late. Before, counting the deadline from
    the dispatch, such a run lost up to half of a round's clients on an idle machine."""
    config = _config(
        "run.rounds=3",
        "clients.num_cpus=0.5",  # 4 slots on the test's 2 CPUs, all starting in round 1
        "run.round_deadline_s=1.0",
    )
    records = _records(config, tmp_path)
    assert [(r["clients_done"], r["clients_late"]) for r in records] == [(10, 0)] * 3


@pytest.mark.ray
def test_a_hanging_client_is_dropped_as_late_and_the_honest_clients_of_its_round_are_kept(
    ray_session, tmp_path
):
    """Client 86 sleeps 120 s in round 1 (a straggler fault) with a 5 s deadline and
    `clients.per_task=5`, which would pack it with 4 honest clients: with a deadline each client
    trains alone, so only 86 is cut; round 2 (whose slot's worker the cancel ended, so it starts
    a new one) loses nothing. (5 s, not 1 s: this is about isolation, and on a machine loaded
    far beyond its cores a 2 ms client can take over a second to train; see the README.)"""
    config = _config(
        "run.rounds=2",
        "clients.per_task=5",
        "clients.num_cpus=0.5",  # 4 slots on the test's 2 CPUs: the straggler blocks one
        "faults.straggler_rate=0.1",
        "faults.straggler_delay_s=120",
        "faults.seed=4",  # one straggler in round 1 (client 86), none in round 2
        "run.round_deadline_s=5",
    )
    assert [_stragglers(config, r) for r in range(2)] == [[86], []]
    records = _records(config, tmp_path)
    assert [(r["clients_done"], r["clients_late"]) for r in records] == [(9, 1), (10, 0)]
    assert [r["clients_dropped"] for r in records] == [1, 0]
    assert [r["tasks"] for r in records] == [10, 10]  # one client per task
    assert records[0]["wall_s"] < 60  # cut at its deadline, not after its 120 s


@pytest.mark.ray
def test_a_round_with_several_hanging_clients_ends_in_bounded_time(ray_session, tmp_path):
    """5 of 10 clients sleep 300 s, on 2 slots: each is cancelled 1 s after it starts, which
    frees its slot for the clients queued behind it; the round ends in seconds with exactly the
    5 hanging clients late and the 5 others trained."""
    config = _config(
        "run.rounds=1",
        "clients.num_cpus=1",  # 2 slots: the hanging clients hold both, the others queue
        "faults.straggler_rate=0.4",
        "faults.straggler_delay_s=300",
        "faults.seed=1",  # clients 2, 9, 18, 65 and 78 hang
        "run.round_deadline_s=1.0",
    )
    assert _stragglers(config, 0) == [2, 9, 18, 65, 78]
    (record,) = _records(config, tmp_path)
    assert (record["clients_done"], record["clients_late"]) == (5, 5)
    # 5 hangs of 1 s and a worker restart each on 2 slots (seconds each on a loaded machine),
    # far below one hang's 300 s
    assert record["wall_s"] < 150
