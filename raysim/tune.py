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

This module loads sweeps and runs their trials; the `tune:` section is parsed and checked in
raysim.tune_space, the results are tabulated and written by raysim.tune_results.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from raysim import config as config_module
from raysim.config import Config
from raysim.errors import ConfigError, RaysimError
from raysim.outputs.records import flatten_record, is_number
from raysim.tune_results import trial_rows, write_results
from raysim.tune_space import SweepSpec, apply_params, parse_spec

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


def _trial(params: dict, *, base: Config, metric: str, out_root: str, cwd: str) -> None:
    """One simulation, reporting every round that has the metric to Tune."""
    from ray import tune

    from raysim.assembly import run

    if os.path.isdir(cwd):  # relative data.root / cache_dir resolve as in `raysim run`
        os.chdir(cwd)
    config = apply_params(base, params)
    trial_id = tune.get_context().get_trial_id()
    out = Path(out_root) / "trials" / trial_id
    last: list[dict[str, Any]] = []

    def on_round(record: dict[str, Any]) -> None:
        flat = {k: v for k, v in flatten_record(record).items() if is_number(v)}
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

    from raysim.runtime import ray_cluster

    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    # Tune replaces the process's SIGINT handler and leaves it so: restored below, or a later
    # run in this process (`raysim compare` re-runs the winners) would not stop on Ctrl-C.
    sigint_handler = signal.getsignal(signal.SIGINT)
    # Trials work in the driver's folder (relative paths mean the same as in `raysim run`).
    previous_chdir = os.environ.get("RAY_CHDIR_TO_TRIAL_DIR")
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"  # Tune passes it on to the trials
    started_ray = ray_cluster.connect(config.runtime, address)
    try:
        bundles = trial_bundles(config, spec)
        _check_fits(bundles, ray.cluster_resources())
        print(
            f"raysim tune: {config.run.name}, {spec.metric} ({spec.mode}), scheduler "
            f"{spec.scheduler}; each trial reserves {bundles}\n"
            "TensorBoard (every trial): tensorboard --logdir "
            f"{shlex.quote(str(out_dir / 'trials'))}",  # a folder may hold spaces
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
        rows = trial_rows(grid, spec, config.run.rounds)
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
            ray_cluster.disconnect()
    if interrupted is None and rows and all(row["status"] == "ERROR" for row in rows):
        raise RaysimError(f"every trial failed; first error: {rows[0]['error']}")
    best, best_config = write_results(out_dir, rows, spec, config)
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
