"""Reading YAML for raysim: the config dialect (`1e-3` is a float, keys are unique, no dates),
the size limits that keep a hostile file from expanding without end, and the config file
itself read into one mapping of sections, every mistake one ConfigError line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from raysim.errors import ConfigError

MAX_CONFIG_BYTES = 16 * 2**20  # a config file is a few KB; 16 MB is never one
# A real config holds hundreds of values; YAML aliases that repeat aliases can make one of a
# few hundred bytes stand for billions (and expand in whatever walks it: checks, messages).
MAX_CONFIG_VALUES = 100_000


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1's safe loader, plus `1e-3` read as a float (PyYAML wants `1.0e-3`).

    Dates are not recognised: no config value is a date, and PyYAML's timestamp constructor
    raises a bare ValueError for `2001-13-01`; such a value stays a string, so the type check
    names its key.
    """


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False):
    """A mapping whose keys are unique: PyYAML keeps the last of a repeated key silently, so
    `lr: 0.1` then `lr: 10.0` would run with 10.0 whatever the reader saw first. Merge keys
    (`<<`) are YAML's own way to repeat a mapping; an explicit key still overrides them."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: the base constructor reports it
            continue
        if repeated:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first at line {seen[key]})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_YamlLoader.construct_mapping = _construct_mapping  # what its map constructor calls
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _too_large(value: Any) -> bool:
    """Whether `value`, with every alias expanded, holds more than MAX_CONFIG_VALUES values
    (stops counting there: never walks a bomb, nor loops on a self-referencing alias)."""
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return False


def _yaml_value(text: str, where: str) -> Any:
    """yaml.load with the size check above (`where` names the file or override)."""
    value = yaml.load(text, Loader=_YamlLoader)
    if _too_large(value):
        raise ConfigError(
            f"{where}: the YAML expands to more than {MAX_CONFIG_VALUES:,} values "
            "(aliases that repeat aliases?); a config needs far fewer"
        )
    return value


def read_yaml_mapping(path: str | Path, what: str, expected: str) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (a sweep, a comparison spec), read with the
    config loader (so `1e-3` is a float as in `raysim run`); errors are one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        raw = yaml.load(path.read_text(), Loader=_YamlLoader) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(error).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping {expected} at the top level")
    return raw


def read_config_sections(path: Path) -> dict[Any, Any]:
    """The top-level mapping of sections of config file `path`, not yet checked."""
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    if not path.is_file():  # a folder, or a FIFO or device whose read could hang or never end
        raise ConfigError(f"config file {path} is not a regular file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is {path.stat().st_size:,} bytes; a config is a few KB "
            f"(limit {MAX_CONFIG_BYTES:,})"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the config file: {error}") from None
    try:
        raw = _yaml_value(text, str(path)) or {}
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        reason = " ".join(str(getattr(error, "problem", None) or error).split())  # one line
        raise ConfigError(f"{path}:{where}: invalid YAML: {reason}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as error:
        # PyYAML's constructors raise these for e.g. an explicit `!!timestamp 2001-13-01`,
        # `!!int` of a non-number, or absurdly deep nesting.
        reason = " ".join(str(error).split())
        raise ConfigError(f"{path}: invalid YAML value: {reason}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw
