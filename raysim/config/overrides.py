"""`--set section.key=value` and `--unset section.key` applied to a config's raw mapping, and
an error about a key an override gave blamed on that override rather than the file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from raysim.config.yaml_io import _yaml_value
from raysim.errors import ConfigError

UNSET_PREFIX = "~"  # `--unset model.hidden` reaches from_dict as the override "~model.hidden"


def _flat_items(overrides: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Config.replace's keyword arguments (`clients__lr=0.1`) as `section.key` items."""
    return [(key.replace("__", "."), value) for key, value in overrides.items()]


def _override_sources(overrides: Sequence[str]) -> dict[str, str]:
    """Which keys came from --set / --unset, and how to name each: its errors name the override,
    not the file."""
    from_overrides = {}
    for override in overrides:
        key = override.partition("=")[0].strip().removeprefix(UNSET_PREFIX)
        from_overrides[key] = f"--set {override}" if "=" in override else f"--unset {key}"
    return from_overrides


def _blame_override(error: ConfigError, source: str, from_overrides: Mapping[str, str]):
    """An error about a key that a --set gave names that --set, not the file."""
    message = str(error)
    for key, where in from_overrides.items():
        if f"'{key}'" in message or f"'{key.split('.')[0]}.name'" in message:
            return ConfigError(f"{where}: {message.removeprefix(f'{source}: ')}")
    return error


def _apply_override(raw: dict[str, Any], override: str) -> None:
    """`section.key=value` sets a key; `section={...}` replaces a whole section (e.g.
    `model={name: lenet}`); `~section.key` removes a key (--unset)."""
    if override.startswith(UNSET_PREFIX):
        key = override.removeprefix(UNSET_PREFIX).strip()
        parts = key.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"--unset {key}: expected section.key")
        values = raw.get(parts[0])
        if not isinstance(values, dict) or parts[1] not in values:
            raise ConfigError(f"--unset {key}: the config does not set '{key}'")
        del values[parts[1]]
        return
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if sep and len(parts) == 1 and parts[0]:
        try:
            value = _yaml_value(text, f"--set {override}") if text.strip() else None
        except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise ConfigError(
                f"--set {override}: a whole section is replaced by a mapping, e.g. "
                f"{parts[0]}='{{key: value}}'; one key is set with {parts[0]}.key=value"
            )
        raw[parts[0]] = dict(value)
        return
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"override '{override}' must look like section.key=value")
    section, name = parts
    try:
        value = _yaml_value(text, f"--set {override}") if text.strip() else None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError):
        value = text  # not a YAML scalar: the type check of the key reports it
    if raw.get(section) is None:  # absent, or an empty `section:` in the file
        raw[section] = {}
    section_values = raw[section]
    if not isinstance(section_values, dict):
        raise ConfigError(f"override '{override}': section '{section}' is not a mapping")
    section_values[name] = value
