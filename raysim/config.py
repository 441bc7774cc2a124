"""Experiment configuration: YAML -> small frozen dataclasses, validated, with overrides.

A config file has one section per concern (run, data, partition, clients, model, algorithm,
aggregator, server, runtime). Sections that choose a plug-in (data, partition, model, algorithm,
aggregator, attack) take a `name` plus that plug-in's options, checked against the plug-in's
keyword-only parameters (`partition:` also takes `num_clients` and `cache_dir`; an override of
`partition.name` drops the file's options the new partitioner does not take). `--set a.b=value`
overrides are parsed as YAML scalars, so `--set clients.lr=0.1` gives a float and
`--set runtime.backend=local` a string. Every mistake is reported as one ConfigError naming the
key and what was expected.
"""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
import sys
import unicodedata
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raysim import registry
from raysim.errors import ConfigError, closest

MAX_COUNT = 10**9  # the most rounds, and clients, a config may ask for
MAX_CONFIG_BYTES = 16 * 2**20  # a config file is a few KB; 16 MB is never one


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    rounds: int = 30
    eval_every: int = 1  # evaluate the global model every N rounds (and always after the last)
    # Rounds (1-based) evaluated besides those: a table that names rounds reads exactly them.
    eval_at: tuple[int, ...] = ()
    checkpoint_every: int = 10  # write a checkpoint every N rounds (0: only after the last)
    keep_checkpoints: int = 3
    # Ray backend: client tasks still running this many seconds after the round's dispatch are
    # cancelled and their clients dropped for the round (None: wait for every client). In the
    # first round, which starts the workers, it counts from the first update's arrival.
    round_deadline_s: float | None = None
    # Stop the run (exit status 2, saying why) after this many rounds in a row that left the
    # model unchanged (every update dropped, late or rejected): a run that trains nothing
    # must not end as if it had succeeded. 0: never stop.
    max_idle_rounds: int = 5


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = "digits"
    root: str | None = None
    # Share of the training rows held out as the validation split (drawn from the run seed,
    # before the client split): runs report `val/...` beside the test set's `eval/...`, and
    # sweeps tune on it. 0: no validation split.
    validation_fraction: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """The partitioner `name` (raysim.registry.partitioners) and its options: every other key of
    the `partition:` section, e.g. dirichlet's `alpha` or shards' `shards_per_client`."""

    name: str = "iid"
    num_clients: int = 100
    cache_dir: str | None = None  # cache the split as parquet here (and reuse it)
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ClientsConfig:
    per_round: int = 10
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    per_task: int | str = "auto"  # clients trained one after another inside one Ray task
    num_cpus: float = 1.0  # per client task; torch threads inside the task = max(1, int(num_cpus))
    num_gpus: float = 0.0
    # A client whose training fails (worker crash, injected fault) is retried up to this many
    # times in the same round, then dropped for the round.
    max_retries: int = 3


@dataclass(frozen=True, kw_only=True)
class PluginConfig:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class AttackConfig:
    """Malicious clients: the lowest `fraction * num_clients` ids run attack `name`."""

    name: str = "none"
    fraction: float = 0.0
    redraw_majority: bool = True  # redraw rounds where >= half the sampled clients are malicious
    # malicious clients the attacker also trains each round (never sent) to estimate benign
    # updates; FRL's code uses 25. 0: only the round's sampled malicious clients.
    pool_size: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Server optimizer applied to the aggregated client delta (FedOpt, Reddi et al. 2021).

    optimizer 'sgd' with lr 1 and momentum 0 is plain FedAvg.
    """

    optimizer: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3
    # An update whose norm is more than this many times the model's (at least 1) is refused:
    # for algorithms whose updates are deltas of the model (`update_delta_of`). Honest deltas
    # are far smaller; a finite 3e38 or 1e20 would wreck the model or Adam's moments. 0: off.
    max_update_ratio: float = 1000.0
    # GPUs of the server (on Ray, reserved for the server actor): evaluation and the
    # algorithm's server-side tensor work (FedAwS: exact index search, spreadout) run there.
    # 0: the CPU. Without a GPU in the cluster the server runs on the CPU, with a notice.
    num_gpus: float = 0.0


@dataclass(frozen=True, kw_only=True)
class IndexConfig:
    """The nearest-class index FedAwS mines negatives from (spreadout: topk).

    Each of `shards` holds a contiguous block of class rows (a Ray actor on the Ray backend);
    `options` go to the backend (e.g. faiss IVF's nlist/nprobe, HNSW's M/ef_search).
    """

    backend: str = "exact"
    shards: int = 1
    retrain_every: int = 50  # updates between retrainings of a trained index (faiss IVF)
    # Ray resources per shard actor (shards > 1 on the Ray backend; one shard runs inside the
    # server actor). 0 reserves nothing, right for one box; reserve CPUs/GPUs on a cluster.
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class FaultsConfig:
    """Injected client faults (raysim.core.faults), deterministic given `seed`: each
    (round, client, attempt) fails with probability `client_failure_rate` (a hard worker exit
    for `hard_exit_fraction` of failures, else an exception) and is a straggler, delayed by
    `straggler_delay_s`, with probability `straggler_rate`."""

    client_failure_rate: float = 0.0
    hard_exit_fraction: float = 0.5
    straggler_rate: float = 0.0
    straggler_delay_s: float = 0.0
    seed: int = 0


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    backend: str = "ray"  # 'ray' or 'local'
    num_cpus: int | None = None  # CPUs for a local Ray start (None: all)
    address: str | None = None  # 'auto' or 'ray://...' joins an existing cluster
    dashboard_host: str = "127.0.0.1"


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


def _flat_items(overrides: Mapping[str, Any]) -> list[tuple[str, Any]]:
    return [(key.replace("__", "."), value) for key, value in overrides.items()]


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


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


# A real config holds hundreds of values; YAML aliases that repeat aliases can make one of a
# few hundred bytes stand for billions (and expand in whatever walks it: checks, messages).
MAX_CONFIG_VALUES = 100_000


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
_SECTION_TYPES = {f.name: f for f in dataclasses.fields(Config)}


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


def load(
    path: str | Path, overrides: Sequence[str] = (), *, resolve_plugins: bool = True
) -> Config:
    """Read a YAML config file and apply `a.b=value` overrides.

    `resolve_plugins=False` reads it without resolving any plug-in name (no import, no
    option check against a factory, nothing of a plug-in built): for reading a run folder,
    whose config may name someone else's code (raysim.load_run)."""
    path = Path(path)
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
    # Which keys came from --set: their errors name the override, not the file.
    from_overrides = {}
    for override in overrides:
        key = override.partition("=")[0].strip().removeprefix(UNSET_PREFIX)
        from_overrides[key] = f"--set {override}" if "=" in override else f"--unset {key}"
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
        _validate(config, source, resolve_plugins)
    except ConfigError as error:
        raise _blame_override(error, source, from_overrides) from None
    return config


def _blame_override(error: ConfigError, source: str, from_overrides: Mapping[str, str]):
    """An error about a key that a --set gave names that --set, not the file."""
    message = str(error)
    for key, where in from_overrides.items():
        if f"'{key}'" in message or f"'{key.split('.')[0]}.name'" in message:
            return ConfigError(f"{where}: {message.removeprefix(f'{source}: ')}")
    return error


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
        fixed = {
            f.name for f in dataclasses.fields(_resolve_type(_SECTION_TYPES[section_name].type))
        }
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


UNSET_PREFIX = "~"  # `--unset model.hidden` reaches from_dict as the override "~model.hidden"


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


def _build_section(
    section_name: str, values: Mapping[str, Any], source: str, resolve: bool = True
) -> Any:
    for key in values:
        if not isinstance(key, str):
            raise ConfigError(f"{source}: keys of '{section_name}' must be strings, got {key!r}")
    section_type = _resolve_type(_SECTION_TYPES[section_name].type)
    if section_name in _PLUGIN_SECTIONS or section_type is DataConfig:
        reg, default_name = _PLUGIN_SECTIONS[section_name]
        values = dict(values)
        name = values.pop("name", default_name)
        if not isinstance(name, str):
            raise ConfigError(f"{source}: '{section_name}.name' must be a string, got {name!r}")
        if (
            section_type is PluginConfig
            and section_name in ("aggregator", "codec")
            and (name == "auto")
        ):
            if values:
                raise ConfigError(
                    f"{source}: '{section_name}.name: auto' takes no options; "
                    f"name a {section_name} to set {', '.join(values)}"
                )
            return PluginConfig(name="auto", options={})
        if resolve:
            reg.get(name)  # unknown name -> ConfigError listing the choices
        if section_type is AttackConfig:
            fixed = {f.name: f for f in dataclasses.fields(AttackConfig)}
            kwargs = {
                key: _coerce(values.pop(key), fixed[key].type, f"attack.{key}", source)
                for key in fixed
                if key not in ("name", "options") and key in values
            }
            options = _plugin_options(reg, name, values, section_name, resolve)
            return AttackConfig(name=name, options=options, **kwargs)
        if section_type is PartitionConfig:
            fixed = {f.name: f for f in dataclasses.fields(PartitionConfig)}
            kwargs = {
                key: _coerce(values.pop(key), fixed[key].type, f"partition.{key}", source)
                for key in ("num_clients", "cache_dir")
                if key in values
            }
            options = _plugin_options(reg, name, values, section_name, resolve)
            return PartitionConfig(name=name, options=options, **kwargs)
        if section_type is DataConfig:
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


def _plugin_options(
    reg: registry.Registry, name: str, values: Mapping[str, Any], section: str, resolve: bool
) -> dict[str, Any]:
    """The plug-in's options checked against its factory; unresolved, as they are."""
    return reg.check_options(name, values, section) if resolve else dict(values)


_TYPE_NAMES = {
    "int": int,
    "float": float,
    "str": str,
    "bool": bool,
    "None": type(None),
    "RunConfig": RunConfig,
    "DataConfig": DataConfig,
    "PartitionConfig": PartitionConfig,
    "ClientsConfig": ClientsConfig,
    "PluginConfig": PluginConfig,
    "ServerConfig": ServerConfig,
    "RuntimeConfig": RuntimeConfig,
    "IndexConfig": IndexConfig,
    "AttackConfig": AttackConfig,
    "FaultsConfig": FaultsConfig,
}


def _resolve_type(annotation: Any) -> Any:
    if isinstance(annotation, str):
        return _TYPE_NAMES[annotation] if annotation in _TYPE_NAMES else annotation
    return annotation


def _coerce(value: Any, annotation: Any, key: str, source: str) -> Any:
    """Check `value` against a field annotation such as 'int | None' or 'int | str'."""
    if str(annotation).startswith("Mapping"):  # free-form options (e.g. index.options)
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{source}: '{key}' expects a mapping of names to values")
        return dict(value)
    if str(annotation) == "tuple[int, ...]":  # a list of whole numbers (run.eval_at)
        if not isinstance(value, list | tuple) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise ConfigError(f"{source}: '{key}' expects a list of whole numbers, got {value!r}")
        return tuple(sorted(set(value)))
    allowed = [_TYPE_NAMES[t.strip()] for t in str(annotation).split("|")]
    if value is None and type(None) in allowed:
        return None
    if isinstance(value, bool) and bool not in allowed:
        raise ConfigError(f"{source}: '{key}' expects {annotation}, got {value!r}")
    if int in allowed and isinstance(value, int):
        return value
    if float in allowed and isinstance(value, int | float):
        return float(value)
    if str in allowed and isinstance(value, str):
        return value
    if bool in allowed and isinstance(value, bool):
        return value
    raise ConfigError(f"{source}: '{key}' expects {annotation}, got {value!r}")


# Bounds of values that are finite but absurd. Each refuses only what no run uses and what would
# otherwise crash deep inside a library or silently ruin the run (exit 0 with a NaN model):
# torch turns a learning rate or weight decay into a float32 (max 3.4e38: "value cannot be
# converted to type float without overflow"), time.sleep(1e300) overflows, a CPU count of 1e300
# cannot become a thread count.
MAX_LEARNING_RATE = 1e4  # a step of 1e4 x the gradient already diverges every model we train
MAX_WEIGHT_DECAY = 1e4  # idem: lr x weight_decay > 2 makes SGD diverge
# Adaptive server optimizers step by m / (sqrt(v) + eps). A tiny delta (|d| < 1e-162) has
# d^2 = 0: with a subnormal eps such as 1e-320 its step is m / eps, 1e150 and more. Useful eps
# values are 1e-8 .. 1e-1.
MIN_EPS = 1e-30
MAX_WAIT_S = 86_400.0  # one day: a longer straggler delay or round deadline is a typo
MAX_TASK_RESOURCES = 1024.0  # CPUs or GPUs of one task or actor: it runs on one machine
# Local epochs of one client in one round: the papers raysim reproduces use 1-20; 1e12 would
# make round 1 never end (the step count, epochs x batches, is bounded in raysim.core.loop).
MAX_LOCAL_EPOCHS = 10_000


def _validate(config: Config, source: str, resolve: bool = True) -> None:
    """Range checks that a type annotation cannot express; then the plug-ins' own checks
    (not when plug-ins are left unresolved, see `load`)."""

    def require(condition: bool, key: str, expected: str, value: Any) -> None:
        if not condition:
            raise ConfigError(f"{source}: '{key}' must be {expected}, got {value!r}")

    def finite(value: float) -> bool:
        return math.isfinite(value)

    run, part, clients = config.run, config.partition, config.clients
    require(
        bool(run.name) and not set(run.name) & {"/", "\\", "\0"},
        "run.name",
        "a non-empty name without '/', '\\' or NUL (it names the output folder)",
        run.name,
    )
    # A newline or a right-to-left override (U+202E) in a folder name forges what a listing or
    # a log line shows: no control (Cc) or formatting (Cf) character.
    require(
        not any(unicodedata.category(char) in ("Cc", "Cf") for char in run.name),
        "run.name",
        "a name without control or formatting characters (newline, tab, U+202E, ...)",
        run.name,
    )
    # A billion rounds (or clients) is beyond any simulation raysim can finish; more is a typo
    # that would otherwise surface as an allocation traceback (the client offsets, the
    # progress bar's arithmetic) or a run that never ends.
    require(1 <= run.rounds <= MAX_COUNT, "run.rounds", f">= 1 and <= {MAX_COUNT:.0e}", run.rounds)
    require(run.eval_every >= 1, "run.eval_every", ">= 1", run.eval_every)
    require(
        all(1 <= r <= run.rounds for r in run.eval_at),
        "run.eval_at",
        f"rounds in [1, run.rounds = {run.rounds}]",
        list(run.eval_at),
    )
    require(run.checkpoint_every >= 0, "run.checkpoint_every", ">= 0", run.checkpoint_every)
    require(run.keep_checkpoints >= 1, "run.keep_checkpoints", ">= 1", run.keep_checkpoints)
    require(run.seed >= 0, "run.seed", ">= 0", run.seed)
    require(run.max_idle_rounds >= 0, "run.max_idle_rounds", ">= 0", run.max_idle_rounds)
    deadline = run.round_deadline_s
    require(
        deadline is None or (deadline > 0 and finite(deadline)),
        "run.round_deadline_s",
        "a finite number of seconds > 0, or null",
        deadline,
    )
    require(
        deadline is None or deadline <= MAX_WAIT_S,
        "run.round_deadline_s",
        f"at most {MAX_WAIT_S:.0f} seconds (1 day), or null to wait for every client",
        deadline,
    )
    fraction = config.data.validation_fraction
    require(
        finite(fraction) and 0.0 <= fraction < 1.0,
        "data.validation_fraction",
        "in [0, 1)",
        fraction,
    )
    for key, path in (("data.root", config.data.root), ("partition.cache_dir", part.cache_dir)):
        require(path is None or (path != "" and "\0" not in path), key, "a path", path)
    require(
        1 <= part.num_clients <= MAX_COUNT,
        "partition.num_clients",
        f">= 1 and <= {MAX_COUNT:.0e}",
        part.num_clients,
    )
    from raysim.data.partition import check_partition_options

    try:  # the partitioner's own checks of its option values (dirichlet's alpha > 0, ...)
        if resolve:
            check_partition_options(part.name, part.options)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    require(clients.per_round >= 1, "clients.per_round", ">= 1", clients.per_round)
    require(
        clients.per_round <= part.num_clients,
        "clients.per_round",
        f"<= partition.num_clients ({part.num_clients})",
        clients.per_round,
    )
    require(clients.local_epochs >= 1, "clients.local_epochs", ">= 1", clients.local_epochs)
    require(
        clients.local_epochs <= MAX_LOCAL_EPOCHS,
        "clients.local_epochs",
        f"at most {MAX_LOCAL_EPOCHS:,} (epochs of one client in one round)",
        clients.local_epochs,
    )
    require(clients.batch_size >= 1, "clients.batch_size", ">= 1", clients.batch_size)
    require(clients.lr > 0, "clients.lr", "> 0", clients.lr)
    require(finite(clients.lr), "clients.lr", "finite", clients.lr)
    require(clients.lr <= MAX_LEARNING_RATE, "clients.lr", "in (0, 1e4]", clients.lr)
    require(0 <= clients.momentum < 1, "clients.momentum", "in [0, 1)", clients.momentum)
    require(clients.weight_decay >= 0, "clients.weight_decay", ">= 0", clients.weight_decay)
    require(finite(clients.weight_decay), "clients.weight_decay", "finite", clients.weight_decay)
    require(
        clients.weight_decay <= MAX_WEIGHT_DECAY,
        "clients.weight_decay",
        "in [0, 1e4]",
        clients.weight_decay,
    )
    require(
        clients.per_task == "auto" or (isinstance(clients.per_task, int) and clients.per_task >= 1),
        "clients.per_task",
        "'auto' or an integer >= 1",
        clients.per_task,
    )
    require(clients.num_cpus > 0, "clients.num_cpus", "> 0", clients.num_cpus)
    require(finite(clients.num_cpus), "clients.num_cpus", "finite", clients.num_cpus)
    require(clients.num_gpus >= 0, "clients.num_gpus", ">= 0", clients.num_gpus)
    require(finite(clients.num_gpus), "clients.num_gpus", "finite", clients.num_gpus)
    for key in ("num_cpus", "num_gpus"):
        value = getattr(clients, key)
        require(
            value <= MAX_TASK_RESOURCES,
            f"clients.{key}",
            f"at most {MAX_TASK_RESOURCES:.0f} (one client task runs on one machine)",
            value,
        )
    ratio = config.server.max_update_ratio
    require(ratio >= 0 and finite(ratio), "server.max_update_ratio", ">= 0", ratio)
    server_gpus = config.server.num_gpus
    require(server_gpus >= 0 and finite(server_gpus), "server.num_gpus", ">= 0", server_gpus)
    require(
        server_gpus <= MAX_TASK_RESOURCES,
        "server.num_gpus",
        f"at most {MAX_TASK_RESOURCES:.0f} (the server runs on one machine)",
        server_gpus,
    )
    require(clients.max_retries >= 0, "clients.max_retries", ">= 0", clients.max_retries)
    faults = config.faults
    for key in ("client_failure_rate", "hard_exit_fraction", "straggler_rate"):
        value = getattr(faults, key)
        require(0 <= value <= 1, f"faults.{key}", "in [0, 1]", value)
    require(
        faults.straggler_delay_s >= 0 and finite(faults.straggler_delay_s),
        "faults.straggler_delay_s",
        "a finite number of seconds >= 0",
        faults.straggler_delay_s,
    )
    require(
        faults.straggler_delay_s <= MAX_WAIT_S,
        "faults.straggler_delay_s",
        f"at most {MAX_WAIT_S:.0f} seconds (1 day)",
        faults.straggler_delay_s,
    )
    require(faults.seed >= 0, "faults.seed", ">= 0", faults.seed)
    attack = config.attack
    require(0 <= attack.fraction < 1, "attack.fraction", "in [0, 1)", attack.fraction)
    require(attack.pool_size >= 0, "attack.pool_size", ">= 0", attack.pool_size)
    if attack.name != "none" and attack.redraw_majority:
        # Rounds with >= half malicious clients are redrawn: some draw must have a majority
        # of honest clients, or the run could never sample a round.
        honest = part.num_clients - int(attack.fraction * part.num_clients)
        require(
            2 * (clients.per_round - min(honest, clients.per_round)) < clients.per_round,
            "attack.fraction",
            f"small enough that {clients.per_round} sampled clients can have an honest "
            f"majority (attack.redraw_majority is on; {honest} of {part.num_clients} "
            f"clients are honest)",
            attack.fraction,
        )
    server = config.server
    if resolve:
        registry.server_optimizers.get(server.optimizer)
    require(server.lr > 0, "server.lr", "> 0", server.lr)
    require(finite(server.lr), "server.lr", "finite", server.lr)
    require(server.lr <= MAX_LEARNING_RATE, "server.lr", "in (0, 1e4]", server.lr)
    require(0 <= server.momentum < 1, "server.momentum", "in [0, 1)", server.momentum)
    require(0 <= server.beta1 < 1, "server.beta1", "in [0, 1)", server.beta1)
    require(0 <= server.beta2 < 1, "server.beta2", "in [0, 1)", server.beta2)
    require(server.eps > 0, "server.eps", "> 0", server.eps)
    require(finite(server.eps), "server.eps", "finite", server.eps)
    require(server.eps >= MIN_EPS, "server.eps", ">= 1e-30 (and finite)", server.eps)
    index = config.index
    require(index.shards >= 1, "index.shards", ">= 1", index.shards)
    require(index.retrain_every >= 1, "index.retrain_every", ">= 1", index.retrain_every)
    for key in ("num_cpus", "num_gpus"):
        value = getattr(index, key)
        require(value >= 0, f"index.{key}", ">= 0", value)
        require(
            finite(value) and value <= MAX_TASK_RESOURCES,
            f"index.{key}",
            f"finite and at most {MAX_TASK_RESOURCES:.0f} (a shard actor runs on one machine)",
            value,
        )
    require(
        config.runtime.backend in registry.backends or not resolve,
        "runtime.backend",
        f"one of {', '.join(registry.backends.names())} or package.module:Class",
        config.runtime.backend,
    )
    if resolve and ":" in config.runtime.backend:
        registry.backends.get(config.runtime.backend)  # imported here: it runs in the driver
    if resolve and ":" in index.backend:  # imported in the driver: the module ships to Ray
        registry.indexes.get(index.backend)
    require(
        config.runtime.num_cpus is None or config.runtime.num_cpus >= 1,
        "runtime.num_cpus",
        ">= 1",
        config.runtime.num_cpus,
    )
    require(
        bool(config.runtime.dashboard_host),
        "runtime.dashboard_host",
        "a host address",
        config.runtime.dashboard_host,
    )
    require(
        config.runtime.address is None or bool(config.runtime.address),
        "runtime.address",
        "'auto', 'ray://host:port' or null",
        config.runtime.address,
    )
    if resolve:
        _check_plugins(config, source)


def _check_plugins(config: Config, source: str) -> None:
    """Build the algorithm, aggregator and attack once, so their option checks (FRL's k in
    (0, 1], TopK's fraction, ...) fail when the config is read rather than when the run starts.
    Their constructors only store and check options. Datasets and models are checked when
    they are built (they need files and the data's shape)."""
    chosen = [("algorithm", registry.algorithms, config.algorithm)]
    if config.aggregator.name != "auto":
        chosen.append(("aggregator", registry.aggregators, config.aggregator))
    if config.codec.name != "auto":
        chosen.append(("codec", registry.codecs, config.codec))
    if config.attack.name != "none":
        chosen.append(("attack", registry.attacks, config.attack))
    for section, reg, plugin in chosen:
        try:
            reg.build(plugin.name, **plugin.options)
        except ConfigError:
            raise
        except (TypeError, ValueError, ArithmeticError) as error:
            raise ConfigError(
                f"{source}: options of {section} '{plugin.name}' rejected: {error}"
            ) from None
