"""FedAwS at extreme scale: every class is a client that holds only positives.

Reproduces the comparison of Yu et al., "Federated Learning with Only Positive Labels"
(ICML 2020) on raysim: FedAwS (positive loss + spreadout with top-k negative mining over a
sharded nearest-class index) against Baseline-1 (positive loss only, class embeddings trained:
they collapse), Baseline-2 (class embeddings frozen at their random init) and the Softmax
oracle (every client sees all class embeddings and trains a full softmax), with P@1/3/5
against all true labels of each test point and the per-round time split.

    python examples/fedaws_amazon670k.py                      # embedded default, ~11 min
    python examples/fedaws_amazon670k.py --address auto       # the same on a Ray cluster
    python examples/fedaws_amazon670k.py --scale 1 --rounds 2 # Amazon-670K-shaped, 670,091 classes
    python examples/fedaws_amazon670k.py --data-dir ~/xc/Amazon670K --rounds 200
    python examples/fedaws_amazon670k.py --methods fedaws softmax --rounds 100
    python examples/fedaws_amazon670k.py --full               # the protocol study, ~80 min
    python examples/fedaws_amazon670k.py --scale 1 --batched  # clients batched (for a GPU)

--full runs the comparison under raysim's protocol (configs/compare_fedaws.yaml through
`raysim compare`): FedAwS, Baseline-1, Baseline-2 and the Softmax oracle each tuned with the
same 3 trials on a validation split, each winner re-run on seeds 0, 1, 2, test P@1/3/5 as
mean ± std with the ratio to the oracle per seed. The default run uses preset settings (chosen
on seed 0 of this data: a demonstration, not a tuned comparison).

The default is synthetic XML data (raysim's `synthetic_xml` generator) sized so that every
class is visited often enough to learn on 2 cores: learning is limited by visits per class
(rounds x clients per round / classes), which the table prints. It runs two regimes: C/d >= 30
(the paper's; random class rows are far from orthogonal there, so Baseline-2 fails) and
C/d < 10 (random rows are nearly orthogonal and Baseline-2 comes close), and FedAwS with an
approximate index next to exact mining.

Outputs in --out: results.json, table.md, ratio_curve_<regime>.csv for every regime that ran
both FedAwS and the oracle (FedAwS P@1 / oracle P@1 per evaluated round: ratio_curve_Cd8.csv on
the default; ratio_curve_C<classes>.csv with --scale / --data-dir when the oracle runs, which
it does up to 20,000 classes) and one run folder per
regime and method, e.g. Cd8_FedAwS (metrics.jsonl, TensorBoard, checkpoints).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim.assembly import run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # example_cli, beside this file
from example_cli import old_method_form  # noqa: E402

# The embedded default: small synthetic XML data, two regimes of C/d.
DEFAULT_DATA = {
    "num_labels": 512,
    "num_features": 4096,
    "num_train": 16384,
    "num_test": 2048,
}
REGIMES = {  # name: embedding dim d (C = 512 classes)
    "C/d=8": 64,  # the main setting: every method, and FedAwS with approximate mining
    "C/d=32": 16,  # the paper's regime: random class rows are far from orthogonal
}
# Amazon-670K's paper setting (the FedAwS paper's model), used with --scale and --data-dir.
FULL_MODEL = {"bag_dim": 512, "hidden": [1024, 1024], "embedding_dim": 512}
SMALL_MODEL = {"bag_dim": 64, "hidden": [128, 128]}

METHODS = {  # name: (algorithm, its option overrides, index override or None)
    "FedAwS": ("fedaws", {}, None),
    "Baseline-1": ("fedaws", {"spreadout": "none"}, None),
    "Baseline-2": ("fedaws", {"train_class_embeddings": False}, None),
    "Softmax": ("fedaws_softmax", {}, None),
    # FedAwS with approximate negative mining, judged end to end against exact mining.
    "FedAwS IVF": ("fedaws", {}, "faiss"),
    "FedAwS HNSW": ("fedaws", {}, "hnsw"),
}
# --methods takes these keys (no spaces, no capitals, so they need no quoting); the display
# names above stay the names in the tables, results.json and the run folders.
METHOD_KEYS = {
    "fedaws": "FedAwS",
    "baseline1": "Baseline-1",
    "baseline2": "Baseline-2",
    "softmax": "Softmax",
    "fedaws_ivf": "FedAwS IVF",
    "fedaws_hnsw": "FedAwS HNSW",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto', ray://HOST:PORT); none: start a local Ray",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="Extreme Classification Repository folder with train.txt and test.txt "
        "(instead of the embedded synthetic data)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="run the protocol comparison instead (configs/compare_fedaws.yaml: equal tuning "
        "budgets on validation, 3 seeds; ~45 min on 2 cores)",
    )
    parser.add_argument(
        "--scale",
        type=float,
        default=None,
        help="synthetic_xml at this scale of Amazon-670K (1 = 670,091 classes) instead of the "
        "embedded default",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds per run (none: 500 on the embedded data, 2 with --scale or --data-dir)",
    )
    parser.add_argument(
        "--clients-per-round",
        type=int,
        default=None,
        help="clients per round (none: 64 on the embedded data, min(4000, classes) with "
        "--scale or --data-dir)",
    )
    parser.add_argument(
        "--index",
        choices=("exact", "faiss", "hnsw"),
        default="exact",
        help="nearest-class index for FedAwS's negative mining (faiss = IVF)",
    )
    parser.add_argument("--shards", type=int, default=1, help="nearest-class index shards")
    parser.add_argument(
        "--k",
        type=int,
        default=None,
        help="negatives mined per class (none: 20 on the embedded data, the paper's 10 with "
        "--scale or --data-dir)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHOD_KEYS),
        default=None,
        metavar="METHOD",
        help="methods to run, space-separated, from: "
        + ", ".join(f"{key} ({name})" for key, name in METHOD_KEYS.items())
        + " (none: every method the regime runs)",
    )
    parser.add_argument(
        "--batched",
        action="store_true",
        help="train each task's clients together (clients.batched, docs/BATCHED.md): on a GPU "
        "the one-class clients of a round in one vmapped step; results agree with the default "
        "sequential clients to float rounding",
    )
    parser.add_argument("--seed", type=int, default=0, help="run seed (data, init, sampling)")
    parser.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate every N rounds (none: rounds // 20, at least 1)",
    )
    parser.add_argument("--out", default="runs/fedaws_amazon670k", help="output folder")
    argv = sys.argv[1:] if argv is None else list(argv)
    return parser.parse_args(old_method_form(argv, METHOD_KEYS, "fedaws_amazon670k.py"))


def index_section(kind: str, shards: int) -> dict:
    """The nearest-class index: exact, faiss IVF (nlist ~ sqrt(C), 8 probes, retrained every
    25 updates) or HNSW (hnswlib graph; rows moved by more than 0.01 are re-linked)."""
    if kind == "exact":
        return {"backend": "exact", "shards": shards}
    if kind == "faiss":
        return {
            "backend": "faiss_ivf",
            "shards": shards,
            "retrain_every": 25,
            "options": {"nprobe": 8},
        }
    return {"backend": "hnsw", "shards": shards, "options": {"relink_distance": 0.01}}


def base_config(args, data: dict, model: dict, rounds: int, per_round: int, k: int) -> dict:
    return {
        "run": {
            "name": "fedaws",
            "seed": args.seed,
            "rounds": rounds,
            "eval_every": args.eval_every or max(1, rounds // 20),
            "checkpoint_every": 0,
        },
        "data": data,
        "partition": {"name": "one_class", "num_clients": data.pop("_num_clients")},
        # One local step on the client's whole data (batch 64 covers most one-class
        # clients); the server applies Adam to the mean theta delta (the paper: Adagrad for
        # the network, SGD for the class embeddings). Class rows move with class_lr on the
        # client and spreadout's lambda * spreadout_lr = 0.1 on the server; these were chosen
        # on seed 0 of the default data (a larger pull collapses the rows, a larger push
        # keeps them from settling).
        "clients": {
            "per_round": per_round,
            "local_epochs": 1,
            "batch_size": 64,
            "lr": 1.0,
            "per_task": "auto",
            "batched": bool(getattr(args, "batched", False)),
        },
        "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6},
        "model": {"name": "xml_embedding_bag", **model},
        "algorithm": {"name": "fedaws", "k": k, "class_lr": 0.1, "spreadout_lr": 0.01},
        "index": index_section(args.index, args.shards),
        "runtime": {"backend": "ray", "address": args.address},
    }


def run_method(name: str, raw: dict, out: Path, address: str | None) -> dict:
    algorithm, options, index = METHODS[name]
    raw = json.loads(json.dumps(raw))
    if index is not None:
        raw["index"] = index_section(index, raw["index"]["shards"])
    raw["algorithm"] = {**raw["algorithm"], "name": algorithm, **options}
    if algorithm == "fedaws_softmax":  # full softmax: no rows to pull, nothing to spread
        raw["algorithm"] = {"name": algorithm}
    config = config_module.from_dict(raw, source=f"{name} config")
    print(f"\n== {name} ==", flush=True)
    started = time.perf_counter()
    # The study owns its folders: each invocation replaces the runs of the one before.
    result = run(config, out, address=address, progress=True, overwrite=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = {}
    for record in records:
        for key, value in record.get("time", {}).items():
            times[key] = times.get(key, 0.0) + float(value or 0.0)
    rounds = max(1, len(records))
    return {
        "final": result.summary["final"],
        "wall_s": time.perf_counter() - started,
        "per_round_s": {key: value / rounds for key, value in times.items()},
        "curve": [(r["round"], r["eval"].get("p@1")) for r in records if "eval" in r],
    }


def most_frequent_label_p1(dataset) -> float:
    """P@1 of always predicting the most frequent training label (the collapse yardstick)."""
    labels = dataset.train_label_sets
    labels = labels[labels >= 0] if labels is not None else dataset.train_y
    top = np.bincount(labels, minlength=dataset.num_classes).argmax()
    test = np.asarray(dataset.test_y)
    test = test[:, None] if test.ndim == 1 else test
    return float((test == top).any(axis=1).mean())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.full:  # the comparison under the protocol (raysim/compare.py)
        from raysim import compare
        from raysim.compare_spec import load_comparison

        spec = Path(__file__).resolve().parents[1] / "configs" / "compare_fedaws.yaml"
        compare.run_comparison(load_comparison(spec), out / "full", address=args.address)
        return 0
    from raysim.config import RuntimeConfig
    from raysim.runtime import ray_cluster

    started_ray = ray_cluster.connect(RuntimeConfig(address=args.address), args.address)
    try:
        return _study(args, out)
    finally:
        if started_ray:
            ray_cluster.disconnect()


def _study(args, out: Path) -> int:
    from raysim.data.datasets import load_dataset

    settings = []  # (regime label, base raw config, methods)
    if args.data_dir or args.scale is not None:
        if args.data_dir:
            data = {"name": "extreme_classification", "root": args.data_dir}
        else:
            data = {"name": "synthetic_xml", "scale": args.scale}
        probe = config_module.from_dict({"run": {"seed": args.seed}, "data": dict(data)})
        dataset = load_dataset(probe)
        classes = int(len(np.unique(dataset.train_y)))
        data["_num_clients"] = classes
        rounds = args.rounds or 2
        per_round = min(args.clients_per_round or 4000, classes)
        raw = base_config(args, data, dict(FULL_MODEL), rounds, per_round, args.k or 10)
        raw["algorithm"]["eval_max_points"] = 2000
        # The oracle would send all of W (C x 512 floats) to every client: only for small C.
        names = ["FedAwS", "Baseline-1", "Baseline-2"] + (["Softmax"] if classes <= 20000 else [])
        settings.append((f"C={dataset.num_classes}", raw, names, dataset))
    else:
        data = {"name": "synthetic_xml", **DEFAULT_DATA}
        probe = config_module.from_dict({"run": {"seed": args.seed}, "data": dict(data)})
        dataset = load_dataset(probe)
        classes = int(len(np.unique(dataset.train_y)))
        rounds = args.rounds or 500
        per_round = args.clients_per_round or 64
        for regime, dim in REGIMES.items():
            regime_data = {**data, "_num_clients": classes}
            model = {**SMALL_MODEL, "embedding_dim": dim}
            raw = base_config(args, regime_data, model, rounds, per_round, args.k or 20)
            names = list(METHODS) if regime == "C/d=8" else ["FedAwS", "Baseline-2"]
            if args.index != "exact":  # the user's index for every FedAwS run
                names = [n for n in names if n not in ("FedAwS IVF", "FedAwS HNSW")]
            settings.append((regime, raw, names, dataset))
    if args.methods:
        wanted = {METHOD_KEYS[key] for key in args.methods}
        settings = [(r, raw, [m for m in names if m in wanted], d) for r, raw, names, d in settings]

    needs_hnsw = args.index == "hnsw" or any("FedAwS HNSW" in names for *_, names, _ in settings)
    asked_for_hnsw = args.index == "hnsw" or "fedaws_hnsw" in (args.methods or ())
    if needs_hnsw and not asked_for_hnsw and importlib.util.find_spec("hnswlib") is None:
        # The default table without its one HNSW row (a plain `pip install -e .` has no
        # hnswlib): the other rows still run, and the line says how to get the missing one.
        print(
            "fedaws_amazon670k: hnswlib is not installed, so the table has no FedAwS HNSW row "
            "(pip install -e '.[hnsw]', which builds with a C++ compiler, adds it)",
            flush=True,
        )
        settings = [
            (r, raw, [m for m in names if m != "FedAwS HNSW"], d) for r, raw, names, d in settings
        ]
        needs_hnsw = False
    if needs_hnsw and importlib.util.find_spec("hnswlib") is None:
        # Checked before any run: the comparison would otherwise stop after hours of others.
        raise SystemExit(
            "fedaws_amazon670k: the HNSW comparison needs hnswlib: pip install -e '.[hnsw]' "
            "(builds with a C++ compiler), or leave it out with --methods fedaws baseline1 "
            "baseline2 softmax fedaws_ivf"
        )
    results = {}
    for regime, raw, names, dataset in settings:
        visits = (
            raw["run"]["rounds"] * raw["clients"]["per_round"] / raw["partition"]["num_clients"]
        )
        print(
            f"\n### regime {regime}: {dataset.num_classes} classes, "
            f"d={raw['model']['embedding_dim']}, {raw['partition']['num_clients']} clients, "
            f"{raw['clients']['per_round']} per round, {raw['run']['rounds']} rounds -> "
            f"{visits:.3g} visits per class",
            flush=True,
        )
        for name in names:
            folder = out / f"{regime.replace('/', '').replace('=', '')}_{name}"
            results[(regime, name)] = run_method(name, raw, folder, args.address)
            results[(regime, name)]["visits_per_class"] = visits
        results[(regime, "most_frequent")] = most_frequent_label_p1(dataset)

    write_report(results, out)
    return 0


def regime_order(regime: str) -> float:
    """The number after the regime's last '=' ("C/d=8" -> 8): sorted as text, C/d=32 would
    come before C/d=8."""
    return float(regime.rsplit("=", 1)[1])


def write_report(results: dict, out: Path) -> None:
    lines = [
        "| regime | method | P@1 | P@3 | P@5 | P@1 / oracle | mean cos(W) | visits/class | "
        "clients s/round | aggregate s/round | index s/round | spreadout s/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    nan = float("nan")
    regimes = sorted({r for r, _ in results}, key=regime_order)
    payload = {}
    for regime in regimes:
        oracle = results.get((regime, "Softmax"), {}).get("final", {}).get("p@1")
        for (r, name), value in results.items():
            if r != regime or name == "most_frequent":
                continue
            final, times = value["final"], value["per_round_s"]
            ratio = f"{final['p@1'] / oracle:.2f}" if oracle else "-"
            lines.append(
                f"| {regime} | {name} | {final['p@1']:.4f} | {final['p@3']:.4f} | "
                f"{final['p@5']:.4f} | {ratio} | {final.get('class_cosine_mean', nan):.3f} "
                f"| {value['visits_per_class']:.3g} | {times.get('clients_s', 0):.3f} | "
                f"{times.get('aggregate_s', 0):.3f} | {times.get('index_s', 0):.3f} | "
                f"{times.get('spreadout_s', 0):.3f} |"
            )
            payload[f"{regime}/{name}"] = value
        frequent = results.get((regime, "most_frequent"))
        if frequent is not None:
            lines.append(
                f"| {regime} | always the most frequent label | {frequent:.4f} | | | | | | | | | |"
            )
            payload[f"{regime}/most_frequent_p@1"] = frequent
        fedaws = results.get((regime, "FedAwS"))
        if fedaws and oracle:
            oracle_curve = dict(results[(regime, "Softmax")]["curve"])
            path = out / f"ratio_curve_{regime.replace('/', '').replace('=', '')}.csv"
            with path.open("w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["round", "fedaws_p@1", "softmax_p@1", "ratio"])
                for round_index, p1 in fedaws["curve"]:
                    reference = oracle_curve.get(round_index)
                    ratio = p1 / reference if reference else float("nan")
                    writer.writerow([round_index, p1, reference, ratio])
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=float))


if __name__ == "__main__":
    sys.exit(main())
