"""Plug-ins named by import path (`package.module:attr`), and the user code a run ships to Ray.

A researcher writes a method in their own file, say `clipping.py`, and names it in a config as
`algorithm: {name: clipping:ClippedFedAvg}`. The module is imported from the directory raysim
runs in (as `python -m` would) or from PYTHONPATH. On the Ray backend every process that builds
a plug-in (server actor, client workers, index shards, Tune trials, other nodes of a cluster)
needs the same module: `modules_to_ship` lists the user's modules (never installed packages),
and the Ray backend passes them as the run's `runtime_env` `py_modules`, so they reach the
cluster without the user touching Ray.
"""

from __future__ import annotations

import importlib
import os
import sys
import sysconfig
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from raysim.errors import ConfigError

# Modules (top-level names) imported for plug-ins named by path or registered from user code.
_USER_MODULES: set[str] = set()


def is_import_path(name: object) -> bool:
    """'package.module:attr' (a plug-in named by where it lives) rather than a registered name."""
    return isinstance(name, str) and ":" in name


def _ensure_cwd_on_path() -> None:
    """The `raysim` command's sys.path starts at its own bin folder, not the working directory;
    plug-ins are looked up where raysim runs, as `python -m` would (appended, so a file in the
    working directory never shadows an installed package)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def resolve_import_path(target: str, kind: str) -> Callable[..., Any]:
    """Import `module:attr` (attr may be dotted, e.g. `Class.factory`); one-line errors."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{kind} '{target}': an import path is 'package.module:attr'")
    _ensure_cwd_on_path()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ConfigError(
                f"{kind} '{target}': no module named '{error.name}' (looked in {os.getcwd()} "
                f"and on PYTHONPATH)"
            ) from None
        raise ConfigError(f"{kind} '{target}': importing '{module_name}' failed: {error}") from None
    except Exception as error:  # a syntax error or a failing import inside the user's file
        where = ""
        if isinstance(error, SyntaxError) and error.filename:
            where = f" ({error.filename}:{error.lineno})"
        raise ConfigError(
            f"{kind} '{target}': importing '{module_name}' failed{where}: "
            f"{type(error).__name__}: {error}"
        ) from None
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ConfigError(f"{kind} '{target}': '{module_name}' has no attribute '{attribute}'")
        value = getattr(value, part)
    if not callable(value):
        raise ConfigError(
            f"{kind} '{target}' is a {type(value).__name__}, expected a class or function"
        )
    _remember(module)
    return value


def remember_callable(target: Any) -> None:
    """Note the module of a factory registered from user code (shipped with Ray runs)."""
    module = sys.modules.get(getattr(target, "__module__", None) or "")
    if module is not None:
        _remember(module)


def _remember(module: ModuleType) -> None:
    _USER_MODULES.add(module.__name__.partition(".")[0])


def _installed_roots() -> list[Path]:
    """Folders of installed packages and the standard library (never shipped)."""
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(Path(path).resolve())
    for path in sys.path:
        if "site-packages" in path or "dist-packages" in path:
            roots.add(Path(path).resolve())
    return sorted(roots)


def _module_path(module: ModuleType) -> Path | None:
    """What py_modules needs: a package's folder or a single-file module's file."""
    paths = list(getattr(module, "__path__", []) or [])
    if len(paths) == 1:
        return Path(paths[0]).resolve()
    file = getattr(module, "__file__", None)
    if file and not paths:
        return Path(file).resolve()
    return None


def modules_to_ship(extra: Iterable[Any] = ()) -> list[str]:
    """Local paths (package folders, single .py files) of the user modules a Ray run needs.

    These are the top-level modules of every plug-in imported by path or registered from user
    code, plus `extra` factories' modules, minus raysim itself, installed packages and the
    standard library (present on every node already). A factory defined in a script's
    `__main__` travels by value (Ray pickles it with cloudpickle) and needs no shipping.
    """
    for target in extra:
        remember_callable(target)
    installed = _installed_roots()
    raysim_root = Path(__file__).resolve().parent

    def local_path(name: str) -> Path | None:
        module = sys.modules.get(name)
        if module is None or name in ("__main__", "raysim"):
            return None
        path = _module_path(module)
        if path is None or path == raysim_root or raysim_root in path.parents:
            return None
        if any(root == path or root in path.parents for root in installed):
            return None
        return path

    chosen = {name: path for name in _USER_MODULES if (path := local_path(name)) is not None}
    # Sibling modules the plug-ins imported from their own folder (helpers of the user's code)
    # go too: a worker importing the plug-in imports them as well.
    folders = {path.parent for path in chosen.values()}
    for name in list(sys.modules):
        if "." in name or name in chosen:
            continue
        path = local_path(name)
        if path is not None and path.parent in folders:
            chosen[name] = path
    return sorted(str(path) for path in chosen.values())
