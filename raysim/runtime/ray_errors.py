"""A Ray task's or actor's error as the one line raysim prints for it, where it has one: the
user's input (a RaysimError raised on a worker, as the local backend would raise it), or a
module a worker cannot import."""

from __future__ import annotations

import ray

from raysim.errors import RaysimError


def one_line_error(error: ray.exceptions.RayTaskError) -> RaysimError | None:
    """The RaysimError to raise (`from None`: one line, not Ray's wrapped traceback) in place
    of `error`, or None when it is neither the user's input nor a missing module."""
    if isinstance(error.cause, RaysimError):
        return error.cause
    missing = _import_error_in(error)
    if missing is not None:
        return RaysimError(_worker_cannot_import(missing))
    return None


def _import_error_in(error: BaseException) -> ImportError | None:
    """The ImportError behind a Ray task error (nested task errors, exception chains), if any:
    a module the driver imports but a worker cannot (not installed there, not shipped)."""
    seen = 0
    while error is not None and seen < 20:
        if isinstance(error, ImportError):
            return error
        seen += 1
        # A task error wraps the worker's exception as its `cause` (Ray's RayTaskError); any
        # exception, that one included, may chain another.
        wrapped = error.cause if isinstance(error, ray.exceptions.RayTaskError) else None
        error = wrapped or error.__cause__ or error.__context__
    return None


def _worker_cannot_import(error: ImportError) -> str:
    name = error.name or " ".join(str(error).split())[:200]
    return (
        f"a Ray worker cannot import module {name!r} ({' '.join(str(error).split())[:200]}): "
        "install it on every node of the cluster, or name it in the config as a plug-in "
        "(module:attr) so raysim ships it (docs/EXTENDING.md)"
    )
