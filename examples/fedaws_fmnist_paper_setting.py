"""FedAwS on Fashion-MNIST: the paper's fixed setting, and the tuned winners on all test images.

Two studies, each FedAwS, Baseline-1 (no spreadout), Baseline-2 (class embeddings frozen) and
the Softmax oracle on seeds 0, 1, 2, reported as test P@1 (= accuracy) mean ± std over seeds
(sample std), per seed, and the paired ratio to the oracle:

    python examples/fedaws_fmnist_paper_setting.py            # the paper's setting
    python examples/fedaws_fmnist_paper_setting.py --tuned    # the tuned winners, old -> new
    python examples/fedaws_fmnist_paper_setting.py --methods fedaws softmax --seeds 0

The paper's setting (configs/fedaws_fmnist_paper_setting.yaml): k = 10 and lambda = 10 for
every method, as the FedAwS paper fixes them in its Table 3 "to make a fair comparison", with
configs/fedaws_fmnist.yaml's own learning rates, untuned; every test image.

`--tuned`: the winners of configs/compare_fedaws_fmnist.yaml's latest (third) grid
(docs/RESULTS.md, "FedAwS on Fashion-MNIST, one class per client") re-run as the comparison
re-runs them (configs/fedaws_fmnist.yaml with data.validation_fraction=0.1), once on every
test image and once on the first 5,000 (`algorithm.eval_max_points=5000`, the old default,
whose numbers the old table quotes); `--eval-max-points` picks the caps.

Each run is `raysim run CONFIG --set ...` through the Python API (the exact command is in
results.json and table.md); a run whose summary.json is already in --out is read back, not
re-run, unless --fresh. Outputs in --out: table.md, results.json, one folder per run
(CAP/METHOD/seed_S). Needs Fashion-MNIST (`apt-get install dataset-fashion-mnist`).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PAPER_CONFIG = "configs/fedaws_fmnist_paper_setting.yaml"
TUNED_CONFIG = "configs/fedaws_fmnist.yaml"
# --methods keys -> (display name, the method's overrides, as in configs/compare_fedaws_fmnist.yaml)
METHODS = {
    "fedaws": ("FedAwS", []),
    "baseline1": ("Baseline-1", ["algorithm.spreadout=none"]),
    "baseline2": ("Baseline-2", ["algorithm.train_class_embeddings=false"]),
    "softmax": ("Softmax", ["algorithm={name: fedaws_softmax}"]),
}
REFERENCE = "softmax"
# The tuned comparison: its spec's own overrides, then each method's third-grid winner
# (docs/RESULTS.md: no winner on an edge).
TUNED_SET = ["data.validation_fraction=0.1", "run.checkpoint_every=0"]
TUNED_WINNERS = {
    "fedaws": ["clients.lr=0.0063", "algorithm.class_lr=0.1"],
    "baseline1": ["clients.lr=0.025", "algorithm.class_lr=0.027"],
    "baseline2": ["clients.lr=0.008", "server.lr=0.0006"],
    "softmax": ["clients.lr=0.001", "algorithm.scale=2.0"],
}
# The old table's test P@1 per seed 0 / 1 / 2 (docs/RESULTS.md, third grid: the first 5,000
# test images), to check that the 5,000-image re-runs reproduce it.
OLD_TABLE = {
    "fedaws": [0.6950, 0.7350, 0.6610],
    "baseline1": [0.6512, 0.7058, 0.6764],
    "baseline2": [0.6600, 0.7122, 0.6648],
    "softmax": [0.6584, 0.6924, 0.7096],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="re-run the tuned winners of configs/compare_fedaws_fmnist.yaml (old -> new) "
        "instead of the paper's fixed setting",
    )
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--eval-max-points",
        nargs="+",
        default=None,
        help="test points evaluated, 'all' or N, one study per value (default: all; "
        "with --tuned: all 5000)",
    )
    parser.add_argument(
        "--config", default=None, help=f"default: {PAPER_CONFIG}; with --tuned {TUNED_CONFIG}"
    )
    parser.add_argument("--out", default=None, help="default: runs/fedaws_fmnist_[paper|tuned]")
    parser.add_argument("--fresh", action="store_true", help="re-run runs already in --out")
    args = parser.parse_args(argv)
    if args.eval_max_points is None:
        args.eval_max_points = ["all", "5000"] if args.tuned else ["all"]
    for cap in args.eval_max_points:
        if cap != "all" and not (cap.isdigit() and int(cap) >= 1):
            parser.error(f"--eval-max-points takes 'all' or a positive integer, got {cap!r}")
    args.config = args.config or (TUNED_CONFIG if args.tuned else PAPER_CONFIG)
    args.out = Path(args.out or f"runs/fedaws_fmnist_{'tuned' if args.tuned else 'paper'}")
    if REFERENCE not in args.methods:
        print(f"note: no ratios without the reference method '{REFERENCE}'", flush=True)
    return args


def overrides_of(args: argparse.Namespace, method: str, cap: str, seed: int) -> list[str]:
    """The run's --set values, in order: the study's, the method's, its winner's, the
    evaluation cap, the seed."""
    values = list(TUNED_SET) if args.tuned else []
    values += METHODS[method][1]
    values += TUNED_WINNERS[method] if args.tuned else []
    if cap != "all":  # after `algorithm={...}`, which replaces the whole section
        values.append(f"algorithm.eval_max_points={cap}")
    return values + [f"run.seed={seed}"]


def command_of(config: str, overrides: list[str], out: Path) -> str:
    sets = " ".join(f"--set {shlex.quote(value)}" for value in overrides)
    return f"raysim run {config} {sets} --out {out}"


def run_one(args, method: str, cap: str, seed: int) -> dict:
    """One run (or its summary.json read back): its command, metrics and wall time."""
    import raysim

    out = args.out / f"cap_{cap}" / method / f"seed_{seed}"
    overrides = overrides_of(args, method, cap, seed)
    summary_path = out / "summary.json"
    reused = summary_path.exists() and not args.fresh
    if not reused:
        started = time.perf_counter()
        raysim.run(
            REPO / args.config,
            out,
            overrides=overrides,
            progress=False,
            tensorboard=False,
            overwrite=True,
        )
        elapsed = time.perf_counter() - started
        (out / "wall_s.txt").write_text(f"{elapsed:.1f}\n")
    summary = json.loads(summary_path.read_text())
    wall_file = out / "wall_s.txt"
    elapsed = float(wall_file.read_text()) if wall_file.exists() else summary["wall_s"]
    final, final_val = summary["final"], summary.get("final_val") or {}
    best = (summary.get("best") or {}).get("p@1") or {}
    return {
        "method": method,
        "seed": seed,
        "eval_max_points": cap,
        "command": command_of(args.config, overrides, out),
        "p@1": final["p@1"],
        "val_p@1": final_val.get("p@1"),
        "best_p@1": best.get("value"),
        "class_cosine_mean": final.get("class_cosine_mean"),
        "train_loss": final.get("train_loss"),
        "wall_s": round(elapsed, 1),
        "run_wall_s": summary["wall_s"],
        "reused": reused,
    }


def mean_std(values: list[float]) -> dict:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std, "per_seed": values}


def aggregate(runs: list[dict], methods: list[str], seeds: list[int], cap: str) -> dict:
    rows = {}
    by = {(r["method"], r["seed"]): r for r in runs if r["eval_max_points"] == cap}
    reference = [by[(REFERENCE, s)]["p@1"] for s in seeds] if REFERENCE in methods else None
    for method in methods:
        values = [by[(method, s)]["p@1"] for s in seeds]
        row = {
            "name": METHODS[method][0],
            "p@1": mean_std(values),
            "best_p@1": mean_std([by[(method, s)]["best_p@1"] for s in seeds]),
            "class_cosine_mean": mean_std([by[(method, s)]["class_cosine_mean"] for s in seeds]),
        }
        vals = [by[(method, s)]["val_p@1"] for s in seeds]
        if all(v is not None for v in vals):
            row["val_p@1"] = mean_std(vals)
        if reference is not None:
            ratios = [v / r if r else math.nan for v, r in zip(values, reference, strict=True)]
            row["ratio_to_softmax"] = mean_std(ratios)
        rows[method] = row
    return rows


def cell(row: dict, key: str, digits: int = 4) -> str:
    """`mean ± std` of the row's `key`, or n/a."""
    if key not in row:
        return "n/a"
    return f"{row[key]['mean']:.{digits}f} ± {row[key]['std']:.{digits}f}"


def table(rows: dict, old: bool) -> list[str]:
    head = "| method | test P@1 | per seed | ratio to Softmax (paired) | best-so-far P@1 | "
    head += "mean pairwise class cosine | val P@1 |"
    lines = [head + (" old table per seed | same? |" if old else "")]
    lines.append("| --- " * (7 + (2 if old else 0)) + "|")
    for row in rows.values():
        per_seed = " / ".join(f"{v:.4f}" for v in row["p@1"]["per_seed"])
        cells = [
            row["name"],
            cell(row, "p@1"),
            per_seed,
            cell(row, "ratio_to_softmax", 3),
            cell(row, "best_p@1"),
            cell(row, "class_cosine_mean", 3),
            cell(row, "val_p@1"),
        ]
        if old:
            cells.append(" / ".join(f"{v:.4f}" for v in row["old_per_seed"]))
            cells.append("yes" if row["reproduces_old_table"] else "**no**")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [(c, m, s) for c in args.eval_max_points for m in args.methods for s in args.seeds]
    runs, started = [], time.perf_counter()
    for number, (cap, method, seed) in enumerate(plan, 1):
        name = METHODS[method][0]
        print(f"[{number}/{len(plan)}] {name} seed {seed}, test points {cap} ...", flush=True)
        run = run_one(args, method, cap, seed)
        runs.append(run)
        done = "read back" if run["reused"] else f"{run['wall_s']:.0f} s"
        print(
            f"[{number}/{len(plan)}] {name} seed {seed}, test points {cap}: "
            f"P@1 {run['p@1']:.4f}, val P@1 {run['val_p@1']}, {done}",
            flush=True,
        )
    studies = {}
    for cap in args.eval_max_points:
        rows = aggregate(runs, args.methods, args.seeds, cap)
        if args.tuned and cap == "5000" and args.seeds == [0, 1, 2]:
            for method, row in rows.items():
                row["old_per_seed"] = OLD_TABLE[method]
                row["reproduces_old_table"] = [round(v, 4) for v in row["p@1"]["per_seed"]] == [
                    round(v, 4) for v in OLD_TABLE[method]
                ]
        studies[cap] = rows
    study = "tuned winners (configs/compare_fedaws_fmnist.yaml)" if args.tuned else "paper setting"
    lines = [f"# FedAwS on Fashion-MNIST: {study}", ""]
    lines += [f"Config: `{args.config}`; seeds {args.seeds}; P@1 of the final round (15).", ""]
    for cap, rows in studies.items():
        points = "every test image (10,000)" if cap == "all" else f"the first {cap} test images"
        lines += [f"## Evaluated on {points}", ""]
        lines += table(rows, old="old_per_seed" in next(iter(rows.values())))
        lines.append("")
    lines += ["## Commands", ""] + [f"    {r['command']}" for r in runs] + [""]
    total = time.perf_counter() - started
    result = {
        "study": "tuned" if args.tuned else "paper_setting",
        "config": args.config,
        "seeds": args.seeds,
        "methods": {m: METHODS[m][0] for m in args.methods},
        "winners": {m: TUNED_WINNERS[m] for m in args.methods} if args.tuned else None,
        "by_eval_max_points": studies,
        "runs": runs,
        "wall_s": round(total, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    (args.out / "table.md").write_text("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines), flush=True)
    print(f"wrote {args.out / 'table.md'} and {args.out / 'results.json'} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
