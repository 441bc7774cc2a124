"""The whole experiment config (`Config`: one frozen dataclass per section) and how one is
built: from a YAML file (`load`) or a mapping (`from_dict`), with `--set` / `--unset`
overrides, each section built from its keys, then checked: each section's own `check`, the
checks across sections, and the chosen plug-ins built once."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysim.config.coerce import _coerce
from raysim.config.cross_checks import check_across_sections
from raysim.config.devices import DevicesConfig
from raysim.config.execution import FaultsConfig, IndexConfig, RuntimeConfig
from raysim.config.experiment import DataConfig, PartitionConfig, RunConfig
from raysim.config.overrides import (
    _apply_override,
    _blame_override,
    _flat_items,
    _override_sources,
)
from raysim.config.paths import resolve_config_paths
from raysim.config.plugin_sections import (
    _PLUGIN_SECTIONS,
    _build_plugin_section,
    _check_plugins,
    _drop_options_of_replaced_plugins,
)
from raysim.config.training import AttackConfig, ClientsConfig, PluginConfig, ServerConfig
from raysim.config.yaml_io import read_config_sections
from raysim.errors import ConfigError, closest

# The order sections are checked in, which decides which of several mistakes is reported.
_CHECK_ORDER = (
    "run",
    "data",
    "partition",
    "clients",
    "server",
    "faults",
    "attack",
    "index",
    "runtime",
    "devices",
)


@dataclass(frozen=True, kw_only=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    clients: ClientsConfig = field(default_factory=ClientsConfig)
    model: PluginConfig = field(default_factory=lambda: PluginConfig(name="mlp"))
    algorithm: PluginConfig = field(default_factory=lambda: PluginConfig(name="fedavg"))
    aggregator: PluginConfig = field(default_factory=lambda: PluginConfig(name="auto"))
    # Wire format of the clients' updates (raysim.core.codecs); auto: the algorithm's own.
    codec: PluginConfig = field(default_factory=lambda: PluginConfig(name="auto"))
    attack: AttackConfig = field(default_factory=AttackConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    # simulated devices and clock (docs/SIMULATED_TIME.md); profiles: none leaves a run as is
    devices: DevicesConfig = field(default_factory=DevicesConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict with plug-in options flattened back into their sections."""
        out: dict[str, Any] = {}
        for section in dataclasses.fields(self):
            value = getattr(self, section.name)
            items = {}
            for f in dataclasses.fields(value):
                if f.name == "options" and section.name != "index":  # plug-in options inline
                    items.update({k: _plain(v) for k, v in value.options.items()})
                else:
                    items[f.name] = _plain(getattr(value, f.name))
            out[section.name] = items
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **overrides: Any) -> Config:
        """A new config with `section.key=value` overrides (same rules as --set)."""
        return from_dict(
            self.to_dict(), [f"{k}={yaml.safe_dump(v).strip()}" for k, v in _flat_items(overrides)]
        )

    def check(self, source: str, resolve: bool = True) -> None:
        """Each section's range checks, those across sections, then the plug-ins' own checks
        (not when plug-ins are left unresolved, see `load`)."""
        for name in _CHECK_ORDER:
            getattr(self, name).check(source, resolve)
        check_across_sections(self.partition, self.clients, self.attack, source)
        if resolve:
            _check_plugins(self.algorithm, self.aggregator, self.codec, self.attack, source)


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


_SECTION_TYPES = {f.name: f for f in dataclasses.fields(Config)}
_SECTION_CLASSES = {
    cls.__name__: cls
    for cls in (
        RunConfig,
        DataConfig,
        PartitionConfig,
        ClientsConfig,
        PluginConfig,
        AttackConfig,
        ServerConfig,
        IndexConfig,
        RuntimeConfig,
        FaultsConfig,
        DevicesConfig,
    )
}


def _resolve_type(annotation: Any) -> Any:
    """A section field's annotation (a string, e.g. 'RunConfig') as its class."""
    if isinstance(annotation, str):
        return _SECTION_CLASSES.get(annotation, annotation)
    return annotation


def load(
    path: str | Path, overrides: Sequence[str] = (), *, resolve_plugins: bool = True
) -> Config:
    """Read a YAML config file and apply `a.b=value` overrides.

    `resolve_plugins=False` reads it without resolving any plug-in name (no import, no
    option check against a factory, nothing of a plug-in built): for reading a run folder,
    whose config may name someone else's code (raysim.load_run)."""
    path = Path(path)
    raw = read_config_sections(path)
    return from_dict(raw, overrides, source=str(path), resolve_plugins=resolve_plugins)


def from_dict(
    raw: Mapping[str, Any],
    overrides: Sequence[str] = (),
    source: str = "config",
    *,
    resolve_plugins: bool = True,
) -> Config:
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    file_sections = {k: dict(v) for k, v in raw.items() if isinstance(v, Mapping)}
    for override in overrides:
        _apply_override(raw, override)
    if resolve_plugins:  # it asks the new plug-ins for their options
        _drop_options_of_replaced_plugins(raw, file_sections, overrides)
    from_overrides = _override_sources(overrides)
    sections: dict[str, Any] = {}
    for section_name, values in raw.items():
        if not isinstance(section_name, str):
            raise ConfigError(f"{source}: section names must be strings, got {section_name!r}")
        if section_name not in _SECTION_TYPES:
            raise ConfigError(
                f"{source}: unknown section '{section_name}'"
                f"{closest(section_name, list(_SECTION_TYPES))}; "
                f"valid sections: {', '.join(_SECTION_TYPES)}"
            )
        if values is None:
            values = {}
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: section '{section_name}' must be a mapping of keys")
        try:
            sections[section_name] = _build_section(section_name, values, source, resolve_plugins)
        except ConfigError as error:
            raise _blame_override(error, source, from_overrides) from None
    config = Config(**sections)
    try:
        config.check(source, resolve_plugins)
    except ConfigError as error:
        raise _blame_override(error, source, from_overrides) from None
    # once, here: every later reader (driver, workers, saved config.yaml) sees the same path
    return resolve_config_paths(config)


def _build_section(
    section_name: str, values: Mapping[str, Any], source: str, resolve: bool = True
) -> Any:
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(f"{source}: keys of '{section_name}' must be strings, got {key!r}")
    if section_name in _PLUGIN_SECTIONS:
        return _build_plugin_section(section_name, values, source, resolve)
    section_type = _resolve_type(_SECTION_TYPES[section_name].type)
    fields = {f.name: f for f in dataclasses.fields(section_type)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{section_name}.{key}'{closest(key, list(fields))}; "
                f"valid keys: {', '.join(fields)}"
            )
        kwargs[key] = _coerce(value, fields[key].type, f"{section_name}.{key}", source)
    return section_type(**kwargs)
