"""A sweep's spec: the `tune:` section of a sweep config (see raysim.tune for its keys) parsed
and checked against the experiment it sweeps, its search dimensions (`Domain`), and a trial's
params applied to the experiment's config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from raysim import config as config_module
from raysim.config import Config
from raysim.errors import ConfigError, closest

DOMAIN_KINDS = ("grid", "choice", "uniform", "loguniform", "randint")
SCHEDULERS = ("fifo", "asha")
# Per-round values a trial can report besides eval/<metric> (see core/loop.py's round record).
ROUND_VALUES = (
    "train_loss",
    "update_norm_mean",
    "bytes_up",
    "bytes_down",
    "clients_done",
    "clients_failed",
    "wall_s",
    "elapsed_s",
)
# Resources are fixed per sweep (they shape every trial's placement group).
UNTUNABLE = ("clients.num_cpus", "clients.num_gpus", "runtime.backend", "runtime.address")


@dataclasses.dataclass(frozen=True)
class Domain:
    """One search dimension: `kind` in DOMAIN_KINDS with its values or bounds."""

    key: str
    kind: str
    values: tuple[Any, ...]

    def to_tune(self, tune) -> Any:
        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        low, high = self.values
        return {"uniform": tune.uniform, "loguniform": tune.loguniform, "randint": tune.randint}[
            self.kind
        ](low, high)

    def probes(self) -> list[Any]:
        """Values that must all make a valid config (checked before anything starts)."""
        if self.kind in ("grid", "choice"):
            return list(self.values)
        low, high = self.values
        return [low, high - 1] if self.kind == "randint" else [low, high]


@dataclasses.dataclass(frozen=True)
class SweepSpec:
    space: tuple[Domain, ...]
    metric: str = "val/accuracy"
    mode: str = "max"
    # Tuning on the test split (eval/...) leaks it into the result: refused unless set.
    allow_test_metric: bool = False
    num_samples: int = 1
    scheduler: str = "fifo"
    grace_period: int = 1
    reduction_factor: float = 2.0
    max_concurrent_trials: int | None = None
    client_slots: int = 1
    server_cpus: float = 0.0
    seed: int = 0


_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(SweepSpec)}


def parse_spec(section: Mapping[str, Any], config: Config, source: str = "config") -> SweepSpec:
    """Validate a `tune:` section against the experiment it sweeps."""
    section = dict(section)
    for key in section:
        if key not in _SPEC_FIELDS:
            raise ConfigError(
                f"{source}: unknown key 'tune.{key}'{closest(key, list(_SPEC_FIELDS))}; "
                f"valid keys: {', '.join(_SPEC_FIELDS)}"
            )
    raw_space = section.pop("space", None)
    if not isinstance(raw_space, Mapping) or not raw_space:
        raise ConfigError(
            f"{source}: 'tune.space' must map config keys to domains, "
            "e.g. 'clients.lr: {loguniform: [0.005, 0.5]}'"
        )
    space = tuple(_parse_domain(key, value, config, source) for key, value in raw_space.items())
    kwargs: dict[str, Any] = {}
    for key, value in section.items():
        kwargs[key] = config_module._coerce(value, _SPEC_FIELDS[key].type, f"tune.{key}", source)
    spec = SweepSpec(space=space, **kwargs)

    def require(condition: bool, key: str, expected: str, value: Any) -> None:
        if not condition:
            raise ConfigError(f"{source}: 'tune.{key}' must be {expected}, got {value!r}")

    require(spec.mode in ("min", "max"), "mode", "'min' or 'max'", spec.mode)
    require(spec.scheduler in SCHEDULERS, "scheduler", "'fifo' or 'asha'", spec.scheduler)
    require(spec.num_samples >= 1, "num_samples", ">= 1", spec.num_samples)
    require(spec.client_slots >= 1, "client_slots", ">= 1", spec.client_slots)
    require(spec.server_cpus >= 0, "server_cpus", ">= 0", spec.server_cpus)
    require(spec.seed >= 0, "seed", ">= 0", spec.seed)
    require(
        spec.max_concurrent_trials is None or spec.max_concurrent_trials >= 1,
        "max_concurrent_trials",
        ">= 1",
        spec.max_concurrent_trials,
    )
    require(
        spec.metric.startswith(("val/", "eval/")) or spec.metric in ROUND_VALUES,
        "metric",
        f"val/<name> (e.g. val/accuracy) or one of {', '.join(ROUND_VALUES)}",
        spec.metric,
    )
    if spec.metric.startswith("eval/") and not spec.allow_test_metric:
        name = spec.metric.removeprefix("eval/")
        raise ConfigError(
            f"{source}: 'tune.metric' {spec.metric} is measured on the test split, and "
            "hyperparameters chosen on it overstate how well they generalise; tune on "
            f"val/{name} (with data.validation_fraction > 0, e.g. 0.1), or set "
            "tune.allow_test_metric: true to tune on test data knowingly"
        )
    if spec.metric.startswith("val/") and config.data.validation_fraction <= 0:
        raise ConfigError(
            f"{source}: 'tune.metric' {spec.metric} needs a validation split: set "
            "data.validation_fraction (e.g. 0.1), which holds that share of the training rows "
            "out of every client"
        )
    if spec.scheduler == "asha":
        rounds = config.run.rounds
        require(spec.grace_period >= 1, "grace_period", ">= 1", spec.grace_period)
        require(spec.grace_period <= rounds, "grace_period", f"<= run.rounds ({rounds})", rounds)
        require(spec.reduction_factor > 1, "reduction_factor", "> 1", spec.reduction_factor)
        if any(domain.key == "run.rounds" for domain in space):
            raise ConfigError(
                f"{source}: 'tune.space' cannot sweep run.rounds with scheduler asha "
                "(ASHA counts progress in rounds); use scheduler: fifo"
            )
    return spec


def _parse_domain(key: str, value: Any, config: Config, source: str) -> Domain:
    where = f"{source}: 'tune.space.{key}'"
    if not isinstance(key, str) or key.count(".") != 1:
        raise ConfigError(f"{where}: keys look like section.key (as with --set)")
    if key in UNTUNABLE:
        raise ConfigError(
            f"{where}: {key} is fixed for a sweep (it shapes every trial's resources)"
        )
    if isinstance(value, list):  # a plain list is a grid
        value = {"grid": value}
    if not isinstance(value, Mapping) or len(value) != 1:
        raise ConfigError(
            f"{where}: expected one of {', '.join(DOMAIN_KINDS)} with its values, "
            "e.g. {choice: [0.01, 0.1]} or {uniform: [0.1, 0.9]}"
        )
    ((kind, values),) = value.items()
    if kind not in DOMAIN_KINDS:
        raise ConfigError(
            f"{where}: unknown domain '{kind}'{closest(str(kind), list(DOMAIN_KINDS))}; "
            f"choices: {', '.join(DOMAIN_KINDS)}"
        )
    if not isinstance(values, list) or not values:
        raise ConfigError(f"{where}: '{kind}' needs a non-empty list")
    if kind in ("uniform", "loguniform", "randint"):
        numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        if len(values) != 2 or not numbers or not values[0] < values[1]:
            raise ConfigError(f"{where}: '{kind}' needs [low, high] with low < high")
        if kind == "loguniform" and values[0] <= 0:
            raise ConfigError(f"{where}: 'loguniform' needs low > 0")
        if kind == "randint" and not all(isinstance(v, int) for v in values):
            raise ConfigError(f"{where}: 'randint' needs integer bounds [low, high) ")
    domain = Domain(key, kind, tuple(values))
    for probe in domain.probes():
        try:
            apply_params(config, {key: probe})
        except ConfigError as error:
            raise ConfigError(
                f"{where}: value {probe!r} gives an invalid config: {error}"
            ) from None
    return domain


def apply_params(config: Config, params: Mapping[str, Any]) -> Config:
    """`config` with `section.key: value` params applied (validated like any config)."""
    raw = config.to_dict()
    for key, value in params.items():
        section, name = key.split(".")
        raw.setdefault(section, {})[name] = python_value(value)
    return config_module.from_dict(raw, source="tune")


def python_value(value: Any) -> Any:
    """A sampled value as plain Python (Tune hands out numpy scalars), for a config."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [python_value(v) for v in value]
    return value
