"""Reusing a comparison's finished methods (`raysim compare SPEC --out OUT --reuse`).

A comparison re-centred on one method's edge winner changes that method's space only; the
other methods' sweeps and re-runs in OUT are still what the new spec would produce, and
re-running them would take the same hours to write the same numbers. `reusable_results`
accepts a method's folder only when its contents show that, run by run:

- the sweep: every trial of OUT/METHOD/tune/tune_results.csv completed; each trial's
  config.yaml carries the fingerprint of the method's config with that trial's point applied
  (in its header, written when the run started, and its body still matches it), and its
  summary.json says it ran every round; the trials' points are the spec's grid, each
  point `trials` times;
- the winner, chosen again from the trials' own summary.json files by the spec's metric and
  mode (the first of equal values in the sweep's order, as the sweep chose);
- each re-run (OUT/METHOD[/SCENARIO]/seed_S): the fingerprint of the winner's config with that
  scenario and seed, every round run.

A fingerprint covers every config key but the round count and the runtime (where a run ran
does not change its numbers; raysim.outputs.identity), so the round count is checked apart.
Only a grid sweep under the fifo scheduler can be checked this way: a random search's points
depend on its search seed, which the folder does not record. Such a method is tuned again.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from raysim.compare_spec import Comparison, Method
from raysim.config import Config
from raysim.outputs.identity import config_fingerprint, written_fingerprint
from raysim.tune_results import final_metric
from raysim.tune_space import apply_params


def reusable_results(
    comparison: Comparison, method: Method, out_dir: str | Path
) -> tuple[dict[str, Any] | None, str]:
    """The method's results as `run_comparison` collects them, read from its folder in
    `out_dir`, with "" (None and the reason when the folder cannot be reused)."""
    spec = method.spec
    if spec.scheduler != "fifo" or any(domain.kind != "grid" for domain in spec.space):
        return None, (
            "only a grid sweep under the fifo scheduler can be checked from its folder (a "
            "random search's points depend on its search seed, which the folder does not record)"
        )
    sweep = Path(out_dir) / method.name / "tune"
    table = sweep / "tune_results.csv"
    if not table.is_file():
        return None, f"no sweep results at {table}"
    with table.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    keys = [domain.key for domain in spec.space]
    points: Counter = Counter()
    best: tuple[float, dict[str, Any]] | None = None
    for row in rows:
        if row.get("status") != "completed":
            return None, f"{table}: trial {row.get('trial')} did not complete ({row.get('status')})"
        try:
            params = {
                domain.key: _grid_value(row[domain.key], domain.values) for domain in spec.space
            }
        except (KeyError, ValueError):
            return None, f"{table}: trial {row.get('trial')} is not at a point of this spec's grid"
        summary, problem = _finished_run(
            sweep / "trials" / str(row.get("trial")), apply_params(method.config, params)
        )
        if problem:
            return None, problem
        value = final_metric(summary, comparison.metric)
        if value is None:
            return None, f"trial {row.get('trial')} has no {comparison.metric} in its summary.json"
        if best is None or (value > best[0] if comparison.mode == "max" else value < best[0]):
            best = (value, params)
        points[tuple(params[key] for key in keys)] += 1
    grid = Counter(
        {point: spec.num_samples for point in itertools.product(*(d.values for d in spec.space))}
    )
    if points != grid:
        return None, (
            f"{table}: its trials are not this spec's grid ({sum(points.values())} trials, "
            f"{sum(grid.values())} expected: {spec.num_samples} per point)"
        )
    assert best is not None  # a grid has at least one point
    best_config = apply_params(method.config, best[1])
    runs: dict[str | None, dict[int, Any]] = {}
    for scenario, scenario_overrides in comparison.scenarios.items():
        runs[scenario] = {}
        for seed in comparison.seeds:
            config = method.rerun_config(best_config, scenario, scenario_overrides, seed)
            summary, problem = _finished_run(method.run_dir(Path(out_dir), scenario, seed), config)
            if problem:
                return None, problem
            runs[scenario][seed] = summary
    return {
        "best_params": best[1],
        "best_validation": best[0],
        "trials": len(rows),
        "trials_completed": len(rows),
        "runs": runs,
    }, ""


def _finished_run(run_dir: Path, config: Config) -> tuple[dict[str, Any], str]:
    """The run's summary.json when `run_dir` holds a finished run of `config`, else the reason."""
    written = run_dir / "config.yaml"
    if not written.is_file():
        return {}, f"no run at {run_dir}"
    fingerprint = written_fingerprint(written)
    if fingerprint != config_fingerprint(config):
        return {}, f"{written} is not the config this spec gives that run"
    try:  # safe_load: a folder's file never runs code; its body must be what its header says
        body = yaml.safe_load(written.read_text(encoding="utf-8"))
        edited = not isinstance(body, dict) or config_fingerprint(body) != fingerprint
    except (yaml.YAMLError, UnicodeDecodeError):
        edited = True
    if edited:
        return {}, f"{written} was edited after its run (it no longer matches its fingerprint)"
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}, f"the run in {run_dir} did not finish (no readable summary.json)"
    if not isinstance(summary, dict) or summary.get("rounds") != config.run.rounds:
        return {}, f"the run in {run_dir} did not run {config.run.rounds} rounds"
    return summary, ""


def _grid_value(text: str, values: tuple[Any, ...]) -> Any:
    """The grid value a CSV cell holds (its text as Tune wrote it), else ValueError."""
    for value in values:
        if str(value) == text or _same_number(text, value):
            return value
    raise ValueError(text)


def _same_number(text: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return float(text) == float(value)
    except ValueError:
        return False
