"""FLAG + CMDA (Chang et al., arXiv 2302.13571): the paper's Table 1 and Table 2 on raysim.

1. The CMDA split: k-modes clients vs a random split (sizes, total pairwise label KL; the KL
   heatmap and size bar chart as PNG and in TensorBoard).
2. Table 1: AmAP, WmAP, GmAP and rounds (and local epochs) to 80% / 95% of the centralized
   model's GmAP for every method (configs/flag_<method>.yaml), mean over seeds.
3. Table 2: FLAG's GmAP / rounds to target for alpha in --alphas.

Default: the embedded `synthetic_multilabel` data, one seed, a few minutes on 2 CPUs. Real
data: pass --set overrides that every run gets, e.g.
    --set data.name=arff --set data.root=/data/yeast --set data.train_file=yeast-train.arff ...
    --set data.name=coco --set data.root=/data/coco --set model.name=conv4
Results are printed and saved to OUT/tables.json and OUT/tables.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim.assembly import plan_run, run
from raysim.data import cmda
from raysim.data.datasets import load_dataset
from raysim.data.partition import split_dataset
from raysim.metrics.multilabel import rounds_to_target
from raysim.seeds import PARTITION, purpose_seed

REPO = Path(__file__).resolve().parents[1]
METHODS = (
    "local_only",
    "fedavg",
    "uniform",
    "fedprox",
    "personal_bn",
    "personal_classifier",
    "per_fedavg",
    "flag",
)
LABELS = {
    "centralized": "Centralized",
    "local_only": "Local only",
    "fedavg": "FedAvg",
    "uniform": "Uniform averaging",
    "fedprox": "FedProx",
    "personal_bn": "Personal BN",
    "personal_classifier": "Personal classifier",
    "per_fedavg": "Per-FedAvg (FO)",
    "flag": "FLAG (alpha 0.3)",
}


def load(method: str, seed: int, rounds: int, overrides: list[str]):
    return config_module.load(
        REPO / "configs" / f"flag_{method}.yaml",
        [f"run.seed={seed}", f"run.rounds={rounds}", "runtime.backend=local", *overrides],
    )


def history(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def split_section(out: Path, seed: int, overrides: list[str]) -> dict:
    """CMDA vs random split of the FLAG config's data: report, PNGs, TensorBoard images."""
    from torch.utils.tensorboard import SummaryWriter

    config = load("flag", seed, 1, overrides)
    dataset = load_dataset(config)
    part_seed = purpose_seed(seed, PARTITION)
    k = config.partition.num_clients
    writer = SummaryWriter(log_dir=str(out / "split" / "tensorboard"))
    result = {}
    for name in ("kmodes", "random"):
        split = split_dataset(dataset, name, k, part_seed)
        report = cmda.split_report(dataset.train_y, split.train)
        paths = cmda.save_split_plots(report, out / "split", name, writer=writer)
        print(cmda.describe_report(report, f"[{name}] "), flush=True)
        result[name] = {
            "kl_total": report["kl_total"],
            "epsilon": report["epsilon"],
            "zero_cells": report["zero_cells"],
            "kl_total_by_epsilon": report["kl_total_by_epsilon"],
            "size_ratio": report["size_ratio"],
            "sizes": report["sizes"].tolist(),
            "pngs": [str(p) for p in paths.values()],
        }
    writer.close()
    ratio = result["kmodes"]["kl_total"] / result["random"]["kl_total"]
    result["kl_ratio"] = ratio
    # With zero client x label counts the totals rest on epsilon: the ratio at each epsilon.
    by_epsilon = {
        eps: result["kmodes"]["kl_total_by_epsilon"][eps] / total
        for eps, total in result["random"]["kl_total_by_epsilon"].items()
    }
    result["kl_ratio_by_epsilon"] = by_epsilon
    print(
        f"CMDA total pairwise KL {result['kmodes']['kl_total']:.4g} vs random "
        f"{result['random']['kl_total']:.4g} ({ratio:.0f}x at epsilon "
        f"{result['kmodes']['epsilon']:g}; {result['kmodes']['zero_cells']} zero client x label "
        "counts, so the ratio depends on epsilon: "
        + ", ".join(f"{eps:g}: {value:.0f}x" for eps, value in by_epsilon.items())
        + f"); client sizes largest/smallest {result['kmodes']['size_ratio']:.1f}\n",
        flush=True,
    )
    return result


def centralized_gmap(out: Path, seed: int, rounds: int, overrides: list[str]) -> float:
    """GmAP of the centrally trained model on the federated clients' validation splits."""
    from raysim.algorithms.flag import evaluate_multilabel
    from raysim.models.vector import build_model

    result = run(
        load("centralized", seed, rounds, overrides),
        out / "runs" / f"centralized_seed{seed}",
        progress=False,
        tensorboard=False,
        overwrite=True,  # the study's folders: each invocation replaces the last one's
    )
    federated = load("flag", seed, rounds, overrides)
    dataset = load_dataset(federated)
    ctx = plan_run(federated, dataset).ctx  # carries the CMDA clients' validation rows
    metrics = evaluate_multilabel(
        build_model(ctx), result.state.arrays["params"], {}, dataset.test_x, dataset.test_y, ctx
    )
    return metrics["gmap"]


_DONE: dict[str, dict] = {}  # Table 2's alpha 0.3 is Table 1's FLAG run: run it once


def run_method(out: Path, method: str, seed: int, rounds: int, overrides: list[str]) -> dict:
    config = load(method, seed, rounds, overrides)
    key = config.to_yaml()
    if key in _DONE:
        return _DONE[key]
    alpha = config.algorithm.options.get("alpha") if method == "flag" else None
    suffix = f"_alpha{alpha}" if alpha is not None else ""
    out_dir = out / "runs" / f"{method}{suffix}_seed{seed}"
    result = run(config, out_dir, progress=False, tensorboard=False, overwrite=True)
    records = [r for r in history(out_dir) if "eval" in r]
    final = result.summary["final"]
    summary = {
        "gmap": final.get("gmap"),
        "amap": final.get("amap"),
        "wmap": final.get("wmap"),
        "gmap_curve": [r["eval"].get("gmap") for r in records],
        "local_epochs": config.clients.local_epochs,
        "wall_s": result.summary["wall_s"],
    }
    _DONE[key] = summary
    return summary


def summarise(runs: list[dict], targets: list[float]) -> dict:
    def mean_std(key):
        values = [r[key] for r in runs if r[key] is not None]
        return (float(np.mean(values)), float(np.std(values))) if values else (None, None)

    row = {key: mean_std(key) for key in ("gmap", "amap", "wmap")}
    for fraction in (0.8, 0.95):
        hits = [
            rounds_to_target(r["gmap_curve"], fraction * target)
            for r, target in zip(runs, targets, strict=True)
        ]
        row[f"rounds_{int(fraction * 100)}"] = hits
        reached = [h for h in hits if h is not None]
        row[f"rounds_{int(fraction * 100)}_mean"] = float(np.mean(reached)) if reached else None
        row[f"reached_{int(fraction * 100)}"] = f"{len(reached)}/{len(hits)}"
    row["local_epochs_per_round"] = runs[0]["local_epochs"]
    return row


def fmt(pair) -> str:
    mean, std = pair
    return "-" if mean is None else f"{mean:.4f} ± {std:.4f}"


def fmt_rounds(row: dict, fraction: int) -> str:
    mean = row[f"rounds_{fraction}_mean"]
    if mean is None:
        return f"never ({row[f'reached_{fraction}']})"
    epochs = mean * row["local_epochs_per_round"]
    return f"{mean:.1f} ({epochs:.0f} ep, {row[f'reached_{fraction}']})"


def table(rows: dict[str, dict], title: str, label=lambda k: LABELS.get(k, k)) -> str:
    lines = [
        f"### {title}",
        "",
        "| method | GmAP | AmAP | WmAP | rounds to 80% | rounds to 95% |",
        "|---|---|---|---|---|---|",
    ]
    for key, row in rows.items():
        lines.append(
            f"| {label(key)} | {fmt(row['gmap'])} | {fmt(row['amap'])} | {fmt(row['wmap'])} | "
            f"{fmt_rounds(row, 80)} | {fmt_rounds(row, 95)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="runs/flag_multilabel", help="output folder")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="run seeds, space-separated; tables show the mean ± std over them",
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds per run")
    parser.add_argument(
        "--alphas",
        type=float,
        nargs="+",
        default=[0.0, 0.3, 1.0],
        help="FLAG alphas for Table 2, space-separated (run and shown in increasing order)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        choices=METHODS,
        metavar="METHOD",
        help="Table 1's methods in this order, space-separated, from: "
        + ", ".join(f"{key} ({LABELS[key]})" for key in METHODS),
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override every run gets (repeat the option for several), e.g. "
        "--set data.name=arff",
    )
    args = parser.parse_args()
    # Table 2 is a sweep over alpha: rows in numeric order whatever order they were typed in
    # (each alpha is its own run, so the order does not change any number).
    args.alphas = sorted(args.alphas)
    out = Path(args.out)
    started = time.perf_counter()
    results: dict = {"seeds": args.seeds, "rounds": args.rounds, "overrides": args.set}
    results["split"] = split_section(out, args.seeds[0], args.set)

    targets = [centralized_gmap(out, seed, args.rounds, args.set) for seed in args.seeds]
    results["centralized_gmap"] = targets
    print(f"centralized GmAP on the CMDA validation splits: {np.round(targets, 4).tolist()}")

    table1 = {}
    for method in args.methods:
        runs = [run_method(out, method, seed, args.rounds, args.set) for seed in args.seeds]
        table1[method] = summarise(runs, targets)
        row = table1[method]
        print(f"  {LABELS[method]:<22} GmAP {fmt(row['gmap'])} WmAP {fmt(row['wmap'])}", flush=True)
    table2 = {}
    for alpha in args.alphas:
        overrides = [*args.set, f"algorithm.alpha={alpha}"]
        runs = [run_method(out, "flag", seed, args.rounds, overrides) for seed in args.seeds]
        table2[alpha] = summarise(runs, targets)
        row = table2[alpha]
        print(
            f"  FLAG alpha {alpha:<4} GmAP {fmt(row['gmap'])} WmAP {fmt(row['wmap'])}", flush=True
        )
    results["table1"], results["table2"] = table1, table2
    seeds = ", ".join(map(str, args.seeds))
    text = "\n\n".join(
        [
            f"Centralized GmAP (target; seeds {seeds}): "
            f"{float(np.mean(targets)):.4f} ± {float(np.std(targets)):.4f}",
            table(table1, f"Table 1: methods ({args.rounds} rounds, seeds {seeds})"),
            table(
                {a: table2[a] for a in args.alphas},
                f"Table 2: FLAG alpha ({args.rounds} rounds, seeds {seeds})",
                label=lambda a: f"alpha {a:.1f}",
            ),
        ]
    )
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(text + "\n")
    results["wall_s"] = time.perf_counter() - started
    (out / "tables.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    print(f"\nwrote {out / 'tables.md'} and tables.json in {results['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
