"""Where the Ray backend trains a round's clients (`clients.per_task: auto`): in tasks or in
the server actor, from measured costs. The server is never timed when it cannot win: it
trains clients one after another, so a client costs it at least its compute in a task."""

from __future__ import annotations

from types import SimpleNamespace

from raysim import config as config_module
from raysim.runtime.ray_backend import RayBackend


def _backend(tasks: float | None, server: float | None, compute: float | None) -> RayBackend:
    backend = RayBackend.__new__(RayBackend)  # the placement logic only, no Ray
    config = config_module.from_dict({"data": {"name": "digits"}, "clients": {"per_task": "auto"}})
    backend.ctx = SimpleNamespace(config=config)
    backend._cost = {"tasks": tasks, "server": server}
    backend._cost_round = {False: 10, True: 10}
    backend.seconds_per_client = compute
    return backend


def test_light_clients_get_the_server_timed_and_heavy_ones_do_not():
    # tiny digits clients: 0.3 ms of compute, 0.8 ms of a task round each: worth timing
    assert _backend(tasks=0.0008, server=None, compute=0.0003)._place(11) is True
    # LeNet clients on 2 slots: 64 ms of compute each, 33 ms of a parallel task round
    assert _backend(tasks=0.033, server=None, compute=0.064)._place(11) is False
    assert _backend(tasks=0.033, server=None, compute=None)._place(11) is True  # not known


def test_the_slower_place_is_timed_again_unless_the_server_cannot_win():
    later = 11 + RayBackend.RETIME_AT_MOST_EVERY + 1
    # tasks measured faster: the server is timed again, if it can win
    assert _backend(tasks=0.001, server=0.002, compute=0.0003)._place(later) is True
    assert _backend(tasks=0.033, server=0.06, compute=0.064)._place(later) is False
    # the server measured faster: tasks are timed again (no lower bound applies to them)
    assert _backend(tasks=0.002, server=0.001, compute=0.0003)._place(later) is False
    # between re-timings the faster place trains
    assert _backend(tasks=0.002, server=0.001, compute=0.0003)._place(12) is True
    assert _backend(tasks=0.001, server=0.002, compute=0.0003)._place(12) is False


def test_the_slower_place_is_timed_again_sooner_the_closer_the_two_places_are():
    """A re-timing trains SETTLE_ROUNDS + 1 rounds in the slower place: it comes after
    REPROBE_EVERY rounds when the places cost about the same, and later when they are far
    apart, so that those rounds cost at most RETIME_SHARE of the rounds between."""
    backend = _backend(tasks=0.0015, server=0.0004, compute=0.0003)
    close = backend._retime_every(0.00041, 0.0004)
    apart = backend._retime_every(0.0015, 0.0004)  # tiny digits: tasks ~3.5x the server
    assert close == RayBackend.REPROBE_EVERY
    extra = (RayBackend.SETTLE_ROUNDS + 1) * (0.0015 - 0.0004)
    assert extra / (apart * 0.0004) <= RayBackend.RETIME_SHARE < extra / ((apart - 1) * 0.0004)
    assert backend._retime_every(1.0, 0.0004) == RayBackend.RETIME_AT_MOST_EVERY
    # the server stays in use through the rounds in between, then tasks are timed again
    assert backend._place(10 + apart) is True
    assert backend._place(10 + apart + 1) is False


def test_rounds_that_start_workers_or_need_tasks_never_train_in_the_server():
    assert _backend(tasks=0.001, server=0.0001, compute=0.0)._place(1) is False
    backend = _backend(tasks=0.001, server=0.0001, compute=0.0)
    backend.ctx = SimpleNamespace(
        config=config_module.from_dict(
            {
                "data": {"name": "digits"},
                "clients": {"per_task": "auto"},
                "run": {"round_deadline_s": 5.0},
            }  # fmt: skip
        )
    )
    assert backend._place(11) is False


def _packer(clients: dict, *, slots: int, gpus: int, compute: float | None) -> RayBackend:
    backend = RayBackend.__new__(RayBackend)  # the packing logic only, no Ray
    config = config_module.from_dict({"data": {"name": "digits"}, "clients": clients})
    backend.ctx = SimpleNamespace(config=config)
    backend._init_placement(slots, gpus)
    backend.seconds_per_client = compute
    return backend


def test_batched_clients_on_gpus_take_one_task_per_gpu():
    gpu = {"per_task": "auto", "batched": True, "num_gpus": 0.25}
    # 16 CPU slots, 1 GPU: the round's 4,000 clients go to one task, which batches them all
    one = _packer(gpu, slots=16, gpus=1, compute=None)
    assert one.tasks_for(4000) == 1
    assert _packer(gpu, slots=16, gpus=1, compute=0.01).tasks_for(4000) == 1
    # two GPUs: two tasks, half the round each, in client order
    two = _packer(gpu, slots=16, gpus=2, compute=0.01)
    assert two.tasks_for(4000) == 2
    assert "one task per GPU (2 GPU(s))" in two.packing_rule()
    # not batched: the client slots, as before (several small tasks share the GPU)
    plain = _packer({**gpu, "batched": False}, slots=16, gpus=1, compute=0.01)
    assert plain.tasks_for(20) == 16
    # batched on CPUs: at most one task per client slot, fewer for a small round
    cpu = {"per_task": "auto", "batched": True}
    assert _packer(cpu, slots=2, gpus=0, compute=0.01).tasks_for(100) == 2
    assert _packer(cpu, slots=2, gpus=0, compute=0.0001).tasks_for(10) == 1
    # an explicit clients.per_task is kept
    assert _packer({**gpu, "per_task": 5}, slots=16, gpus=1, compute=0.01).tasks_for(20) == 4


def test_the_packing_of_task_rounds_is_recorded_for_the_placement_line():
    import numpy as np

    from raysim.runtime.ray_placement import placement_text

    backend = _packer({"per_task": "auto", "batched": True}, slots=2, gpus=0, compute=None)
    backend._record_packing([np.arange(0, 5), np.arange(5, 9)])
    backend._record_packing([np.arange(0, 10)])
    packing = backend.packing()
    assert packing["tasks_per_round"] == [1, 2] and packing["clients_per_task"] == [4, 10]
    line = placement_text({"nodes": [], "clients_in_server_actor": 0, "packing": packing})
    rule = "batched, auto, at most one task per client slot (2 slot(s))"
    assert f"packing: {rule}, 1-2 task(s)" in line
    assert "of 4-10 client(s)" in line


def test_a_checkpoint_or_an_evaluation_between_rounds_is_not_timed(monkeypatch):
    """The period between two rounds' calls is each place's cost, except where the driver did
    something else in it (a checkpoint's get_state, an evaluation): a 10 ms checkpoint every
    10 rounds made the server actor look slower and sent the round after it to tasks."""
    from raysim.runtime import ray_placement

    backend = _backend(tasks=None, server=None, compute=None)
    backend._init_placement(parallel_slots=2)
    clock = [0.0]
    monkeypatch.setattr(ray_placement.time, "perf_counter", lambda: clock[0])
    for round_index in range(12):
        backend._placement[round_index] = True  # every round in the server actor
        backend._clients_of[round_index] = 10
        backend._record_round_time(round_index)
        clock[0] += 0.010  # 1 ms a client
        if round_index in (5, 8):
            backend._untimed_period()  # a checkpoint after this round ...
            clock[0] += 0.050  # ... which takes 50 ms of the driver's time
    assert abs(backend._cost["server"] - 0.001) < 1e-12
    assert backend._cost_round[True] == 10
    # the same periods timed (no _untimed_period) would have counted the checkpoints
    timed = _backend(tasks=None, server=None, compute=None)
    timed._init_placement(parallel_slots=2)
    clock[0] = 0.0
    for round_index in range(12):
        timed._placement[round_index] = True
        timed._clients_of[round_index] = 10
        timed._record_round_time(round_index)
        clock[0] += 0.010 + (0.050 if round_index in (5, 8) else 0.0)
    assert timed._cost["server"] > 0.0015


def test_blocks_run_ahead_hold_about_block_seconds_of_rounds_within_memory():
    """Rounds run ahead in the server actor go as blocks, one call each, of BLOCK_SECONDS of
    rounds at the measured time a client (at least one, at most MAX_BLOCK_ROUNDS, and no more
    state copies than BLOCK_STATE_BYTES)."""
    import numpy as np

    from raysim.core.state import RoundInfo
    from raysim.runtime import ray_backend

    backend = _backend(tasks=0.001, server=0.0003, compute=0.0003)
    backend._state_nbytes = 1 << 20
    ten = RoundInfo(5, np.arange(10))
    expected = int(ray_backend.BLOCK_SECONDS // (0.0003 * 10))  # 3 ms rounds
    assert 2 <= expected <= ray_backend.MAX_BLOCK_ROUNDS and backend._block_size(ten) == expected
    backend._state_nbytes = ray_backend.BLOCK_STATE_BYTES // 2  # two copies at most
    assert backend._block_size(ten) == 2
    backend._state_nbytes = 1 << 20
    backend._cost["server"] = 0.01  # 100 ms rounds: one at a time ahead, as before blocks
    assert backend._block_size(ten) == 1
    backend._cost["server"] = 1e-7
    assert backend._block_size(ten) == ray_backend.MAX_BLOCK_ROUNDS
    backend._cost["server"] = None  # not measured yet
    assert backend._block_size(ten) == 1


def test_blocks_time_the_server_by_consecutive_fetches(monkeypatch):
    import numpy as np

    from raysim.core.state import RoundInfo
    from raysim.runtime import ray_placement

    backend = _backend(tasks=None, server=None, compute=None)
    backend._init_placement(parallel_slots=2)
    clock = [0.0]
    monkeypatch.setattr(ray_placement.time, "perf_counter", lambda: clock[0])

    def fetched(first: int, last: int, seconds: float, timed: bool = True) -> None:
        clock[0] += seconds
        infos = [RoundInfo(r, np.arange(10)) for r in range(first, last + 1)]
        backend._record_block_time(first, last, infos, timed)

    fetched(2, 5, 1.0)  # the first block: nothing to time it from
    assert backend._cost["server"] is None
    fetched(6, 9, 0.040)  # 4 rounds of 10 clients in 40 ms: 1 ms a client
    assert abs(backend._cost["server"] - 0.001) < 1e-12 and backend._cost_round[True] == 9
    fetched(12, 13, 5.0)  # not the next block (rounds 10-11 went otherwise): not timed
    assert abs(backend._cost["server"] - 0.001) < 1e-12
    fetched(14, 15, 0.060)  # 3 ms a client
    assert abs(backend._cost["server"] - 0.002) < 1e-12 and backend._cost_round[True] == 15
    backend._untimed_period()  # a checkpoint written between two fetches: not timed
    fetched(16, 17, 1.0)
    assert abs(backend._cost["server"] - 0.002) < 1e-12 and backend._cost_round[True] == 15
    # a block that ran while the driver wrote a checkpoint (queued behind its state call):
    # done before it was asked for, so not timed, but the next block is timed from its fetch
    fetched(18, 19, 0.001, timed=False)
    assert abs(backend._cost["server"] - 0.002) < 1e-12 and backend._cost_round[True] == 15
    fetched(20, 21, 0.020)  # 1 ms a client
    assert abs(backend._cost["server"] - 0.0015) < 1e-12 and backend._cost_round[True] == 21
