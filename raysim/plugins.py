"""Plug-ins named by import path (`package.module:attr`), and the user code a run ships to Ray.

A researcher writes a method in their own file, say `clipping.py`, and names it in a config as
`algorithm: {name: clipping:ClippedFedAvg}`. The module is imported from the directory raysim
runs in (as `python -m` would) or from PYTHONPATH. On the Ray backend every process that builds
a plug-in (server actor, client workers, index shards, Tune trials, other nodes of a cluster)
needs the same module: `modules_to_ship` lists the user's modules (never installed packages),
and the Ray backend passes them as the run's `runtime_env` `py_modules`, so they reach the
cluster without the user touching Ray.

What a config can run (the trust model). A config is data, and a run folder received from
someone else is their config: a name in it must never reach an arbitrary callable
(`subprocess:call`, `builtins:exit`, `os:fork`, `doctest:debug_script` would all run code). So a
`module:attr` name resolves only to an object that declares itself a raysim plug-in of the
config slot's kind, with `@raysim.plugin("algorithm")` (or "model", "dataset", ...). The
declaration is checked before anything of the object is called; a module of the standard
library is refused without being imported (none declares plug-ins, and importing some has side
effects: `antigravity` opens a browser). Importing the user's own module (from the working
directory or PYTHONPATH) runs its top-level code, as `python -m` would: that is their code.
A declaration holds for subclasses of the same kind, never for another kind. Objects a
process registers itself (`raysim.registry.algorithms.register(name, obj)`) are trusted: the
user's own code said so. Resuming a run folder whose config names `module:attr` plug-ins needs
an explicit `--trust-plugins` (raysim.core.loop.resume), since the folder may be someone
else's; `raysim.load_run` reads a folder without resolving any plug-in.
"""

from __future__ import annotations

import importlib
import inspect
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


# The attribute `raysim.plugin` sets: the kinds (registry kind names) an object declares.
PLUGIN_MARKER = "__raysim_plugin__"

# What users write for a kind (`raysim info` and config section names too) -> registry kind.
KIND_ALIASES = {
    "dataset": "dataset",
    "data": "dataset",
    "partitioner": "partitioner",
    "partition": "partitioner",
    "model": "model",
    "algorithm": "algorithm",
    "aggregator": "aggregator",
    "server optimizer": "server optimizer",
    "server_optimizer": "server optimizer",
    "optimizer": "server optimizer",
    "attack": "attack",
    "index": "index",
    "codec": "codec",
    "backend": "backend",
}


def plugin(*kinds: str) -> Callable[[Any], Any]:
    """Declare a class or function a raysim plug-in of `kinds`, so that a config may name it by
    import path (`module:attr`); without the declaration such a name is refused.

        @raysim.plugin("algorithm")
        class ClippedFedAvg(FedAvg): ...

    Kinds: dataset, partitioner, model, algorithm, aggregator, server_optimizer, attack, index,
    codec, backend. A subclass is declared for the same kinds (its own `@raysim.plugin`
    replaces them)."""
    if not kinds:
        raise TypeError('raysim.plugin needs a kind, e.g. @raysim.plugin("algorithm")')
    unknown = [kind for kind in kinds if kind not in KIND_ALIASES]
    if unknown:
        raise ValueError(
            f"raysim.plugin: unknown kind {unknown[0]!r}; kinds: "
            f"{', '.join(sorted(set(KIND_ALIASES) - {'data', 'partition', 'optimizer'}))}"
        )
    declared = frozenset(KIND_ALIASES[kind] for kind in kinds)

    def declare(target: Any) -> Any:
        if not callable(target):
            raise TypeError(
                f"raysim.plugin declares classes and functions, not a {type(target).__name__}"
            )
        setattr(target, PLUGIN_MARKER, declared)
        return target

    return declare


def declared_kinds(target: Any) -> frozenset[str]:
    """The kinds `target` declares with `raysim.plugin` (empty: none). Read without running
    any of its code: no `__getattr__`, property or descriptor is invoked, and only a frozenset
    counts (an object answering every attribute, such as a mock, declares nothing)."""
    if isinstance(target, classmethod | staticmethod):
        target = target.__func__
    try:
        value = inspect.getattr_static(target, PLUGIN_MARKER, None)
    except Exception:  # noqa: BLE001 - an exotic object declares nothing
        return frozenset()
    if isinstance(value, frozenset) and all(isinstance(kind, str) for kind in value):
        return value
    return frozenset()


def _not_a_plugin(target: str, kind: str, why: str = "") -> ConfigError:
    flag = kind.replace(" ", "_")
    return ConfigError(
        f"{kind} '{target}' is not a raysim plug-in ({why}declare it with "
        f'@raysim.plugin("{flag}"); see docs/EXTENDING.md)'
    )


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


def resolve_import_path(target: str, kind: str, *, trusted: bool = False) -> Callable[..., Any]:
    """Import `module:attr` (attr may be dotted, e.g. `Class.factory`); one-line errors.

    Unless `trusted` (a path the user's own process registered), the object must declare
    itself a plug-in of `kind` (`raysim.plugin`): checked before it is called, and a
    standard-library module is refused before it is imported (module docstring)."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{kind} '{target}': an import path is 'package.module:attr'")
    top = module_name.partition(".")[0]
    if not trusted and (top in sys.stdlib_module_names or top in sys.builtin_module_names):
        raise _not_a_plugin(target, kind, f"'{top}' is a standard-library module; ")
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
    # Looked up statically: a module's `__getattr__` or a property is code the config chose.
    owner: Any = None
    value: Any = module
    for part in attribute.split("."):
        try:
            owner, value = value, inspect.getattr_static(value, part)
        except AttributeError:
            raise ConfigError(
                f"{kind} '{target}': '{module_name}' has no attribute '{attribute}'"
            ) from None
    raw = value.__func__ if isinstance(value, classmethod | staticmethod) else value
    if not callable(raw):
        raise ConfigError(
            f"{kind} '{target}' is a {type(value).__name__}, expected a class or function"
        )
    if not trusted and kind not in declared_kinds(value):
        other = sorted(declared_kinds(value))
        why = f"it is declared for {', '.join(other)}, not for {kind}; " if other else ""
        raise _not_a_plugin(target, kind, why)
    if isinstance(value, classmethod | staticmethod):
        value = getattr(owner, attribute.rpartition(".")[2])  # bound as the class gives it
    _remember(module)
    return value


def import_paths_in(config: Any) -> list[str]:
    """The plug-ins a config names by import path, as `kind 'module:attr'` (no import)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    slots = [
        ("data", "name", "dataset"),
        ("partition", "name", "partitioner"),
        ("model", "name", "model"),
        ("algorithm", "name", "algorithm"),
        ("aggregator", "name", "aggregator"),
        ("codec", "name", "codec"),
        ("attack", "name", "attack"),
        ("server", "optimizer", "server optimizer"),
        ("index", "backend", "index"),
        ("runtime", "backend", "backend"),
    ]
    found = []
    for section, key, kind in slots:
        value = (raw.get(section) or {}).get(key)
        if is_import_path(value):
            found.append(f"{kind} '{value}'")
    return found


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
