"""A comparison's report (raysim.compare): per method and scenario the test metrics' mean ±
std over seeds with every per-seed value, the ratio to the reference method paired by seed,
winners on an edge of their search space; written as OUT/comparison.md, comparison.json and
comparison.png."""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from raysim.errors import RaysimError
from raysim.outputs.checkpoints import atomic_write_bytes

if TYPE_CHECKING:
    from raysim.compare_spec import Comparison


def write_report(comparison: Comparison, report: Mapping[str, Any], out_dir: Path) -> None:
    """comparison.json, comparison.md (the table) and comparison.png in `out_dir`."""
    (out_dir / "comparison.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    (out_dir / "comparison.md").write_text(report["table"] + "\n")
    _plot(comparison, out_dir, out_dir / "comparison.png")


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1)."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0


def build_report(comparison: Comparison, results: Mapping[str, Any]) -> dict[str, Any]:
    """Per method (and scenario): each report metric's mean ± std over seeds with the per-seed
    values, and the first metric's ratio to the reference method's, paired by seed (under the
    same scenario). Without scenarios a method's entry holds `metrics` and `ratio` directly;
    with them, `scenarios: {name: {metrics, ratio}}`."""
    seeds = comparison.seeds
    primary = comparison.report[0]
    methods: dict[str, Any] = {}
    lines = [
        f"Comparison {comparison.source}: every method tuned with {comparison.trials} trials "
        f"on {comparison.metric} ({comparison.mode}), winners re-run on seeds "
        f"{', '.join(map(str, seeds))}"
        + (
            ""
            if None in comparison.scenarios
            else f" under each scenario ({', '.join(map(str, comparison.scenarios))})"
        )  # fmt: skip
        + f"; test metrics, mean ± std (ddof 1) and per seed; ratio = {primary} / "
        f"{comparison.reference}'s {primary}, per seed.",
    ]
    edges = []
    for name, result in results.items():
        method = next(m for m in comparison.methods if m.name == name)
        space = {d.key: {d.kind: list(d.values)} for d in method.spec.space}
        found = edge_findings(space, result["best_params"])
        methods[name] = {
            "best_params": result["best_params"],
            "best_validation": result["best_validation"],
            "trials": result["trials"],
            "winner_on_edge": found,
        }
        edges += [f"- {name}: {line}" for line in found]
    for scenario in comparison.scenarios:
        reference_runs = results[comparison.reference]["runs"][scenario]
        reference = [reference_runs[s]["final"].get(primary) for s in seeds]
        if scenario is not None:
            lines += ["", f"Scenario {scenario}: {list(comparison.scenarios[scenario])}"]
        lines += [
            "",
            "| method | "
            + " | ".join(comparison.report)
            + f" | best-so-far {primary} | {primary} per seed | ratio | {comparison.metric} "
            "(tuning) | best params |",
            "| --- |" + " --- |" * (len(comparison.report) + 5),
        ]
        for name, result in results.items():
            runs = result["runs"][scenario]
            entry: dict[str, Any] = {"metrics": {}}
            for metric in comparison.report:
                values = [runs[s]["final"].get(metric) for s in seeds]
                if any(v is None or not math.isfinite(v) for v in values):
                    raise RaysimError(
                        f"method {name}: test metric '{metric}' missing in a re-run"
                        + ("" if scenario is None else f" (scenario {scenario})")
                    )
                mean, std = _mean_std(values)
                entry["metrics"][metric] = {"mean": mean, "std": std, "per_seed": values}
            best_values = [((runs[s].get("best") or {}).get(primary) or {}).get("value")
                           for s in seeds]  # fmt: skip
            if all(v is not None for v in best_values):
                mean, std = _mean_std(best_values)
                entry["best_so_far"] = {"mean": mean, "std": std, "per_seed": best_values}
            values = [runs[s]["final"][primary] for s in seeds]
            ratios = [v / r if r else math.nan for v, r in zip(values, reference, strict=True)]
            mean, std = _mean_std(ratios)
            entry["ratio"] = {"mean": mean, "std": std, "per_seed": ratios}
            if scenario is None:
                methods[name].update(entry)
            else:
                methods[name].setdefault("scenarios", {})[scenario] = entry
            cells = [
                f"{entry['metrics'][m]['mean']:.4f} ± {entry['metrics'][m]['std']:.4f}"
                for m in comparison.report
            ]
            per_seed = " / ".join(f"{v:.4f}" for v in entry["metrics"][primary]["per_seed"])
            ratio = f"{entry['ratio']['mean']:.3f} ± {entry['ratio']['std']:.3f}"
            params = ", ".join(f"{k}={_short(v)}" for k, v in result["best_params"].items())
            best = entry.get("best_so_far")
            best_cell = "n/a" if best is None else f"{best['mean']:.4f} ± {best['std']:.4f}"
            lines.append(
                f"| {name} | {' | '.join(cells)} | {best_cell} | {per_seed} | {ratio} | "
                f"{result['best_validation']:.4f} | {params} |"
            )
            reached = time_to_target([runs[s] for s in seeds])
            if reached is not None:
                entry["time_to_target"] = reached
        lines += time_to_target_ranking(
            {
                name: (methods[name] if scenario is None else methods[name]["scenarios"][scenario])
                for name in results
            }
        )
    lines += [
        "",
        f"Metric columns are the final round's; best-so-far {primary} is the best of any "
        "evaluated round (the FRL reference code's printed metric).",
    ]
    if edges:
        lines += ["", "Winners on an edge of their search space (widen the space):", *edges]
    report = {
        "spec": comparison.source,
        "metric": comparison.metric,
        "trials_per_method": comparison.trials,
        "seeds": list(seeds),
        "reference": comparison.reference,
        "methods": methods,
        "table": "\n".join(lines),
    }
    if None not in comparison.scenarios:
        report["scenarios"] = {k: list(v) for k, v in comparison.scenarios.items()}
    return report


def time_to_target(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Simulated seconds to the target metric over the seeds (runs with `devices.target`):
    mean ± std of the seeds that reached it, per seed (None: not reached), how many did; None
    when the runs have no simulated target."""
    sims = [summary.get("sim") or {} for summary in summaries]
    if not sims or any(sim.get("target") is None for sim in sims):
        return None
    per_seed = [sim.get("time_to_target_s") for sim in sims]
    hit = [float(v) for v in per_seed if v is not None]
    mean, std = _mean_std(hit) if hit else (math.nan, math.nan)
    return {
        "metric": sims[0].get("target_metric"),
        "target": sims[0].get("target"),
        "mean": mean,
        "std": std,
        "per_seed": per_seed,
        "reached": len(hit),
        "seeds": len(per_seed),
    }


def time_to_target_ranking(entries: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The methods ranked by simulated time to the target (runs in simulated time with
    `devices.target`): those that reached it on more seeds first, then the faster mean."""
    timed = {name: e["time_to_target"] for name, e in entries.items() if "time_to_target" in e}
    if not timed:
        return []
    first = next(iter(timed.values()))
    ranked = sorted(timed.items(), key=lambda item: (-item[1]["reached"], item[1]["mean"]))
    lines = [
        "",
        f"Ranked by simulated time to {first['metric']} >= {first['target']:g} (seconds, mean ± "
        "std over the seeds that reached it):",
        "",
        "| rank | method | time to target (s) | reached | per seed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rank, (name, t) in enumerate(ranked, start=1):
        cell = "not reached" if not t["reached"] else f"{t['mean']:.4g} ± {t['std']:.3g}"
        seeds = " / ".join("-" if v is None else f"{v:.4g}" for v in t["per_seed"])
        lines.append(f"| {rank} | {name} | {cell} | {t['reached']}/{t['seeds']} | {seeds} |")
    return lines


# A winner within this share of its range (in the space's own scale: log for loguniform) of
# an edge is flagged: the optimum may lie outside the space, so the space was too small.
EDGE_SHARE = 0.1


def edge_findings(space: Mapping[str, Any], best_params: Mapping[str, Any]) -> list[str]:
    """One line per tuned hyperparameter whose winning value sits on an edge of its space:
    near the low or high end of a uniform / loguniform / randint range, or the lowest or
    highest of three or more numeric choice or grid values (two have no inside)."""
    findings = []
    for key, domain in space.items():
        if isinstance(domain, list):  # a plain list is a grid
            domain = {"grid": domain}
        if key not in best_params or not isinstance(domain, Mapping) or len(domain) != 1:
            continue
        (kind, values), value = next(iter(domain.items())), best_params[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if kind in ("uniform", "loguniform", "randint"):
            low, high = float(values[0]), float(values[1])
            if kind == "randint":
                high -= 1  # randint's high is excluded
            if kind == "loguniform":
                low, high, point = math.log(low), math.log(high), math.log(value)
            else:
                point = float(value)
            if high <= low:
                continue
            share = (point - low) / (high - low)
            if share <= EDGE_SHARE or share >= 1 - EDGE_SHARE:
                side = "low" if share <= EDGE_SHARE else "high"
                findings.append(f"{key}={_short(value)} at the {side} edge of {kind} {values}")
        elif kind in ("choice", "grid"):
            numeric = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
            if len(numeric) == len(values) >= 3 and value in (min(numeric), max(numeric)):
                side = "lowest" if value == min(numeric) else "highest"
                findings.append(f"{key}={_short(value)} is the {side} of {kind} {values}")
    return findings


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _plot(comparison: Comparison, out_dir: Path, png_path: Path) -> None:
    """Left: the first report metric (test) against the round, per method the mean over seeds
    with a band from the lowest to the highest seed. Right: each method's ratio to the
    reference method at each round (per seed, paired), mean over seeds with its band. One
    row per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    metric = comparison.report[0]
    scenarios = list(comparison.scenarios)
    figure, axes = pyplot.subplots(
        len(scenarios), 2, figsize=(12, 4.5 * len(scenarios)), dpi=100, squeeze=False
    )
    for (left, right), scenario in zip(axes, scenarios, strict=True):
        curves: dict[str, list[dict[int, float]]] = {}
        for method in comparison.methods:
            curves[method.name] = []
            for seed in comparison.seeds:
                path = method.run_dir(out_dir, scenario, seed) / "metrics.jsonl"
                records = [json.loads(line) for line in path.read_text().splitlines() if line]
                curves[method.name].append(
                    {r["round"]: r["eval"][metric] for r in records if "eval" in r}
                )
        rounds = sorted(set.intersection(*(set(c) for runs in curves.values() for c in runs)))
        reference = np.array([[c[r] for r in rounds] for c in curves[comparison.reference]])
        for index, (name, runs) in enumerate(curves.items()):
            values = np.array([[c[r] for r in rounds] for c in runs])
            colour = f"C{index % 10}"
            left.plot(rounds, values.mean(axis=0), color=colour, label=name)
            left.fill_between(rounds, values.min(axis=0), values.max(axis=0), color=colour,
                              alpha=0.2)  # fmt: skip
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = values / reference
            right.plot(rounds, ratio.mean(axis=0), color=colour, label=name)
            right.fill_between(rounds, ratio.min(axis=0), ratio.max(axis=0), color=colour,
                               alpha=0.2)  # fmt: skip
        under = "" if scenario is None else f"{scenario}: "
        left.set_xlabel("round")
        left.set_ylabel(f"test {metric}")
        left.set_title(
            f"{under}{metric}: mean over seeds {list(comparison.seeds)}, band min-max", fontsize=9
        )
        left.legend(fontsize=8)
        right.set_xlabel("round")
        right.set_ylabel(f"{metric} / {comparison.reference}'s {metric}")
        right.set_title(f"{under}ratio to the reference, per seed: mean, band min-max",
                        fontsize=9)  # fmt: skip
        right.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    atomic_write_bytes(png_path, buffer.getvalue())
