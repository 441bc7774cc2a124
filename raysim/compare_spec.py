"""A comparison spec (`raysim compare SPEC.yaml`, its format in raysim.compare): read and checked
into a `Comparison` of `Method`s, each with its own search space and the same budget."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raysim import config as config_module
from raysim.config import Config
from raysim.errors import ConfigError
from raysim.tune_space import SweepSpec, parse_spec

COMPARE_KEYS = {
    "metric": str,
    "mode": str,
    "trials": int,
    "scheduler": str,
    "grace_period": int,
    "reduction_factor": float,
    "seeds": list,
    "report": list,
    "reference": str,
    "search_seed": int,
    "allow_test_metric": bool,
}


@dataclasses.dataclass(frozen=True)
class Method:
    name: str
    config: Config  # the base config with the comparison's and the method's overrides
    spec: SweepSpec  # the method's space under the comparison's budget

    def run_dir(self, out_dir: Path, scenario: str | None, seed: int) -> Path:
        """Where the winner's re-run on `seed` under `scenario` (None: no scenarios) lives."""
        base = out_dir / self.name if scenario is None else out_dir / self.name / scenario
        return base / f"seed_{seed}"

    def rerun_config(
        self, winner: Config, scenario: str | None, scenario_overrides: Sequence[str], seed: int
    ) -> Config:
        """The config of the winner's re-run on `seed` under `scenario` (its overrides)."""
        return config_module.from_dict(
            winner.to_dict(),
            [*scenario_overrides, f"run.seed={seed}"],
            source=f"method {self.name}, scenario {scenario}",
        )


@dataclasses.dataclass(frozen=True)
class Comparison:
    methods: tuple[Method, ...]
    metric: str
    mode: str
    trials: int  # per method: compare.trials x the points of each method's grid (equal)
    seeds: tuple[int, ...]
    report: tuple[str, ...]
    reference: str
    source: str
    # name -> overrides of each re-run; {None: ()} when the spec names no scenarios
    scenarios: Mapping[str | None, tuple[str, ...]] = dataclasses.field(
        default_factory=lambda: {None: ()}
    )


def _overrides(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of 'section.key=value' strings")
    return list(value)


def load_comparison(path: str | Path, overrides: Sequence[str] = ()) -> Comparison:
    """Read and check a comparison spec; `overrides` (as `--set`) apply to every method."""
    path = Path(path)
    raw = config_module.read_yaml_mapping(path, "comparison spec", "with base, compare and methods")
    unknown = set(raw) - {"base", "set", "compare", "methods", "scenarios"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; expected base, set, "
                          "compare, methods, scenarios")  # fmt: skip
    if not isinstance(raw.get("base"), str):
        raise ConfigError(f"{path}: 'base' must name the experiment config file")
    base_path = _config_path(path, raw["base"])
    shared = _overrides(raw.get("set"), f"{path}: 'set'") + list(overrides)
    section = raw.get("compare")
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: 'compare' must be a mapping (metric, trials, seeds, ...)")
    for key, value in section.items():
        if key not in COMPARE_KEYS:
            raise ConfigError(f"{path}: unknown key 'compare.{key}'; valid: {list(COMPARE_KEYS)}")
        expected = COMPARE_KEYS[key]
        fits = isinstance(value, expected) or (expected is float and isinstance(value, int))
        if not fits or (isinstance(value, bool) and expected is not bool):
            raise ConfigError(
                f"{path}: 'compare.{key}' must be a {expected.__name__}, got {value!r}"
            )
    trials = section.get("trials", 4)
    seeds = section.get("seeds", [0, 1, 2])
    if trials < 1:
        raise ConfigError(f"{path}: 'compare.trials' must be >= 1, got {trials}")
    if (
        len(seeds) < 2
        or len(set(seeds)) != len(seeds)
        or not all(isinstance(s, int) and s >= 0 for s in seeds)
    ):
        raise ConfigError(
            f"{path}: 'compare.seeds' must be at least 2 distinct seeds >= 0 (a spread needs "
            f"them; 3 or more for a table), got {seeds}"
        )
    methods_raw = raw.get("methods")
    if not isinstance(methods_raw, dict) or len(methods_raw) < 2:
        raise ConfigError(f"{path}: 'methods' must map at least 2 method names to their set/space")
    metric = section.get("metric", "val/accuracy")
    mode = section.get("mode", "max")
    scenarios = _scenarios(raw.get("scenarios"), path)
    methods = []
    grid_points: dict[str, int] = {}  # method -> points of its grid (1: no grid key)
    for name, entry in methods_raw.items():
        where = f"{path}: method '{name}'"
        if not isinstance(entry, dict) or set(entry) - {"set", "space", "base"}:
            raise ConfigError(f"{where} must be a mapping with 'set' and 'space' (and 'base')")
        if "base" in entry and not isinstance(entry["base"], str):
            raise ConfigError(f"{where}: 'base' must name an experiment config file")
        space = entry.get("space")
        if not isinstance(space, dict) or not space:
            raise ConfigError(
                f"{where}: 'space' must name at least one hyperparameter: every method gets "
                f"{trials} trials of tuning, an untuned one would be compared unfairly"
            )
        grid_points[str(name)] = _grid_points(space, where)
        method_base = _config_path(path, entry["base"]) if "base" in entry else base_path
        config = config_module.load(method_base, [*shared, *_overrides(entry.get("set"), where)])
        for scenario, scenario_overrides in scenarios.items():
            tuned = {o.split("=", 1)[0].strip() for o in scenario_overrides} & set(space)
            if tuned:
                raise ConfigError(
                    f"{path}: scenario '{scenario}' sets {sorted(tuned)}, which method '{name}' "
                    "tunes: the re-run would not be the tuned winner"
                )
            try:  # checked now, not after hours of tuning
                config_module.from_dict(config.to_dict(), scenario_overrides)
            except ConfigError as error:
                raise ConfigError(f"{where}, scenario '{scenario}': {error}") from None
        tune_section = {
            "metric": metric,
            "mode": mode,
            "num_samples": trials,
            "scheduler": section.get("scheduler", "fifo"),
            "seed": section.get("search_seed", 0),
            "space": space,
        }
        for key in ("grace_period", "reduction_factor", "allow_test_metric"):
            if key in section:
                tune_section[key] = section[key]
        spec = parse_spec(tune_section, config, source=where)
        methods.append(Method(str(name), config, spec))
    if len(set(grid_points.values())) > 1:
        points = ", ".join(f"{name} {count}" for name, count in grid_points.items())
        raise ConfigError(
            f"{path}: the methods' grids have different numbers of points ({points}); every "
            "method must get the same budget: give each a grid of the same size (or none)"
        )
    report = tuple(section.get("report", [metric.split("/", 1)[-1]]))
    reference = section.get("reference", methods[0].name)
    if reference not in {m.name for m in methods}:
        raise ConfigError(f"{path}: 'compare.reference' {reference!r} is not one of the methods")
    rounds = {m.config.run.rounds for m in methods}
    if len(rounds) != 1:
        raise ConfigError(
            f"{path}: every method must run the same rounds (an equal budget); got {sorted(rounds)}"
        )
    # A grid runs every point `trials` times (Ray Tune's num_samples), so the budget per method
    # is trials x points, the same for every method (checked above).
    budget = trials * next(iter(grid_points.values()))
    return Comparison(
        tuple(methods), metric, mode, budget, tuple(seeds), report, reference, str(path), scenarios
    )


def _grid_points(space: Mapping[str, Any], where: str) -> int:
    """How many points a method's grid keys span together (1 without any). A grid is how a
    comparison brackets a winner deterministically: every method runs all of its points."""
    points = 1
    for domain in space.values():
        if isinstance(domain, list):
            points *= len(domain)
        elif isinstance(domain, dict) and "grid" in domain:
            values = domain["grid"]
            if not isinstance(values, list) or not values:
                raise ConfigError(f"{where}: a grid must list at least one value, got {values!r}")
            points *= len(values)
    return points


def _config_path(spec_path: Path, name: str) -> Path:
    """An experiment config named in a spec: relative to the spec's folder, else as given."""
    candidate = (spec_path.parent / name).resolve()
    return candidate if candidate.is_file() else Path(name).resolve()


SCENARIO_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _scenarios(value: Any, path: Path) -> dict[str | None, tuple[str, ...]]:
    if value is None:
        return {None: ()}
    if not isinstance(value, dict) or not value:
        raise ConfigError(f"{path}: 'scenarios' must map scenario names to lists of overrides")
    scenarios: dict[str | None, tuple[str, ...]] = {}
    for name, overrides in value.items():
        if not isinstance(name, str) or not SCENARIO_NAME.fullmatch(name):
            raise ConfigError(
                f"{path}: scenario name {name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                "(it names the re-runs' folder)"
            )
        scenarios[name] = tuple(_overrides(overrides, f"{path}: scenario '{name}'"))
    return scenarios
