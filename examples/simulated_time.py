"""FedAvg, FedAvg with a deadline and over-selection, FedBuff and FedAsync on a heterogeneous
population in simulated time (docs/SIMULATED_TIME.md), over several seeds.

Every client gets a sampled device: compute speed, download and upload bandwidth log-normal
with sigma 1 (the slowest tenth is ~13x slower than the median), online 80% of every 10
simulated minutes from a seeded phase. Each method gets the same budget of client updates
(300: 30 rounds of 10 for the synchronous ones and FedBuff, 300 single-update steps for
FedAsync), and the table reports the simulated seconds until the test accuracy first reaches
the target (0.9 on digits, 0.6 on Fashion-MNIST, or --target), and the final test accuracy,
mean ± std over the seeds.

Hyperparameters are shared, none tuned (on test or validation data): the client side is
configs/fedavg_digits.yaml's (5 local epochs of SGD, lr 0.05, momentum 0.9, batch 16); the
server steps with SGD at lr 1; FedBuff and FedAsync use their papers' staleness function
s(tau) = (1 + tau)^-0.5, FedAsync its mixing alpha = 0.6; the deadline (10 s) and
over-selection (30%) are fixed from the device distribution (the deadline is ~3x the median
client's duration), not from any result. FedAsync's schedule lands updates up to ~130 server
steps stale, so it runs with devices.max_staleness: 1000.

    python examples/simulated_time.py --out /tmp/simulated_time            # digits, seeds 0-2
    python examples/simulated_time.py --out /tmp/st --datasets digits fashion_mnist

Writes OUT/results.json (every seed's numbers), OUT/results.md (the table),
OUT/DATASET_accuracy_vs_sim_time.png (the curves), and each run's folder under
OUT/DATASET/METHOD/seed_S.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from raysim.assembly import run
from raysim.config import from_dict

FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")

BASE = {
    "run": {"name": "simulated_time", "seed": 0, "rounds": 30, "checkpoint_every": 0},
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 100, "alpha": 0.5},
    "clients": {"per_round": 10, "local_epochs": 5, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
    "model": {"name": "mlp", "hidden": [128]},
    "algorithm": {"name": "fedavg"},
    "aggregator": {"name": "weighted_mean"},
    "server": {"optimizer": "sgd", "lr": 1.0},
    "runtime": {"backend": "local"},
    "devices": {
        "profiles": "sampled",
        "compute_median": 1e6,  # FLOP/s: the median client's 13 samples x 5 epochs take ~4 s
        "compute_sigma": 1.0,
        "download_sigma": 1.0,
        "upload_sigma": 1.0,
        "online_fraction": 0.8,
        "period_s": 600.0,
    },
}

# method -> overrides; the same 300 client updates for each
METHODS = {
    "fedavg": ["run.rounds=30"],
    "fedavg_deadline": ["run.rounds=30", "devices.deadline_s=10", "devices.over_selection=0.3"],
    "fedbuff": [
        "run.rounds=30",
        "devices.aggregation=fedbuff",
        "devices.buffer_size=10",
        "devices.concurrency=20",
    ],
    "fedasync": [
        "run.rounds=300",
        "devices.aggregation=fedasync",
        "devices.concurrency=10",
        "devices.mixing=0.6",
        "devices.max_staleness=1000",
    ],
}
LABELS = {
    "fedavg": "FedAvg (no deadline)",
    "fedavg_deadline": "FedAvg + deadline 10 s + 30% over-selection",
    "fedbuff": "FedBuff (K=10, concurrency 20)",
    "fedasync": "FedAsync (concurrency 10, alpha 0.6)",
}
DATASETS = {
    "digits": [],
    # 600 samples a client: one local epoch, and a faster median device, so that a client's
    # duration is of the same order as on digits
    "fashion_mnist": [
        "data.name=fashion_mnist",
        "clients.local_epochs=1",
        "devices.compute_median=1e8",
    ],
}


TARGETS = {"digits": 0.9, "fashion_mnist": 0.6}


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else 0.0


def plot(out: Path, dataset: str, methods: list[str], seeds: list[int], target: float) -> Path:
    """OUT/DATASET_accuracy_vs_sim_time.png: test accuracy against simulated time, one line per
    method and seed (a run's rounds end at different simulated times, so seeds are drawn
    apart rather than averaged), the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axis = pyplot.subplots(figsize=(8, 4.5), dpi=100)
    for index, method in enumerate(methods):
        for position, seed in enumerate(seeds):
            path = out / dataset / method / f"seed_{seed}" / "metrics.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines() if line]
            points = [(r["sim"]["end_s"], r["eval"]["accuracy"]) for r in records if "eval" in r]
            axis.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                color=f"C{index}",
                alpha=0.8,
                linewidth=1.2,
                label=LABELS[method] if position == 0 else None,
            )
    axis.axhline(target, color="grey", linestyle="--", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_ylim(0.0, 1.0)
    axis.set_xlabel("simulated time (s, log scale)")
    axis.set_ylabel("test accuracy")
    axis.set_title(f"{dataset}: 300 client updates per method, seeds {seeds}", fontsize=9)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    path = out / f"{dataset}_accuracy_vs_sim_time.png"
    figure.savefig(path)
    pyplot.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--datasets",
        nargs="+",
        choices=list(DATASETS),
        default=["digits"],
        help=f"fashion_mnist needs {FASHION_MNIST}",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=None,
        help="test accuracy to reach (default: 0.9 on digits, 0.6 on Fashion-MNIST)",
    )
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--backend", choices=["local", "ray"], default="local")
    args = parser.parse_args(argv)
    datasets = args.datasets
    if "fashion_mnist" in datasets and not FASHION_MNIST.is_dir():
        parser.error(f"fashion_mnist needs {FASHION_MNIST} (apt-get install dataset-fashion-mnist)")
    started = time.perf_counter()
    results: dict[str, dict[str, dict]] = {}
    lines = []
    for dataset in datasets:
        results[dataset] = {}
        target = TARGETS[dataset] if args.target is None else args.target
        lines += [
            "",
            f"{dataset}: simulated seconds to test accuracy >= {target:g} and final test "
            f"accuracy, mean ± std over seeds {', '.join(map(str, args.seeds))}",
            "",
            "| method | time to target (s) | reached | final accuracy | simulated time (s) | "
            "client updates |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for method in args.methods:
            per_seed = []
            for seed in args.seeds:
                overrides = [
                    *DATASETS[dataset],
                    *METHODS[method],
                    f"run.seed={seed}",
                    f"runtime.backend={args.backend}",
                    f"devices.target={target}",
                    f"run.name={dataset}_{method}",
                ]
                config = from_dict(BASE, overrides, source=f"{dataset} {method}")
                out = args.out / dataset / method / f"seed_{seed}"
                print(f"== {dataset} {method} seed {seed} ==", flush=True)
                result = run(config, out, progress=False, tensorboard=False, overwrite=True)
                sim = result.summary["sim"]
                per_seed.append(
                    {
                        "seed": seed,
                        "time_to_target_s": sim["time_to_target_s"],
                        "target_round": sim["target_round"],
                        "final_accuracy": result.summary["final"]["accuracy"],
                        "sim_time_s": sim["sim_time_s"],
                        "clients_done": result.summary["clients_done"],
                        "staleness_mean": (sim.get("staleness") or {}).get("mean"),
                    }
                )
            reached = [r["time_to_target_s"] for r in per_seed if r["time_to_target_s"] is not None]
            t_mean, t_std = mean_std(reached)
            a_mean, a_std = mean_std([r["final_accuracy"] for r in per_seed])
            s_mean, s_std = mean_std([r["sim_time_s"] for r in per_seed])
            u_mean, _ = mean_std([r["clients_done"] for r in per_seed])
            results[dataset][method] = {
                "label": LABELS[method],
                "overrides": METHODS[method],
                "time_to_target_s": {"mean": t_mean, "std": t_std, "reached": len(reached)},
                "final_accuracy": {"mean": a_mean, "std": a_std},
                "sim_time_s": {"mean": s_mean, "std": s_std},
                "per_seed": per_seed,
            }
            time_cell = "not reached" if not reached else f"{t_mean:.1f} ± {t_std:.1f}"
            lines.append(
                f"| {LABELS[method]} | {time_cell} | {len(reached)}/{len(args.seeds)} | "
                f"{a_mean:.4f} ± {a_std:.4f} | {s_mean:.1f} ± {s_std:.1f} | {u_mean:.0f} |"
            )
        target_of = TARGETS[dataset] if args.target is None else args.target
        print(f"wrote {plot(args.out, dataset, args.methods, args.seeds, target_of)}")
    wall = time.perf_counter() - started
    lines += ["", f"wall time {wall:.0f} s (backend {args.backend})"]
    table = "\n".join(lines).lstrip("\n")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {
        "targets": {d: TARGETS[d] if args.target is None else args.target for d in datasets},
        "seeds": args.seeds,
        "base": BASE,
        "results": results,
        "wall_s": wall,
        "argv": sys.argv,
    }
    (args.out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "results.md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
