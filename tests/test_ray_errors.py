"""A Ray worker's error as one line: the ImportError behind a task error is found through
nested task errors (their `cause`) and ordinary exception chains alike."""

from __future__ import annotations

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
