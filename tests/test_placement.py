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
    later = 11 + RayBackend.REPROBE_EVERY
    # tasks measured faster: the server is timed again, if it can win
    assert _backend(tasks=0.001, server=0.002, compute=0.0003)._place(later) is True
    assert _backend(tasks=0.033, server=0.06, compute=0.064)._place(later) is False
    # the server measured faster: tasks are timed again (no lower bound applies to them)
    assert _backend(tasks=0.002, server=0.001, compute=0.0003)._place(later) is False
    # between re-timings the faster place trains
    assert _backend(tasks=0.002, server=0.001, compute=0.0003)._place(12) is True
    assert _backend(tasks=0.001, server=0.002, compute=0.0003)._place(12) is False


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
