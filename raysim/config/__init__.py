"""Experiment configuration: YAML -> small frozen dataclasses, validated, with overrides.

A config file has one section per concern (run, data, partition, clients, model, algorithm,
aggregator, server, runtime). Sections that choose a plug-in (data, partition, model, algorithm,
aggregator, attack) take a `name` plus that plug-in's options, checked against the plug-in's
keyword-only parameters (`partition:` also takes `num_clients` and `cache_dir`; an override of
`partition.name` drops the file's options the new partitioner does not take). `--set a.b=value`
overrides are parsed as YAML scalars, so `--set clients.lr=0.1` gives a float and
`--set runtime.backend=local` a string. Every mistake is reported as one ConfigError naming the
key and what was expected.

Where things are: each section's dataclass, with the checks of its own fields beside them, in
`experiment` (run, data, partition), `training` (clients, server, attack, plug-in sections) and
`execution` (runtime, index, faults); the checks that read two sections in `cross_checks`; the
bounds in `limits`; building a Config from a file or mapping in `build`; plug-in sections in
`plugin_sections`; `--set` / `--unset` in `overrides`; the YAML dialect in `yaml_io`.
This package imports nothing of raysim.data: a partitioner's option values are checked through
raysim.registry.
"""

# `dataclasses` is reached as raysim.config.dataclasses by the hostile-input tests.
import dataclasses  # noqa: F401

from raysim.config.build import _SECTION_TYPES, Config, _resolve_type, from_dict, load
from raysim.config.coerce import _coerce
from raysim.config.execution import FaultsConfig, IndexConfig, RuntimeConfig
from raysim.config.experiment import DataConfig, PartitionConfig, RunConfig
from raysim.config.limits import (
    MAX_COUNT,
    MAX_LEARNING_RATE,
    MAX_LOCAL_EPOCHS,
    MAX_TASK_RESOURCES,
    MAX_WAIT_S,
    MAX_WEIGHT_DECAY,
    MIN_EPS,
)
from raysim.config.overrides import UNSET_PREFIX
from raysim.config.plugin_sections import _PLUGIN_SECTIONS
from raysim.config.training import AttackConfig, ClientsConfig, PluginConfig, ServerConfig
from raysim.config.yaml_io import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_VALUES,
    _YamlLoader,
    read_yaml_mapping,
)

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_COUNT",
    "MAX_LEARNING_RATE",
    "MAX_LOCAL_EPOCHS",
    "MAX_TASK_RESOURCES",
    "MAX_WAIT_S",
    "MAX_WEIGHT_DECAY",
    "MIN_EPS",
    "UNSET_PREFIX",
    "AttackConfig",
    "ClientsConfig",
    "Config",
    "DataConfig",
    "FaultsConfig",
    "IndexConfig",
    "PartitionConfig",
    "PluginConfig",
    "RunConfig",
    "RuntimeConfig",
    "ServerConfig",
    "from_dict",
    "load",
    "read_yaml_mapping",
    # used by raysim.tune (the YAML dialect, a key's type check) and the hostile-input tests
    "_PLUGIN_SECTIONS",
    "_SECTION_TYPES",
    "_YamlLoader",
    "_coerce",
    "_resolve_type",
]
