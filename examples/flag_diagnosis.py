"""Why FLAG equals FedAvg on yeast: CMDA on and off, and FLAG's weights round by round.

A small study on MULAN's yeast (river's wheel: `pip install -e ".[data]"`), the setting of
configs/compare_flag_yeast.yaml (10 clients, all of them every round, 10% of the training rows
held out for validation, an MLP), at the hyperparameters that comparison's tuning chose on
validation GmAP (clients.lr 0.00564 for both methods, FLAG's alpha 0.270; nothing is tuned
here, so no test number chooses anything). For each seed and each client split:

  - split `kmodes` (CMDA: k-modes on the label vectors) and `random` (CMDA off);
  - FLAG (label-adaptive weights) and FedAvg (sample-count weights), same seed, same split.

Every run aggregates through `diag_label_weighted`, registered here: FLAG's own aggregator
(`raysim.algorithms.flag.LabelWeightedMean`, same options, same arithmetic, so every number is
the one `aggregator: auto` gives) that also records, each round, from the contributions it
aggregates: FLAG's label weights w_flag (alpha 0.270), FedAvg's sample weights w_n, uniform
1/K, their total-variation distances TV(a, b) = 0.5 * sum_c |a_c - b_c|, and how far the two
weightings move the round's update: ||sum_c (w_flag,c - w_n,c) u_c|| / ||sum_c w_n,c u_c||.

`--occurrence` picks how FLAG reads its label occurrence O_c (`algorithm.occurrence`, see
`raysim.algorithms.flag.label_weights`): `count` (default, positive labels: the runs before
the option, bit for bit) or `per_sample` (positive labels per sample of the client); the
recorded w_flag uses the same reading in the FedAvg runs too.

Prints the table (mean ± std over seeds, ddof 1) and writes OUT/diagnosis.json,
OUT/diagnosis.md and OUT/diagnosis.png (the curves, the seeds' spread shaded). `--small` runs
2 rounds of one seed and checks that the recording aggregator changes nothing (final metrics
equal to a run with `aggregator: auto`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim import registry
from raysim.algorithms.flag import (
    OCCURRENCES,
    LabelWeightedMean,
    client_occurrence,
    label_weights,
)
from raysim.assembly import run

REPO = Path(__file__).resolve().parents[1]
LR = 0.00564  # configs/compare_flag_yeast.yaml's tuned winner (validation GmAP), both methods
ALPHA = 0.270  # FLAG's tuned alpha there
METHODS = {
    "flag": ["algorithm.name=flag", f"algorithm.alpha={ALPHA}"],
    "fedavg": ["algorithm={name: multilabel_fedavg, weighting: samples}"],
}


def method_overrides(method: str, occurrence: str) -> list[str]:
    """METHODS[method], with FLAG's occurrence reading when it is not the default."""
    if method == "flag" and occurrence != "count":
        return [*METHODS[method], f"algorithm.occurrence={occurrence}"]
    return METHODS[method]


SPLITS = ("kmodes", "random")
METRICS = ("gmap", "amap", "wmap", "map")


class DiagnosticLabelWeightedMean(LabelWeightedMean):
    """LabelWeightedMean that records, per round, the weights FLAG and FedAvg would give the
    same contributions (FLAG's under this aggregator's `occurrence` reading). Aggregates
    exactly as its parent (the parent's own method)."""

    records: list[dict] = []  # the local backend aggregates in this process

    def aggregate(self, contributions, info=None):
        wideness = np.array([c.stats["label_wideness"] for c in contributions])
        occurrence = np.array([c.stats["positive_labels"] for c in contributions])
        samples = np.array([c.num_samples for c in contributions], dtype=np.float64)
        w_flag = label_weights(
            wideness, client_occurrence(occurrence, samples, self.occurrence), ALPHA
        )
        w_n = samples / samples.sum()
        w_u = np.full(len(samples), 1.0 / len(samples))
        updates = np.stack([c.update.astype(np.float64) for c in contributions])
        by_samples = w_n @ updates
        moved = float(np.linalg.norm((w_flag - w_n) @ updates) / np.linalg.norm(by_samples))
        DiagnosticLabelWeightedMean.records.append(
            {
                "clients": [int(c.client_id) for c in contributions],
                "w_flag": w_flag.tolist(),
                "w_samples": w_n.tolist(),
                "label_wideness": wideness.tolist(),
                "positive_labels": occurrence.tolist(),
                "num_samples": samples.tolist(),
                "tv_flag_samples": float(0.5 * np.abs(w_flag - w_n).sum()),
                "tv_flag_uniform": float(0.5 * np.abs(w_flag - w_u).sum()),
                "tv_samples_uniform": float(0.5 * np.abs(w_n - w_u).sum()),
                "update_rel_diff": moved,
            }
        )
        return super().aggregate(contributions, info)


registry.aggregators.register("diag_label_weighted", DiagnosticLabelWeightedMean)


def load(
    method: str,
    split: str,
    seed: int,
    rounds: int,
    diagnostic: bool = True,
    occurrence: str = "count",
):
    weighting = "flag" if method == "flag" else "samples"
    options = f"weighting: {weighting}, alpha: {ALPHA}"
    if occurrence != "count":
        options += f", occurrence: {occurrence}"
    aggregator = [f"aggregator={{name: diag_label_weighted, {options}}}"] if diagnostic else []
    return config_module.load(
        REPO / "configs" / "flag_flag.yaml",
        [
            "data.name=yeast",
            "data.validation_fraction=0.1",
            "run.checkpoint_every=0",
            "runtime.backend=local",
            f"run.seed={seed}",
            f"run.rounds={rounds}",
            f"clients.lr={LR}",
            f"partition.name={split}",
            *method_overrides(method, occurrence),
            *aggregator,
        ],
    )


def one_run(
    out: Path, method: str, split: str, seed: int, rounds: int, occurrence: str = "count"
) -> dict:
    DiagnosticLabelWeightedMean.records = []
    folder = out / "runs" / f"{method}_{split}_seed{seed}"
    result = run(
        load(method, split, seed, rounds, occurrence=occurrence),
        folder,
        progress=False,
        tensorboard=False,
        overwrite=True,
    )
    records = DiagnosticLabelWeightedMean.records
    if len(records) != rounds:
        raise RuntimeError(f"{folder}: {len(records)} aggregations recorded for {rounds} rounds")
    final = result.summary["final"]
    return {
        **{key: final.get(key) for key in METRICS},
        "tv_flag_samples": float(np.mean([r["tv_flag_samples"] for r in records])),
        "tv_flag_uniform": float(np.mean([r["tv_flag_uniform"] for r in records])),
        "tv_samples_uniform": float(np.mean([r["tv_samples_uniform"] for r in records])),
        "update_rel_diff": float(np.mean([r["update_rel_diff"] for r in records])),
        "wall_s": result.summary.get("wall_s"),
        "rounds": records,
    }


def mean_std(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{np.mean(values):.4f} ± {np.std(values, ddof=1):.4f}"


def table(results: dict, seeds: list[int]) -> str:
    lines = [
        "| split | method | GmAP | mAP | AmAP | WmAP | GmAP / FedAvg's (paired) | "
        "TV(w_flag, w_n) | TV(w_flag, 1/K) | TV(w_n, 1/K) | update moved |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for split in SPLITS:
        for method in METHODS:
            runs = [results[split][method][s] for s in seeds]
            ratio = [
                results[split][method][s]["gmap"] / results[split]["fedavg"][s]["gmap"]
                for s in seeds
            ]
            cells = [mean_std([r[key] for r in runs]) for key in ("gmap", "map", "amap", "wmap")]
            weights = [
                mean_std([r[key] for r in runs])
                for key in (
                    "tv_flag_samples",
                    "tv_flag_uniform",
                    "tv_samples_uniform",
                    "update_rel_diff",
                )
            ]
            lines.append(
                f"| {split} | {method} | "
                + " | ".join(cells)
                + f" | {mean_std(ratio)} | "
                + " | ".join(weights)
                + " |"
            )
    return "\n".join(lines)


def gmap_curve(out: Path, method: str, split: str, seed: int) -> dict[int, float]:
    """Test GmAP by round, from the run's records (the runs evaluate every round)."""
    path = out / "runs" / f"{method}_{split}_seed{seed}" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["round"]: r["eval"]["gmap"] for r in records if "eval" in r}


def plot(out: Path, results: dict, seeds: list[int]) -> Path:
    """OUT/diagnosis.png: test GmAP against the round (left) and how far FLAG's weights are
    from the sample weights, and how far they move the update (right), each the mean over
    the seeds with the min-max spread shaded."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    def shaded(axis, rounds, values, colour, style, label):
        values = np.asarray(values, dtype=np.float64)  # [seeds, rounds]
        axis.plot(rounds, values.mean(axis=0), color=colour, linestyle=style, label=label)
        axis.fill_between(rounds, values.min(axis=0), values.max(axis=0), color=colour,
                          alpha=0.2, lw=0)  # fmt: skip

    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4))
    for index, split in enumerate(SPLITS):
        for method, style in zip(METHODS, ("-", "--"), strict=True):
            curves = [gmap_curve(out, method, split, seed) for seed in seeds]
            rounds = sorted(curves[0])
            shaded(left, rounds, [[c[r] for r in rounds] for c in curves], f"C{index}", style,
                   f"{method}, {split} split")  # fmt: skip
        flag_rounds = [results[split]["flag"][seed]["rounds"] for seed in seeds]
        steps = np.arange(1, len(flag_rounds[0]) + 1)
        for key, style, what in (("tv_flag_samples", "-", "TV(w_flag, w_n)"),
                                 ("update_rel_diff", ":", "update moved")):  # fmt: skip
            shaded(right, steps, [[r[key] for r in runs] for runs in flag_rounds], f"C{index}",
                   style, f"{what}, {split} split")  # fmt: skip
    left.set(xlabel="round", ylabel="test GmAP", title="GmAP (mean over seeds, min-max shaded)")
    right.set(xlabel="round", ylabel="distance", title="FLAG's weights against FedAvg's")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    path = out / "diagnosis.png"
    figure.savefig(path, dpi=90)
    pyplot.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", default="runs/flag_diagnosis", help="output folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per run")
    parser.add_argument(
        "--occurrence",
        choices=OCCURRENCES,
        default="count",
        help="FLAG's label occurrence (algorithm.occurrence): count = positive labels, "
        "per_sample = positive labels per sample of the client",
    )
    parser.add_argument(
        "--small",
        action="store_true",
        help="quick check: 2 rounds, seed 0, plus a run with aggregator auto that must give "
        "the same final metrics as the recording aggregator",
    )
    args = parser.parse_args()
    if args.small:
        args.seeds, args.rounds = [0], 2
    out = Path(args.out)
    started = time.perf_counter()
    results: dict = {split: {method: {} for method in METHODS} for split in SPLITS}
    for seed in args.seeds:
        for split in SPLITS:
            for method in METHODS:
                t0 = time.perf_counter()
                r = one_run(out, method, split, seed, args.rounds, args.occurrence)
                results[split][method][seed] = r
                print(
                    f"seed {seed} {split:<6} {method:<6} GmAP {r['gmap']:.4f} mAP {r['map']:.4f}"
                    f" TV(flag, samples) {r['tv_flag_samples']:.4f} update moved "
                    f"{r['update_rel_diff']:.4f} ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    check = None
    if args.small:  # the recording aggregator must not change any number
        plain = run(
            load("flag", "kmodes", 0, args.rounds, diagnostic=False, occurrence=args.occurrence),
            out / "runs" / "flag_kmodes_seed0_auto",
            progress=False,
            tensorboard=False,
            overwrite=True,
        ).summary["final"]
        recorded = results["kmodes"]["flag"][0]
        check = {key: [plain.get(key), recorded[key]] for key in METRICS}
        same = all(a == b for a, b in check.values())
        print(f"aggregator auto vs diag_label_weighted, final metrics identical: {same}")
        if not same:
            raise SystemExit(f"the recording aggregator changed the results: {check}")
    text = (
        f"Rounds {args.rounds}, seeds {', '.join(map(str, args.seeds))}; clients.lr {LR}, FLAG "
        f"alpha {ALPHA}, FLAG occurrence {args.occurrence}; test metrics, mean ± std (ddof 1) "
        "over seeds; TV and 'update moved' are means over rounds, then over seeds.\n\n"
        + table(results, args.seeds)
    )
    print("\n" + text)
    wall = time.perf_counter() - started
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.md").write_text(text + "\n")
    payload = {
        "seeds": args.seeds,
        "rounds": args.rounds,
        "lr": LR,
        "alpha": ALPHA,
        "occurrence": args.occurrence,
        "identity_check": check,
        "wall_s": wall,
        "results": {
            s: {m: {str(k): v for k, v in runs.items()} for m, runs in by.items()}
            for s, by in results.items()
        },
    }
    (out / "diagnosis.json").write_text(json.dumps(payload, indent=1, default=float) + "\n")
    figure = plot(out, results, args.seeds)
    print(f"\nwrote {out / 'diagnosis.md'}, diagnosis.json and {figure.name} in {wall:.0f} s")


if __name__ == "__main__":
    main()
