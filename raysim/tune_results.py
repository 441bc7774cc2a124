"""A sweep's results: one row per trial from Tune's result grid, best first; the best trial;
OUT/tune_results.csv, OUT/best_config.yaml and the printed table."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raysim.config import Config
from raysim.tune_space import SweepSpec, apply_params, python_value


def write_results(
    out_dir: Path, rows: list[dict[str, Any]], spec: SweepSpec, config: Config
) -> tuple[dict[str, Any] | None, Config | None]:
    """Write tune_results.csv and (with a best trial) best_config.yaml, print the table and
    where they are; returns the best trial's row and its resolved config."""
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
    return best, best_config


def trial_rows(grid, spec: SweepSpec, rounds: int) -> list[dict[str, Any]]:
    """One row per trial of Tune's result grid, best first."""
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
                domain.key: python_value(params[domain.key])
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
