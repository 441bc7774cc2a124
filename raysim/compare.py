"""Comparisons that survive a reviewer: `raysim compare SPEC.yaml`.

Every method of a comparison gets the same tuning budget: the same number of trials, the same
scheduler and the same rounds, each over its own search space, scored on the validation split
(never on test). Each method's winner is then re-run on every seed of `seeds`, and the report
gives its test metrics as mean ± std with every per-seed value, and its ratio to the reference
method, paired by seed, with its spread. A spec:

    base: fedaws_synthetic_xml.yaml       # the experiment config (relative to this file)
    set: [data.validation_fraction=0.1]   # overrides every method gets
    compare:
      metric: val/p@1                     # what tuning maximises (mode: max) or minimises
      mode: max
      trials: 4                           # per method: the equal budget
      scheduler: fifo                     # or asha (grace_period, reduction_factor)
      seeds: [0, 1, 2]                    # the winners' re-runs
      report: [p@1, p@3, p@5]             # test metrics in the table (the first is the ratio's)
      reference: softmax                  # ratios are method / reference, per seed
      search_seed: 0                      # the seed of every method's search
    scenarios:                            # optional: the winners are re-run under each
      clean: []                           # (tuning is on the method's config as it stands)
      malicious_20pct: [attack.fraction=0.2]
    methods:
      fedaws:
        set: [algorithm.name=fedaws]
        space: {algorithm.class_lr: {loguniform: [0.01, 1.0]}}
      softmax:
        set: ["algorithm={name: fedaws_softmax}"]
        space: {clients.lr: {loguniform: [0.01, 1.0]}}
      frl:
        base: frl_digits.yaml             # a method may start from its own experiment config
        space: {clients.lr: {loguniform: [0.1, 2.0]}}

Scenarios are what a method must withstand without being tuned for it (an attack, a data
shift): the winner chosen on the method's own validation runs is re-run under each scenario's
overrides, so a defence is not tuned against the attack it is scored on. A scenario may not set
a key of a method's search space (that would replace the tuned value).

Tuning runs through `raysim.tune.run_sweep` (Ray Tune; the trials on the seed of the base
config), the re-runs through THE round loop. Outputs: OUT/METHOD/tune/ (the sweep),
OUT/METHOD/seed_S/ (each re-run; OUT/METHOD/SCENARIO/seed_S/ with scenarios),
OUT/comparison.md and .json, OUT/comparison.png (the first report metric against the round per
method, and its ratio to the reference method: the mean over seeds with a min-max band; a row
per scenario), built and written by raysim.compare_report.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from raysim import config as config_module
from raysim.compare_report import build_report, write_report
from raysim.config import Config
from raysim.errors import ConfigError, RaysimError
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


@dataclasses.dataclass(frozen=True)
class Comparison:
    methods: tuple[Method, ...]
    metric: str
    mode: str
    trials: int
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
        for key, domain in space.items():
            if isinstance(domain, list) or (isinstance(domain, dict) and "grid" in domain):
                raise ConfigError(
                    f"{where}: space key {key} is a grid, which runs its own number of trials; "
                    "use {choice: [...]} so every method gets the same budget"
                )
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
    report = tuple(section.get("report", [metric.split("/", 1)[-1]]))
    reference = section.get("reference", methods[0].name)
    if reference not in {m.name for m in methods}:
        raise ConfigError(f"{path}: 'compare.reference' {reference!r} is not one of the methods")
    rounds = {m.config.run.rounds for m in methods}
    if len(rounds) != 1:
        raise ConfigError(
            f"{path}: every method must run the same rounds (an equal budget); got {sorted(rounds)}"
        )
    return Comparison(
        tuple(methods), metric, mode, trials, tuple(seeds), report, reference, str(path), scenarios
    )


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


def run_comparison(
    comparison: Comparison, out_dir: str | Path, *, address: str | None = None
) -> dict[str, Any]:
    """Tune every method with the same budget, re-run the winners on every seed, report."""
    from raysim import tune
    from raysim.assembly import run
    from raysim.runtime import ray_cluster

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runtime = comparison.methods[0].config.runtime
    started_ray = ray_cluster.connect(runtime, address)  # one Ray for every sweep and re-run
    results: dict[str, Any] = {}
    try:
        for method in comparison.methods:
            print(f"\n== {method.name}: tuning ({comparison.trials} trials) ==", flush=True)
            sweep = tune.run_sweep(
                method.config, method.spec, out_dir / method.name / "tune", address=address
            )
            if sweep.best_config is None:
                raise RaysimError(f"method {method.name}: no trial ran every round")
            runs: dict[str | None, dict[int, Any]] = {}
            for scenario, scenario_overrides in comparison.scenarios.items():
                runs[scenario] = {}
                for seed in comparison.seeds:
                    under = "" if scenario is None else f", scenario {scenario}"
                    print(f"== {method.name}: seed {seed}{under} ==", flush=True)
                    config = config_module.from_dict(
                        sweep.best_config.to_dict(),
                        [*scenario_overrides, f"run.seed={seed}"],
                        source=f"method {method.name}, scenario {scenario}",
                    )
                    result = run(
                        config,
                        method.run_dir(out_dir, scenario, seed),
                        address=address,
                        progress=False,
                        overwrite=True,  # the comparison's own folders
                    )
                    runs[scenario][seed] = result.summary
            results[method.name] = {
                "best_params": sweep.best["params"],
                "best_validation": sweep.best[comparison.metric],
                "trials": len(sweep.rows),
                "trials_completed": sum(row["status"] == "completed" for row in sweep.rows),
                "runs": runs,
            }
    finally:
        if started_ray:
            ray_cluster.disconnect()
    report = build_report(comparison, results)
    report["wall_s"] = time.perf_counter() - started
    write_report(comparison, report, out_dir)
    print("\n" + report["table"], flush=True)
    print(f"\nwrote {out_dir / 'comparison.md'}, comparison.json and comparison.png", flush=True)
    return report


def report_from_folders(comparison: Comparison, out_dir: str | Path) -> dict[str, Any]:
    """The report of a comparison whose sweeps and re-runs are already in `out_dir` (e.g. to
    redraw it, or after a run stopped between methods): each method's tuning from its
    OUT/METHOD/tune/tune_results.csv, its re-runs' summary.json files. Nothing is trained."""
    import csv

    out_dir = Path(out_dir)
    results: dict[str, Any] = {}
    for method in comparison.methods:
        table = out_dir / method.name / "tune" / "tune_results.csv"
        if not table.is_file():
            raise RaysimError(f"method {method.name}: no sweep results at {table}")
        with table.open(newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("status") == "completed"]
        scored = [row for row in rows if row.get(comparison.metric) not in (None, "")]
        if not scored:
            raise RaysimError(f"{table}: no completed trial has {comparison.metric}")
        pick = max if comparison.mode == "max" else min
        best = pick(scored, key=lambda row: float(row[comparison.metric]))
        params = {}
        for domain in method.spec.space:
            text = best[domain.key]
            params[domain.key] = int(text) if domain.kind == "randint" else _number(text)
        runs: dict[str | None, dict[int, Any]] = {}
        for scenario in comparison.scenarios:
            runs[scenario] = {}
            for seed in comparison.seeds:
                path = method.run_dir(out_dir, scenario, seed) / "summary.json"
                if not path.is_file():
                    raise RaysimError(f"method {method.name}: re-run missing: {path}")
                runs[scenario][seed] = json.loads(path.read_text())
        results[method.name] = {
            "best_params": params,
            "best_validation": float(best[comparison.metric]),
            "trials": len(rows),
            "runs": runs,
        }
    report = build_report(comparison, results)
    write_report(comparison, report, out_dir)
    print(report["table"], flush=True)
    print(f"\nwrote {out_dir / 'comparison.md'}, comparison.json and comparison.png", flush=True)
    return report


def _number(text: str) -> Any:
    """A CSV cell back to the value a choice/uniform domain sampled (int, float or text)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text
