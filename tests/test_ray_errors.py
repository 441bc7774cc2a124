"""A Ray worker's error as one line: the ImportError behind a task error is found through
nested task errors (their `cause`) and ordinary exception chains alike."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from raysim.errors import ConfigError
from raysim.runtime.ray_errors import _import_error_in, one_line_error


def _task_error(cause: BaseException) -> RayTaskError:
    return RayTaskError("train_task", "Traceback (most recent call last): ...", cause)


def _chained(cause: BaseException) -> RuntimeError:
    try:
        try:
            raise cause
        except BaseException as error:
            raise RuntimeError("unpickling the plug-in failed") from error
    except RuntimeError as error:
        return error


def test_the_import_error_behind_nested_task_errors_and_chains_is_found():
    missing = ModuleNotFoundError("No module named 'my_plugins'", name="my_plugins")
    assert _import_error_in(_task_error(_task_error(_chained(missing)))) is missing
    assert _import_error_in(_chained(missing)) is missing
    assert _import_error_in(_task_error(ValueError("not an import"))) is None
    message = str(one_line_error(_task_error(_task_error(missing))))
    assert "\n" not in message and message.startswith("a Ray worker cannot import module")
    assert "'my_plugins'" in message


def test_a_raysim_error_on_a_worker_is_raised_as_it_is():
    refused = ConfigError("algorithm 'x': server_update must return (state, diagnostics)")
    assert one_line_error(_task_error(refused)) is refused
    assert one_line_error(_task_error(ValueError("a bug"))) is None


def _a_ray_start_that_fails(monkeypatch, error: Exception, calls: list[str]) -> None:
    """connect() with a ray.init that raises `error` as Ray's node start does; `calls` gets
    the Ray calls made."""
    import ray

    from raysim import config as config_module
    from raysim.runtime import ray_cluster

    def init(*args, **kwargs):
        calls.append("init")
        raise error

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_cluster, "loopback_only", lambda runtime: False)
    runtime = config_module.from_dict({"data": {"name": "digits"}}).runtime
    ray_cluster.connect(runtime)


def test_a_local_ray_whose_raylet_never_registers_is_one_line_and_is_shut_down(monkeypatch):
    from raysim.errors import RaysimError

    # Ray's own words (ray/_private/node.py), raised as a bare Exception after 30 s
    ray_says = Exception(
        "The current node timed out during startup. This could happen because some of the "
        "raylet failed to startup or the GCS has become overloaded."
    )
    calls: list[str] = []
    with pytest.raises(RaysimError) as raised:
        _a_ray_start_that_fails(monkeypatch, ray_says, calls)
    assert calls == ["init", "shutdown"]  # the GCS it did start is not left running
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("the local Ray did not start")
    assert "cores" in message and "--address" in message
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


def test_any_other_error_of_a_local_ray_start_keeps_its_traceback(monkeypatch):
    with pytest.raises(ValueError, match="a bug"):
        _a_ray_start_that_fails(monkeypatch, ValueError("a bug"), [])
