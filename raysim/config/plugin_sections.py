"""The sections that choose a plug-in (data, partition, model, algorithm, aggregator, codec,
attack): a `name` plus that plug-in's options, checked against the plug-in's keyword-only
parameters when the section is built, then by building the plug-in once (its own checks)."""

from __future__ import annotations

import dataclasses
import keyword
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from raysim import registry
from raysim.config.coerce import _coerce
from raysim.config.experiment import DataConfig, PartitionConfig
from raysim.config.training import AttackConfig, PluginConfig
from raysim.errors import ConfigError

# Sections whose extra keys are options of the chosen plug-in: section -> (registry, default name)
_PLUGIN_SECTIONS: dict[str, tuple[registry.Registry, str]] = {
    "data": (registry.datasets, "digits"),
    "model": (registry.models, "mlp"),
    "algorithm": (registry.algorithms, "fedavg"),
    "aggregator": (registry.aggregators, "auto"),
    "codec": (registry.codecs, "auto"),
    "attack": (registry.attacks, "none"),
    "partition": (registry.partitioners, "iid"),
}
# The plug-in sections with keys of their own besides `name` (the others are PluginConfig).
_OWN_KEYS_SECTIONS = {"data": DataConfig, "partition": PartitionConfig, "attack": AttackConfig}


def _plugin_options(
    reg: registry.Registry, name: str, values: Mapping[str, Any], section: str, resolve: bool
) -> dict[str, Any]:
    """The plug-in's options checked against its factory; unresolved, as they are."""
    return reg.check_options(name, values, section) if resolve else dict(values)


def _build_plugin_section(
    section_name: str, values: Mapping[str, Any], source: str, resolve: bool = True
) -> Any:
    """The section's dataclass: its own keys coerced, the rest the plug-in's checked options."""
    reg, default_name = _PLUGIN_SECTIONS[section_name]
    values = dict(values)
    name = values.pop("name", default_name)
    if not isinstance(name, str):
        raise ConfigError(f"{source}: '{section_name}.name' must be a string, got {name!r}")
    if section_name in ("aggregator", "codec") and name == "auto":
        if values:
            raise ConfigError(
                f"{source}: '{section_name}.name: auto' takes no options; "
                f"name a {section_name} to set {', '.join(values)}"
            )
        return PluginConfig(name="auto", options={})
    if resolve:
        reg.get(name)  # unknown name -> ConfigError listing the choices
    if section_name == "attack":
        fixed = {f.name: f for f in dataclasses.fields(AttackConfig)}
        kwargs = {
            key: _coerce(values.pop(key), fixed[key].type, f"attack.{key}", source)
            for key in fixed
            if key not in ("name", "options") and key in values
        }
        options = _plugin_options(reg, name, values, section_name, resolve)
        return AttackConfig(name=name, options=options, **kwargs)
    if section_name == "partition":
        fixed = {f.name: f for f in dataclasses.fields(PartitionConfig)}
        kwargs = {
            key: _coerce(values.pop(key), fixed[key].type, f"partition.{key}", source)
            for key in ("num_clients", "cache_dir")
            if key in values
        }
        options = _plugin_options(reg, name, values, section_name, resolve)
        return PartitionConfig(name=name, options=options, **kwargs)
    if section_name == "data":
        root = values.pop("root", None)
        if root is not None and not isinstance(root, str):
            raise ConfigError(f"{source}: 'data.root' must be a path string, got {root!r}")
        kwargs = {}
        if "validation_fraction" in values:  # the engine's, not the dataset plug-in's
            kwargs["validation_fraction"] = _coerce(
                values.pop("validation_fraction"), "float", "data.validation_fraction", source
            )
        options = _plugin_options(reg, name, values, section_name, resolve)
        return DataConfig(name=name, root=root, options=options, **kwargs)
    options = _plugin_options(reg, name, values, section_name, resolve)
    return PluginConfig(name=name, options=options)


def _drop_options_of_replaced_plugins(
    raw: dict[str, Any], file_sections: Mapping[str, Any], overrides: Sequence[str]
) -> None:
    """`--set model.name=X` (any plug-in section) replaces the file's plug-in: the file's
    options that X does not take (e.g. the MLP's `hidden` when X is `lenet`, dirichlet's
    `alpha` when X is `shards`) are dropped, with one line saying so. Options given by
    overrides are always kept, and checked against X."""
    overridden = {override.partition("=")[0].strip() for override in overrides}
    for section_name, (reg, default_name) in _PLUGIN_SECTIONS.items():
        section, in_file = raw.get(section_name), file_sections.get(section_name)
        if not isinstance(section, dict) or not isinstance(in_file, Mapping):
            continue
        name, file_name = section.get("name", default_name), in_file.get("name", default_name)
        if name == file_name or not isinstance(name, str) or name == "auto":
            continue
        try:
            valid = set(reg.option_names(name))
        except ConfigError:  # unknown name: reported with the choices when the section is built
            continue
        section_type = _OWN_KEYS_SECTIONS.get(section_name, PluginConfig)
        fixed = {f.name for f in dataclasses.fields(section_type)}
        dropped = [
            key
            for key in section
            if key in in_file
            and f"{section_name}.{key}" not in overridden
            and key not in fixed
            and key not in valid
            and _python_key(key) not in valid
        ]
        for key in dropped:
            del section[key]
        if dropped:
            print(
                f"raysim: {section_name}.name={name} takes no "
                f"{', '.join(f'{section_name}.{k}' for k in dropped)}; dropped",
                file=sys.stderr,
                flush=True,
            )


def _python_key(key: str) -> str:
    return f"{key}_" if keyword.iskeyword(key) else key


def _check_plugins(
    algorithm: PluginConfig,
    aggregator: PluginConfig,
    codec: PluginConfig,
    attack: AttackConfig,
    source: str,
) -> None:
    """Build the algorithm, aggregator and attack once, so their option checks (FRL's k in
    (0, 1], TopK's fraction, ...) fail when the config is read rather than when the run starts.
    Their constructors only store and check options. Datasets and models are checked when
    they are built (they need files and the data's shape)."""
    chosen = [("algorithm", registry.algorithms, algorithm)]
    if aggregator.name != "auto":
        chosen.append(("aggregator", registry.aggregators, aggregator))
    if codec.name != "auto":
        chosen.append(("codec", registry.codecs, codec))
    if attack.name != "none":
        chosen.append(("attack", registry.attacks, attack))
    for section, reg, plugin in chosen:
        try:
            reg.build(plugin.name, **plugin.options)
        except ConfigError:
            raise
        except (TypeError, ValueError, ArithmeticError) as error:
            raise ConfigError(
                f"{source}: options of {section} '{plugin.name}' rejected: {error}"
            ) from None
