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

import json
import time
from pathlib import Path
from typing import Any

from raysim.compare_report import build_report, write_report
from raysim.compare_spec import Comparison
from raysim.errors import RaysimError


def run_comparison(
    comparison: Comparison,
    out_dir: str | Path,
    *,
    address: str | None = None,
    reuse: bool = False,
) -> dict[str, Any]:
    """Tune every method with the same budget, re-run the winners on every seed, report.

    `reuse`: a method whose sweep and re-runs in `out_dir` are shown, run by run, to be what
    this spec gives (raysim.compare_reuse) is read from there instead of trained again; the
    others are tuned and re-run as usual."""
    from raysim import tune
    from raysim.assembly import run
    from raysim.compare_reuse import reusable_results
    from raysim.runtime import ray_cluster

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    runtime = comparison.methods[0].config.runtime
    started_ray = ray_cluster.connect(runtime, address)  # one Ray for every sweep and re-run
    results: dict[str, Any] = {}
    try:
        for method in comparison.methods:
            if reuse:
                finished, why_not = reusable_results(comparison, method, out_dir)
                if finished is not None:
                    print(
                        f"\n== {method.name}: reused, not trained again: its {finished['trials']} "
                        f"trials and {len(comparison.seeds)} re-runs in {out_dir / method.name} "
                        "are this spec's ==",
                        flush=True,
                    )
                    results[method.name] = finished
                    continue
                print(f"\n== {method.name}: not reused: {why_not} ==", flush=True)
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
                    config = method.rerun_config(
                        sweep.best_config, scenario, scenario_overrides, seed
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
