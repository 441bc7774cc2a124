"""Hyperparameter sweeps with Ray Tune: `raysim tune CONFIG`. The only module importing ray.tune.

A sweep config is an ordinary experiment config plus a `tune:` section:

    tune:
      metric: val/accuracy       # any per-round value: val/<metric>, train_loss, bytes_up, ...
      mode: max                  # or min
      num_samples: 8             # samples of the space (grid values are repeated this often)
      scheduler: asha            # or fifo; ASHA stops weak trials early, counted in rounds
      grace_period: 5            # ASHA: rounds before a trial may be stopped
      reduction_factor: 2        # ASHA: keep the best 1/reduction_factor at each rung
      max_concurrent_trials: 2   # default: as many as the reserved resources allow
      client_slots: 1            # client tasks a trial runs at once (each clients.num_cpus CPUs)
      server_cpus: 0             # CPUs reserved for a trial's server actor and driver
      seed: 0                    # seed of the search (which points are sampled)
      space:
        clients.lr: {loguniform: [0.005, 0.5]}
        clients.momentum: {choice: [0.0, 0.9]}
        clients.local_epochs: {randint: [1, 6]}   # high excluded
        partition.alpha: {grid: [0.1, 1.0]}
        algorithm.k: {uniform: [0.1, 0.9]}

Each trial is one simulation through THE round loop (`raysim.core.loop.run`), writing its usual
outputs to OUT/trials/TRIAL_ID and reporting its round record to Tune every round that has the
metric (so ASHA compares trials at equal rounds). A trial reserves a placement group: an empty
or `server_cpus` head bundle for the trial's driver and server actor, plus `client_slots`
bundles of clients.num_cpus (and clients.num_gpus). Ray places every task and actor a trial
starts, and theirs, in that group (Tune's placement groups capture child tasks), so concurrent
trials never oversubscribe the machine and a trial's client tasks run only on its own slots.

Outputs: OUT/tune_results.csv (one row per trial), a printed table, and OUT/best_config.yaml:
the best trial's resolved config without the `tune:` section, which `raysim run` accepts and
which reproduces that trial exactly (every run is deterministic given its config). The best
trial is the best among those that ran every round (ASHA's stopped trials ended earlier).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from raysim import config as config_module
from raysim.config import Config
from raysim.errors import ConfigError, RaysimError, closest

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


# --- loading ---------------------------------------------------------------------------------


# What `raysim tune` keeps in OUT to continue a sweep (`raysim tune --resume OUT`): the sweep
# file as given and its --set/--unset overrides.
SWEEP_FILE, SWEEP_OVERRIDES = "sweep.yaml", "sweep_overrides.json"


def save_sweep(out_dir: str | Path, path: str | Path, overrides: Sequence[str]) -> None:
    """Keep the sweep's file and overrides in `out_dir`, for `raysim tune --resume OUT`."""
    import json

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / SWEEP_FILE).write_text(Path(path).read_text())
    (out_dir / SWEEP_OVERRIDES).write_text(json.dumps(list(overrides)))


def load_saved_sweep(out_dir: str | Path, *, trust_plugins: bool = False):
    """The sweep a folder of `raysim tune` ran (save_sweep). A folder whose config names
    plug-ins by import path needs `trust_plugins`: the folder may be someone else's, and
    continuing it imports and runs that code (as `raysim run --resume`)."""
    import json

    from raysim.plugins import import_paths_in

    out_dir = Path(out_dir)
    path, saved = out_dir / SWEEP_FILE, out_dir / SWEEP_OVERRIDES
    if not path.is_file() or not saved.is_file():
        raise RaysimError(
            f"cannot resume {out_dir}: it holds no sweep of `raysim tune` ({SWEEP_FILE} and "
            f"{SWEEP_OVERRIDES} are written when a sweep starts)"
        )
    try:
        overrides = json.loads(saved.read_text())
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ValueError("not a list of strings")
    except ValueError as error:
        raise RaysimError(f"cannot resume {out_dir}: {saved} is unreadable ({error})") from None
    raw = config_module.read_yaml_mapping(path, "config file", "of sections")
    raw.pop("tune", None)
    plain = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("tune.")]
    named = import_paths_in(config_module.from_dict(raw, plain, resolve_plugins=False))
    if named and not trust_plugins:
        raise RaysimError(
            f"cannot resume {out_dir}: its sweep names plug-in code by import path "
            f"({', '.join(named)}), which resuming would import and run; if you trust that "
            "code, resume with --trust-plugins"
        )
    return load_sweep(path, overrides)


def load_sweep(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Config, SweepSpec]:
    """Read a sweep YAML: the experiment config (without `tune:`) and the sweep's spec.

    `--set tune.num_samples=4` style overrides change the tune section; others the experiment.
    """
    path = Path(path)
    raw = config_module.read_yaml_mapping(path, "config file", "of sections")
    tune_section = raw.pop("tune", None)
    if tune_section is None:
        raise ConfigError(
            f"{path}: no 'tune:' section; `raysim tune` needs one (see configs/tune_*.yaml)"
        )
    if not isinstance(tune_section, dict):
        raise ConfigError(f"{path}: 'tune' must be a mapping of keys")
    tune_section = dict(tune_section)
    experiment_overrides = []
    for override in overrides:
        key, sep, text = override.partition("=")
        if key.strip().startswith("tune."):
            name = key.strip().removeprefix("tune.")
            tune_section[name] = yaml.load(text, Loader=config_module._YamlLoader)
        else:
            experiment_overrides.append(override)
    config = config_module.from_dict(raw, experiment_overrides, source=str(path))
    spec = parse_spec(tune_section, config, source=str(path))
    return config, spec


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
        raw.setdefault(section, {})[name] = _python_value(value)
    return config_module.from_dict(raw, source="tune")


def _python_value(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [_python_value(v) for v in value]
    return value


# --- trials ----------------------------------------------------------------------------------


def trial_bundles(config: Config, spec: SweepSpec) -> list[dict[str, float]]:
    """A trial's placement group: head (driver, server actor and any index shard actors), then
    one bundle per client slot."""
    clients = config.clients
    slot = {"CPU": clients.num_cpus}
    if clients.num_gpus:
        slot["GPU"] = clients.num_gpus
    server_gpus = config.server.num_gpus
    if config.runtime.backend == "local":  # clients and server run in the trial's own process
        gpus = max(clients.num_gpus, server_gpus)
        return [{"CPU": max(spec.server_cpus, clients.num_cpus), **({"GPU": gpus} if gpus else {})}]
    head = {"CPU": spec.server_cpus, **({"GPU": server_gpus} if server_gpus else {})}
    index = getattr(config, "index", None)
    if index is not None and index.shards > 1:  # FedAwS's index shard actors (one per shard)
        head["CPU"] += index.num_cpus * index.shards
        if index.num_gpus:
            head["GPU"] = head.get("GPU", 0.0) + index.num_gpus * index.shards
    return [head] + [dict(slot) for _ in range(spec.client_slots)]


def flatten_record(record: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric values of a round record as `a/b` keys (the TensorBoard names)."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_record(value, f"{name}/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = value
    return flat


def _trial(params: dict, *, base: Config, metric: str, out_root: str, cwd: str) -> None:
    """One simulation, reporting every round that has the metric to Tune."""
    from ray import tune

    from raysim.core.loop import run

    if os.path.isdir(cwd):  # relative data.root / cache_dir resolve as in `raysim run`
        os.chdir(cwd)
    config = apply_params(base, params)
    trial_id = tune.get_context().get_trial_id()
    out = Path(out_root) / "trials" / trial_id
    last: list[dict[str, Any]] = []

    def on_round(record: dict[str, Any]) -> None:
        flat = flatten_record(record)
        if metric not in flat:
            if "eval" in record:
                raise ConfigError(
                    f"tune.metric '{metric}' is not in the round record; "
                    f"available: {', '.join(sorted(flat))}"
                )
            return
        report = {**flat, "trial_out": str(out)}
        if record["round"] == config.run.rounds:
            last.append(report)  # reported once the run has written its summary
        else:
            tune.report(report)

    # The folder is this trial's own: a retry of the trial (Tune's failure handling) starts
    # it over, replacing what the failed attempt wrote.
    run(config, out, progress=False, tensorboard=True, on_round=on_round, overwrite=True)
    # Tune may stop the trial as soon as it sees the last round (ASHA does at max_t), so the
    # last report waits until the final checkpoint and summary.json are on disk.
    for report in last:
        tune.report(report)


# --- the sweep -------------------------------------------------------------------------------


@dataclasses.dataclass
class SweepResult:
    rows: list[dict[str, Any]]  # one per trial, best first
    best: dict[str, Any] | None
    best_config: Config | None
    out_dir: Path
    # "SIGTERM" or "Ctrl-C" when the sweep was stopped before every trial ran (the finished
    # trials' results and best config are written; `raysim tune --resume OUT` continues)
    interrupted: str | None = None
    expected_trials: int = 0


def run_sweep(
    config: Config,
    spec: SweepSpec,
    out_dir: str | Path,
    *,
    address: str | None = None,
    verbose: int = 0,
    resume: bool = False,
) -> SweepResult:
    """Run the sweep; writes OUT/tune_results.csv and OUT/best_config.yaml.

    Ctrl-C or SIGTERM stops it as Tune does (the trials in progress are stopped, Tune's
    experiment state saved), and the finished trials' results and best config are written
    all the same (`SweepResult.interrupted`). `resume` continues the sweep in `out_dir` with
    Tune's restore (`Tuner.restore`): finished trials are reused, unfinished ones run again
    (each is deterministic given its config), and the trials not yet started are started."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    from raysim.runtime import ray_backend

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Tune replaces the process's SIGINT handler and leaves it so: restored below, or a later
    # run in this process (`raysim compare` re-runs the winners) would not stop on Ctrl-C.
    sigint_handler = signal.getsignal(signal.SIGINT)
    # Trials work in the driver's folder (relative paths mean the same as in `raysim run`).
    previous_chdir = os.environ.get("RAY_CHDIR_TO_TRIAL_DIR")
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # Tune passes it on to the trials
    started_ray = ray_backend.connect(config.runtime, address)
    try:
        bundles = trial_bundles(config, spec)
        _check_fits(bundles, ray.cluster_resources())
        print(
            f"raysim tune: {config.run.name}, {spec.metric} ({spec.mode}), scheduler "
            f"{spec.scheduler}; each trial reserves {bundles}\n"
            f"TensorBoard (every trial): tensorboard --logdir {out_dir / 'trials'}",
            flush=True,
        )
        trainable = tune.with_resources(
            tune.with_parameters(
                _trial, base=config, metric=spec.metric, out_root=str(out_dir), cwd=os.getcwd()
            ),
            tune.PlacementGroupFactory(bundles, strategy="PACK"),
        )
        if spec.scheduler == "asha":
            scheduler = ASHAScheduler(
                time_attr="round",
                max_t=config.run.rounds,
                grace_period=spec.grace_period,
                reduction_factor=spec.reduction_factor,
            )
        else:
            scheduler = FIFOScheduler()
        tuner = tune.Tuner(
            trainable,
            param_space={domain.key: domain.to_tune(tune) for domain in spec.space},
            tune_config=tune.TuneConfig(
                metric=spec.metric,
                mode=spec.mode,
                num_samples=spec.num_samples,
                scheduler=scheduler,
                # max_concurrent goes to the generator: Tune ignores TuneConfig's
                # max_concurrent_trials when given a generator instance.
                search_alg=BasicVariantGenerator(
                    random_state=spec.seed, max_concurrent=spec.max_concurrent_trials or 0
                ),
            ),
            run_config=tune.RunConfig(
                name=config.run.name,
                storage_path=str(out_dir / "tune"),
                verbose=verbose,
                failure_config=tune.FailureConfig(max_failures=0),
                callbacks=[_trial_lines(spec.metric, config.run.rounds)],
            ),
        )
        experiment = out_dir / "tune" / config.run.name
        if resume:
            if not tune.Tuner.can_restore(str(experiment)):
                raise RaysimError(
                    f"cannot resume {out_dir}: no Tune experiment state in {experiment}"
                )
            tuner = tune.Tuner.restore(
                str(experiment),
                trainable=trainable,
                resume_unfinished=True,
                resume_errored=False,
                restart_errored=False,
            )
        stopped_by: list[str] = []

        def on_sigterm(signum, frame) -> None:
            # SIGTERM stops the sweep as Ctrl-C does: through Tune's own stop signal
            # (SIGUSR1), which stops the trials in progress and saves the experiment state.
            stopped_by.append("SIGTERM")
            if callable(signal.getsignal(getattr(signal, "SIGUSR1", signal.SIGTERM))):
                signal.raise_signal(signal.SIGUSR1)
            else:  # (Tune's handler not installed yet: nothing has run)
                raise KeyboardInterrupt

        import threading

        main_thread = threading.current_thread() is threading.main_thread()
        sigterm_handler = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
        try:
            grid = tuner.fit()
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, sigterm_handler)
        rows = _rows(grid, spec, config.run.rounds)
        expected = spec.num_samples * math.prod(
            len(d.values) for d in spec.space if d.kind == "grid"
        )
        finished = grid.num_terminated + grid.num_errors
        interrupted = None
        if stopped_by:
            interrupted = stopped_by[0]
        elif finished < max(expected, len(grid)):
            interrupted = "Ctrl-C"
    finally:
        if sigint_handler is not None:
            signal.signal(signal.SIGINT, sigint_handler)
        if previous_chdir is None:
            os.environ.pop("RAY_CHDIR_TO_TRIAL_DIR", None)
        else:
            os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = previous_chdir
        if started_ray:
            ray_backend.disconnect()
    if interrupted is None and rows and all(row["status"] == "ERROR" for row in rows):
        raise RaysimError(f"every trial failed; first error: {rows[0]['error']}")
    best = _best(rows, spec)
    best_config = apply_params(config, best["params"]) if best else None
    _write_csv(out_dir / "tune_results.csv", rows, spec)
    if best_config is not None:
        header = (
            f"# Best trial {best['trial']} of `raysim tune` ({spec.metric} = "
            f"{best[spec.metric]!r}, mode {spec.mode}, after {best['rounds']} rounds).\n"
            f"# Params: {best['params']}\n# Repeat it: raysim run {out_dir / 'best_config.yaml'}\n"
        )
        (out_dir / "best_config.yaml").write_text(header + best_config.to_yaml())
    print(format_table(rows, spec))
    if best is not None:
        print(
            f"best: trial {best['trial']}, {spec.metric} = {best[spec.metric]!r}; "
            f"config: {out_dir / 'best_config.yaml'}"
        )
    print(f"results: {out_dir / 'tune_results.csv'}; trials' runs in {out_dir / 'trials'}")
    return SweepResult(rows, best, best_config, out_dir, interrupted, expected)


def _trial_lines(metric: str, rounds: int):
    """A Tune callback printing one line per finished trial (Tune's own tables are off)."""
    from ray import tune

    class TrialLines(tune.Callback):
        finished = 0

        def on_trial_complete(self, iteration, trials, trial, **info) -> None:
            self._line(trial)

        def on_trial_error(self, iteration, trials, trial, **info) -> None:
            self._line(trial, failed=True)

        def _line(self, trial, failed: bool = False) -> None:
            self.finished += 1
            result = trial.last_result or {}
            done = result.get("round")
            status = "completed" if done == rounds else f"stopped at round {done}"
            if failed:
                status = f"FAILED after round {done or 0} (see the table's errors)"
            params = ", ".join(f"{k}={_short(v)}" for k, v in trial.config.items())
            value = result.get(metric)
            shown = f"{value:.6g}" if isinstance(value, int | float) else "-"
            print(
                f"trial {trial.trial_id} {status}: {metric}={shown} ({params}); "
                f"{self.finished} finished"
            )

    return TrialLines()


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _check_fits(bundles: list[dict[str, float]], cluster: Mapping[str, float]) -> None:
    for resource in ("CPU", "GPU"):
        needed = sum(bundle.get(resource, 0.0) for bundle in bundles)
        if needed > cluster.get(resource, 0.0) + 1e-9:
            raise ConfigError(
                f"one trial needs {needed:g} {resource}s (server + client_slots x "
                f"clients.num_{resource.lower()}s) but the cluster has "
                f"{cluster.get(resource, 0.0):g}; lower tune.client_slots"
                + (" or run where GPUs are" if resource == "GPU" else "")
            )


def _rows(grid, spec: SweepSpec, rounds: int) -> list[dict[str, Any]]:
    rows = []
    for result in grid:
        # A sweep stopped early (Ctrl-C, SIGTERM) has trials that never reported: no
        # metrics, no path, no config (the TypeError that lost every finished result).
        metrics = result.metrics or {}
        params = result.config or {}
        trial = metrics.get("trial_id") or (Path(result.path).name if result.path else "-")
        done = metrics.get("round")
        if result.error is not None:
            status = "ERROR"
        elif done == rounds:
            status = "completed"
        else:
            status = f"stopped@{done}" if done else "no result"
        row = {
            "trial": trial,
            "status": status,
            "rounds": done,
            "params": {
                domain.key: _python_value(params[domain.key])
                for domain in spec.space
                if domain.key in params
            },
            spec.metric: metrics.get(spec.metric),
            "error": _error_line(result.error),
            "out": metrics.get("trial_out", ""),
        }
        for extra in ("eval/accuracy", "eval/loss", "train_loss", "bytes_up"):
            if extra != spec.metric and extra in metrics:
                row[extra] = metrics[extra]
        rows.append(row)
    rows.sort(key=lambda row: _sort_key(row, spec))
    return rows


def _sort_key(row: dict[str, Any], spec: SweepSpec) -> tuple:
    value = row.get(spec.metric)
    if not isinstance(value, int | float) or not math.isfinite(value):
        return (1, 0.0, row["trial"])
    return (0, -value if spec.mode == "max" else value, row["trial"])


def _best(rows: list[dict[str, Any]], spec: SweepSpec) -> dict[str, Any] | None:
    """The best trial that ran every round, else the best of any (rows are sorted)."""
    scored = [row for row in rows if _sort_key(row, spec)[0] == 0]
    completed = [row for row in scored if row["status"] == "completed"]
    return (completed or scored or [None])[0]


def _error_line(error: BaseException | None) -> str:
    if error is None:
        return ""
    cause = getattr(error, "cause", None)
    text = str(cause if cause is not None else error).strip().splitlines()
    return text[-1] if text else type(error).__name__


def _columns(rows: list[dict[str, Any]], spec: SweepSpec) -> list[str]:
    extras = [
        k
        for k in ("eval/accuracy", "eval/loss", "train_loss")
        if k != spec.metric and any(k in r for r in rows)
    ]
    return ["trial", "status", "rounds", *(d.key for d in spec.space), spec.metric, *extras]


def _cell(row: dict[str, Any], column: str) -> Any:
    return row["params"][column] if column in row["params"] else row.get(column)


def _write_csv(path: Path, rows: list[dict[str, Any]], spec: SweepSpec) -> None:
    columns = [*_columns(rows, spec), "out", "error"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in rows:
            writer.writerow(
                [
                    repr(v) if isinstance(v, float) else ("" if v is None else v)
                    for v in (_cell(row, c) for c in columns)
                ]
            )


def format_table(rows: list[dict[str, Any]], spec: SweepSpec) -> str:
    """The trials as an aligned text table, best first."""
    columns = _columns(rows, spec)

    def text(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.6g}"
        return "-" if value is None else str(value)

    cells = [[text(_cell(row, c)) for c in columns] for row in rows]
    widths = [
        max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    errors = [f"  {row['trial']}: {row['error']}" for row in rows if row["error"]]
    if errors:
        lines += ["errors:", *errors]
    return "\n".join(lines)


def final_metric(summary: Mapping[str, Any], metric: str) -> float | None:
    """A tune metric in a run's summary.json: eval/accuracy is final.accuracy, val/accuracy
    final_val.accuracy."""
    if metric.startswith("val/"):
        return (summary.get("final_val") or {}).get(metric.removeprefix("val/"))
    return summary["final"].get(metric.removeprefix("eval/"))
