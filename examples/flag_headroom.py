"""FLAG's headroom on yeast: the centralized bound per seed, and the rounds FL needs to reach it.

The FLAG paper's speed metric is the number of rounds a method needs to reach 80% of the
centralized model's score. This study measures it on MULAN's yeast (river's wheel: `pip
install -e ".[data]"`) at the setting of configs/compare_flag_yeast.yaml (10 clients, all of
them every round, 1 local epoch a round, batch 32, an MLP 103-128-14, Asymmetric Loss, Adam +
OneCycleLR, 10% of the training rows held out for validation) and at the hyperparameters its
tuning chose on validation GmAP (clients.lr 0.00564, FLAG's alpha 0.270; nothing is tuned
here):

  - centralized (configs/flag_centralized.yaml: one client holding every training row, the
    same model, loss, optimizer and lr, one epoch a round) for each seed: its test mAP, and
    its GmAP on the CMDA (k-modes) clients' test rows (the rows the federated runs' GmAP
    averages over), every round (from a checkpoint a round). The bound is the final round's
    (the same number of rounds as the federated runs); the round its validation mAP peaks
    (early stopping on the held-out training rows) gives a second bound, reported beside it;
  - FedAvg (sample weights), FLAG (label occurrence read as a count, the default), FLAG with
    `algorithm.occurrence: per_sample` and uniform averaging on the k-modes split, same seeds;
  - for each federated run, the first round whose test mAP reaches 80% (also 95% and 100%) of
    the same seed's centralized test mAP, and likewise for GmAP against the centralized GmAP
    (`raysim.metrics.multilabel.rounds_to_target`; the runs evaluate every round), and the
    rounds to 80% of the validation-selected bound.

It also measures CMDA's label skew on yeast per seed (`raysim.data.cmda.split_report`: the
total pairwise KL between the clients' label distributions, epsilon-smoothed, of the runs'
own k-modes split and of a random split), the number the paper reports for its COCO split.

Prints a progress line per run, and writes OUT/headroom.md (tables, mean ± std over seeds,
ddof 1; the final metrics' ratio to FedAvg's, paired by seed), OUT/headroom.json (every
number, the per-round curves) and OUT/headroom.png (test mAP and GmAP by round, mean over
seeds, min-max shaded, the centralized curve, its final value and 80% of it); runs in
OUT/runs/<method>_seed<seed>. `--report-only` rewrites tables and figure from headroom.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim.assembly import plan_run, run
from raysim.data.datasets import load_dataset
from raysim.errors import ConfigError, DataError
from raysim.metrics.multilabel import rounds_to_target
from raysim.outputs.checkpoints import checkpoint_paths, checkpoint_round, load_checkpoint

REPO = Path(__file__).resolve().parents[1]
LR = 0.00564  # configs/compare_flag_yeast.yaml's tuned winner (validation GmAP), all methods
ALPHA = 0.270  # FLAG's tuned alpha there
COMMON = [
    "data.name=yeast",
    "data.validation_fraction=0.1",
    "run.checkpoint_every=0",
    "runtime.backend=local",
    f"clients.lr={LR}",
]
METHODS = {
    "fedavg": ["algorithm={name: multilabel_fedavg, weighting: samples}"],
    "flag": ["algorithm.name=flag", f"algorithm.alpha={ALPHA}"],
    "flag_per_sample": [
        "algorithm.name=flag",
        f"algorithm.alpha={ALPHA}",
        "algorithm.occurrence=per_sample",
    ],
    "uniform": ["algorithm={name: multilabel_fedavg, weighting: uniform}"],
}
LABELS = {
    "fedavg": "FedAvg (samples)",
    "flag": "FLAG (occurrence count)",
    "flag_per_sample": "FLAG (occurrence per_sample)",
    "uniform": "uniform averaging",
}
FRACTIONS = (0.8, 0.95, 1.0)
SCORES = ("map", "gmap")


def load(method: str, seed: int, rounds: int, split: str = "kmodes", extra: tuple = ()):
    """The config of one run: centralized, or a federated method on `split`."""
    common = [*COMMON, f"run.seed={seed}", f"run.rounds={rounds}", *extra]
    if method == "centralized":
        return config_module.load(REPO / "configs" / "flag_centralized.yaml", common)
    return config_module.load(
        REPO / "configs" / "flag_flag.yaml", [*common, f"partition.name={split}", *METHODS[method]]
    )


def check_data() -> None:
    """Stop with one clear line when MULAN's yeast cannot be read."""
    try:
        load_dataset(load("centralized", 0, 1))
    except (DataError, ConfigError) as error:
        raise SystemExit(f"flag_headroom: cannot read MULAN yeast: {error}") from None


def curves(folder: Path, rounds: int, part: str = "eval") -> dict[str, list[float]]:
    """Test (`eval`) or validation (`val`) mAP and GmAP by round from a run's metrics.jsonl
    (one evaluation a round)."""
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    evals = [r[part] for r in records if part in r]
    if len(evals) != rounds:
        raise RuntimeError(f"{folder}: {len(evals)} '{part}' evaluations for {rounds} rounds")
    return {key: [e.get(key) for e in evals] for key in SCORES}


def split_skew(seed: int) -> dict:
    """CMDA's label skew of the runs' k-modes split and of a random one (same seed): total
    and mean pairwise KL at epsilon 1e-3 (and the total at other epsilons), zero cells."""
    from raysim.data import cmda

    result = {}
    for split in ("kmodes", "random"):
        config = load("flag", seed, 1, split)
        dataset = load_dataset(config)
        train = plan_run(config, dataset).partition.train  # the run's own split
        report = cmda.split_report(dataset.train_y, train)
        k = train.num_clients
        result[split] = {
            "kl_total": report["kl_total"],
            "kl_mean_pair": report["kl_total"] / (k * (k - 1)),
            "epsilon": report["epsilon"],
            "kl_total_by_epsilon": report["kl_total_by_epsilon"],
            "zero_cells": report["zero_cells"],
            "cells": report["cells"],
            "sizes": report["sizes"].tolist(),
        }
    result["ratio"] = result["kmodes"]["kl_total"] / result["random"]["kl_total"]
    return result


def centralized(out: Path, seed: int, rounds: int) -> dict:
    """The centralized run of `seed`: test mAP and GmAP on the k-modes clients' test rows
    (what the federated runs' GmAP averages over) every round, from one checkpoint a round;
    the bound is the final round's, and `val_selected` the round of the best validation mAP
    (the first on ties)."""
    from raysim.algorithms.flag import evaluate_multilabel
    from raysim.models.vector import build_model

    folder = out / "runs" / f"centralized_seed{seed}"
    checkpoints = ("run.checkpoint_every=1", f"run.keep_checkpoints={rounds}")
    config = load("centralized", seed, rounds, extra=checkpoints)
    result = run(config, folder, progress=False, tensorboard=False, overwrite=True)
    federated = load("flag", seed, rounds)
    dataset = load_dataset(federated)
    ctx = plan_run(federated, dataset).ctx  # the k-modes clients' test rows
    model = build_model(ctx)
    paths = checkpoint_paths(folder / "checkpoints")
    if [checkpoint_round(path) for path in paths] != list(range(1, rounds + 1)):
        raise RuntimeError(f"{folder}: expected one checkpoint a round, found {len(paths)}")
    on_clients = [
        evaluate_multilabel(
            model, load_checkpoint(path)[0].arrays["params"], {}, dataset.test_x,
            dataset.test_y, ctx,
        )
        for path in paths
    ]  # fmt: skip
    curve = {key: [m[key] for m in on_clients] for key in SCORES}
    logged = curves(folder, rounds)["map"]
    if curve["map"] != logged:  # the same models on the same test rows as the run's own
        raise RuntimeError(f"seed {seed}: centralized test mAP {curve['map']} != {logged}")
    val_map = curves(folder, rounds, "val")["map"]
    chosen = int(np.argmax(val_map))
    return {
        "map": curve["map"][-1],
        "gmap": curve["gmap"][-1],
        "gmap_worst": on_clients[-1]["gmap_worst"],
        "best_map": float(np.max(curve["map"])),
        "best_map_round": int(np.argmax(curve["map"])) + 1,
        "val_selected": {
            "round": chosen + 1,
            "val_map": val_map[chosen],
            "map": curve["map"][chosen],
            "gmap": curve["gmap"][chosen],
        },
        "curves": curve,
        "val_map_curve": val_map,
        "wall_s": result.summary.get("wall_s"),
    }


def federated(out: Path, method: str, seed: int, rounds: int, bound: dict) -> dict:
    folder = out / "runs" / f"{method}_seed{seed}"
    result = run(
        load(method, seed, rounds), folder, progress=False, tensorboard=False, overwrite=True
    )
    curve = curves(folder, rounds)
    final = result.summary["final"]
    row = {
        **{key: final.get(key) for key in ("map", "gmap", "amap", "wmap")},
        "curves": curve,
        "wall_s": result.summary.get("wall_s"),
    }
    selected = bound["val_selected"]
    for key in SCORES:
        row[f"best_{key}"] = float(np.max(curve[key]))
        row[f"best_{key}_round"] = int(np.argmax(curve[key])) + 1
        row[f"{key}_ratio"] = final[key] / bound[key]
        row[f"{key}_gap"] = bound[key] - final[key]
        row[f"{key}_gap_val_selected"] = selected[key] - final[key]
        for fraction in FRACTIONS:
            hit = rounds_to_target(curve[key], fraction * bound[key])
            row[f"rounds_{key}_{round(fraction * 100)}"] = hit
        row[f"rounds_{key}_80_val_selected"] = rounds_to_target(curve[key], 0.8 * selected[key])
    return row


def mean_std(values, digits: int = 4) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1):.{digits}f}"


def rounds_cell(hits: list[int | None]) -> str:
    """'per seed (mean ± std over the seeds that reached it, reached/seeds)'."""
    shown = " / ".join("never" if h is None else str(h) for h in hits)
    reached = [h for h in hits if h is not None]
    if not reached:
        return shown
    return f"{shown} ({mean_std(reached, 1)}, {len(reached)}/{len(hits)})"


def tables(results: dict, seeds: list[int], rounds: int) -> str:
    bound = results["centralized"]
    c_rows = [bound[s] for s in seeds]
    lines = [
        f"#### Centralized bound ({rounds} rounds = {rounds} epochs, clients.lr {LR})",
        "",
        "GmAP: the centralized model on the k-modes clients' test rows. 'val-selected': the "
        "round of the best validation mAP.",
        "",
        "| seed | test mAP (final) | GmAP (final) | best test mAP (round) | val-selected round | "
        "test mAP there | GmAP there | 80% of final mAP | 80% of final GmAP |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seed, c in zip(seeds, c_rows, strict=True):
        v = c["val_selected"]
        lines.append(
            f"| {seed} | {c['map']:.4f} | {c['gmap']:.4f} | {c['best_map']:.4f} "
            f"({c['best_map_round']}) | {v['round']} | {v['map']:.4f} | {v['gmap']:.4f} | "
            f"{0.8 * c['map']:.4f} | {0.8 * c['gmap']:.4f} |"
        )
    lines.append(
        "| mean ± std | "
        + " | ".join(
            [
                mean_std([c["map"] for c in c_rows]),
                mean_std([c["gmap"] for c in c_rows]),
                mean_std([c["best_map"] for c in c_rows]),
                mean_std([c["val_selected"]["round"] for c in c_rows], 1),
                mean_std([c["val_selected"]["map"] for c in c_rows]),
                mean_std([c["val_selected"]["gmap"] for c in c_rows]),
                mean_std([0.8 * c["map"] for c in c_rows]),
                mean_std([0.8 * c["gmap"] for c in c_rows]),
            ]
        )
        + " |"
    )
    skew = [results["skew"][s] for s in seeds if s in results.get("skew", {})]
    lines += (
        []
        if len(skew) != len(seeds)
        else [
            "",
            "#### CMDA's label skew on yeast (total pairwise KL of the clients' label "
            f"distributions, epsilon {skew[0]['kmodes']['epsilon']:g}; per seed "
            f"{' / '.join(map(str, seeds))})",
            "",
            "| split | KL total | mean KL a client pair | zero client x label cells | "
            "client sizes (min-max) |",
            "|---|---|---|---|---|",
        ]
    )

    def joined(values, form: str) -> str:
        return " / ".join(form.format(v) for v in values)

    for split in ("kmodes", "random") if len(skew) == len(seeds) else ():
        rows = [x[split] for x in skew]
        cells = [
            joined([r["kl_total"] for r in rows], "{:.4g}"),
            joined([r["kl_mean_pair"] for r in rows], "{:.4g}"),
            joined([f"{r['zero_cells']}/{r['cells']}" for r in rows], "{}"),
            joined([f"{min(r['sizes'])}-{max(r['sizes'])}" for r in rows], "{}"),
        ]
        lines.append(f"| {split} | " + " | ".join(cells) + " |")
    if len(skew) == len(seeds):
        ratios = joined([x["ratio"] for x in skew], "{:.0f}x")
        lines.append(f"| k-modes / random | {ratios} | | | |")
    names = {"map": "test mAP", "gmap": "GmAP"}
    for key in SCORES:
        name = names[key]
        lines += [
            "",
            f"#### {name}: rounds to 80% / 95% / 100% of the same seed's final centralized "
            f"{name}, and to 80% of the val-selected one (k-modes split, {rounds} rounds; per "
            f"seed {' / '.join(map(str, seeds))}, then mean ± std over the seeds that reached it)",
            "",
            f"| method | final {name} | best {name} | final / centralized's (paired) | "
            "centralized - FL | val-selected centralized - FL | rounds to 80% | rounds to 95% | "
            "rounds to 100% | rounds to 80% of val-selected |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method in results["methods"]:
            runs = [results["federated"][method][s] for s in seeds]
            hits = [[r[f"rounds_{key}_{round(f * 100)}"] for r in runs] for f in FRACTIONS]
            hits.append([r[f"rounds_{key}_80_val_selected"] for r in runs])
            lines.append(
                f"| {LABELS[method]} | "
                + " | ".join(
                    mean_std([r[field] for r in runs])
                    for field in (
                        key,
                        f"best_{key}",
                        f"{key}_ratio",
                        f"{key}_gap",
                        f"{key}_gap_val_selected",
                    )
                )  # fmt: skip
                + " | "
                + " | ".join(rounds_cell(h) for h in hits)
                + " |"
            )
    if "fedavg" in results["methods"]:
        lines += [
            "",
            f"#### Final metrics / FedAvg's, paired by seed ({rounds} rounds; per seed "
            f"{' / '.join(map(str, seeds))}, then mean ± std)",
            "",
            "| method | test mAP | GmAP | AmAP | WmAP |",
            "|---|---|---|---|---|",
        ]
        reference = results["federated"]["fedavg"]
        for method in results["methods"]:
            runs = results["federated"][method]
            cells = []
            for key in ("map", "gmap", "amap", "wmap"):
                ratios = [runs[s][key] / reference[s][key] for s in seeds]
                per_seed = " / ".join(f"{r:.3f}" for r in ratios)
                cells.append(f"{per_seed} ({mean_std(ratios)})")
            lines.append(f"| {LABELS[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report_only(out: Path, plot_too: bool) -> None:
    """Rewrite OUT/headroom.md (and the figure) from OUT/headroom.json, running nothing."""
    path = out / "headroom.json"
    if not path.is_file():
        raise SystemExit(f"flag_headroom: --report-only needs {path}, which does not exist")
    results = json.loads(path.read_text())
    seeds, rounds = results["seeds"], results["rounds"]
    for part in ("centralized", "skew"):
        results[part] = {int(k): v for k, v in results.get(part, {}).items()}
    results["federated"] = {
        m: {int(k): v for k, v in by.items()} for m, by in results["federated"].items()
    }
    text = header(results) + tables(results, seeds, rounds)
    print(text)
    (out / "headroom.md").write_text(text + "\n")
    written = [out / "headroom.md"]
    if plot_too:
        written.append(plot(out, results, seeds, rounds))
    print(f"\nwrote {', '.join(map(str, written))} from {path}")


def header(results: dict) -> str:
    rounds = results["rounds"]
    return (
        f"Yeast, k-modes (CMDA) split, 10 clients all every round, {rounds} rounds, seeds "
        f"{', '.join(map(str, results['seeds']))}; clients.lr {results['lr']} for every run, "
        f"FLAG alpha {results['alpha']}; test metrics; mean ± std (ddof 1) over seeds. 'never': "
        f"not reached within {rounds} rounds.\n\n"
    )


def plot(out: Path, results: dict, seeds: list[int], rounds: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 2, figsize=(11, 4))
    steps = np.arange(1, rounds + 1)
    for axis, key, name in zip(axes, SCORES, ("test mAP", "GmAP"), strict=True):
        for index, method in enumerate(results["methods"]):
            values = np.array([results["federated"][method][s]["curves"][key] for s in seeds])
            axis.plot(steps, values.mean(axis=0), color=f"C{index}", label=LABELS[method])
            axis.fill_between(steps, values.min(axis=0), values.max(axis=0), color=f"C{index}",
                              alpha=0.15, lw=0)  # fmt: skip
        central = np.array([results["centralized"][s]["curves"][key] for s in seeds])
        axis.plot(steps, central.mean(axis=0), color="k", lw=1, ls="--",
                  label="centralized, by epoch")  # fmt: skip
        bound = float(np.mean([results["centralized"][s][key] for s in seeds]))
        axis.axhline(bound, color="k", lw=1, label="centralized final (mean over seeds)")
        axis.axhline(0.8 * bound, color="k", lw=1, ls=":", label="80% of centralized")
        axis.set(xlabel="round", ylabel=name, title=f"{name}, k-modes split")
        axis.legend(fontsize=7)
    figure.tight_layout()
    path = out / "headroom.png"
    figure.savefig(path, dpi=90)
    pyplot.close(figure)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--out", default="runs/flag_headroom", help="output folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds")
    parser.add_argument("--rounds", type=int, default=20, help="rounds (centralized: epochs)")
    methods = list(METHODS)
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods, help="FL methods")
    parser.add_argument("--no-plot", action="store_true", help="skip OUT/headroom.png")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rewrite OUT/headroom.md (and the figure) from OUT/headroom.json",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    out = Path(args.out)
    if args.report_only:
        report_only(out, not args.no_plot)
        return
    check_data()
    started = time.perf_counter()
    results: dict = {
        "seeds": args.seeds,
        "rounds": args.rounds,
        "lr": LR,
        "alpha": ALPHA,
        "methods": args.methods,
        "split": "kmodes",
        "centralized": {},
        "federated": {method: {} for method in args.methods},
        "skew": {seed: split_skew(seed) for seed in args.seeds},
    }
    for seed in args.seeds:
        skew = results["skew"][seed]
        print(
            f"seed {seed} CMDA label KL total: k-modes {skew['kmodes']['kl_total']:.4g}, random "
            f"{skew['random']['kl_total']:.4g} ({skew['ratio']:.0f}x)",
            flush=True,
        )
    total = len(args.seeds) * (1 + len(args.methods))
    done = 0
    for seed in args.seeds:
        t0 = time.perf_counter()
        bound = centralized(out, seed, args.rounds)
        results["centralized"][seed] = bound
        done += 1
        print(
            f"[{done}/{total}] seed {seed} centralized      test mAP {bound['map']:.4f} "
            f"(best {bound['best_map']:.4f} at round {bound['best_map_round']}) GmAP "
            f"{bound['gmap']:.4f} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        for method in args.methods:
            t0 = time.perf_counter()
            row = federated(out, method, seed, args.rounds, bound)
            results["federated"][method][seed] = row
            done += 1
            print(
                f"[{done}/{total}] seed {seed} {method:<16} test mAP {row['map']:.4f} GmAP "
                f"{row['gmap']:.4f}; rounds to 80% of centralized mAP {row['rounds_map_80']}, "
                f"GmAP {row['rounds_gmap_80']} ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    results["wall_s"] = wall = time.perf_counter() - started
    text = header(results) + tables(results, args.seeds, args.rounds)
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "headroom.md").write_text(text + "\n")
    payload = {
        **results,
        "centralized": {str(k): v for k, v in results["centralized"].items()},
        "skew": {str(k): v for k, v in results["skew"].items()},
        "federated": {
            m: {str(k): v for k, v in by.items()} for m, by in results["federated"].items()
        },
    }
    (out / "headroom.json").write_text(json.dumps(payload, indent=1, default=float) + "\n")
    written = [out / "headroom.md", out / "headroom.json"]
    if not args.no_plot:
        written.append(plot(out, results, args.seeds, args.rounds))
    print(f"\nwrote {', '.join(map(str, written))} in {wall:.0f} s")


if __name__ == "__main__":
    main()
