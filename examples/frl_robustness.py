"""FRL vs. its baselines: robustness to poisoning, communication, sparsity, init, non-iid.

Reproduces the tables of Mozaffari et al., "FRL: Federated Rank Learning" (USENIX Security
2023) on raysim's harness, on scikit-learn's bundled digits by default (no download), or on
MNIST / CIFAR-10 read from `--data-root` (torchvision layout):

  (a) accuracy of FedAvg, Trimmed-mean, Multi-Krum, SignSGD and FRL with 0%, 10% and 20%
      malicious clients, each under the attack made for it (naive scaling, AGR-tailored,
      AGR-tailored, sign flipping, FRL rank reversal), at several rounds (curves, not only
      the end: poisoned runs swing);
  (b) mean +- std of the final global model's test accuracy per client (the test split
      weighted by the client's label distribution; see per_client_accuracy), and upload /
      download bytes per client per round (exact, as encoded) for FedAvg, SignSGD, TopK, FRL;
  (c) FRL accuracy for k = 10% ... 90% of edges kept;
  (d) FRL vs FedAvg under the three weight initialisations;
  (e) FedAvg vs FRL under Dirichlet(1) label skew and under shards (2 classes per client).

Every run goes through `raysim.core.loop.run` with a config from configs/ plus overrides; one
Ray session serves all runs. Tables are printed and saved as CSV and markdown in --out.

`--protocol` runs table (a) under the comparison protocol instead (configs/compare_frl.yaml
through `raysim compare`): every method tuned with the same budget on validation, the winners
re-run on 3 seeds clean and under their attacks, accuracy at exactly the spec's `run.eval_at`
rounds and each client's test accuracy, mean ± std.

    python examples/frl_robustness.py --protocol --out runs/frl_protocol   # ~1 h on 2 cores
    python examples/frl_robustness.py                       # all tables on digits
    python examples/frl_robustness.py --tables a --rounds 300 --report-rounds 60 150 300
    python examples/frl_robustness.py --data mnist --data-root /data/torchvision
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim.assembly import plan_run, run
from raysim.core.algorithm import RunContext
from raysim.core.server import build_algorithm
from raysim.data.datasets import load_dataset

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# method -> (base config, overrides, the attack made against it)
METHODS = {
    "FedAvg": ("fedavg_digits_frl_setting.yaml", [], "naive_scaling"),
    "Trimmed-mean": ("fedavg_trimmed_mean_digits.yaml", [], "agr_tailored"),
    "Multi-Krum": ("fedavg_multi_krum_digits.yaml", [], "agr_tailored"),
    "SignSGD": ("signsgd_digits.yaml", [], "sign_flip"),
    "TopK": ("topk_digits.yaml", [], None),
    "FRL": ("frl_digits.yaml", [], "frl_reversal"),
}

# Data other than digits: the paper's settings (N clients, n per round, model, local epochs).
DATA_OVERRIDES = {
    "digits": [],
    "mnist": [
        "data.name=mnist",
        "model.name=lenet",
        "partition.num_clients=1000",
        "clients.per_round=25",
        "clients.local_epochs=2",
    ],
    "cifar10": [
        "data.name=cifar10",
        "model.name=conv8",
        "partition.num_clients=1000",
        "clients.per_round=25",
        "clients.local_epochs=5",
    ],
}


class Study:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.common = list(DATA_OVERRIDES[args.data])
        if args.data_root:
            self.common.append(f"data.root={args.data_root}")
        self.common += [
            f"run.rounds={args.rounds}",
            f"run.eval_every={args.eval_every}",
            # the rounds the tables name are evaluated exactly (not the nearest evaluation)
            f"run.eval_at=[{', '.join(str(r) for r in args.report_rounds if r <= args.rounds)}]",
            f"run.checkpoint_every={args.rounds}",
            f"runtime.backend={args.backend}",
        ]
        self.tables: dict[str, list[dict]] = {}
        self.done: dict[tuple, list[dict]] = {}

    def config(self, method: str, extra: list[str], seed: int):
        base, overrides, _ = METHODS[method]
        return config_module.load(
            CONFIGS / base, [*overrides, *self.common, *extra, f"run.seed={seed}"]
        )

    def run(self, method: str, extra: list[str], label: str) -> list[dict]:
        """One run per seed; returns per-seed records (curve, summary, per-client accuracy).

        Runs are memoised by (method, overrides): a setting shared by two tables runs once.
        """
        key = (method, tuple(extra))
        if key in self.done:
            return self.done[key]
        records = self.done[key] = []
        for seed in self.args.seeds:
            cfg = self.config(method, extra, seed)
            name = f"{label}-seed{seed}".replace(" ", "_").replace("%", "pct")
            started = time.perf_counter()
            result = run(  # the study's folders: each invocation replaces the last one's
                cfg, self.out / "runs" / name, progress=False, tensorboard=False, overwrite=True
            )
            curve = {}
            for line in open(self.out / "runs" / name / "metrics.jsonl"):
                record = json.loads(line)
                if "eval" in record:
                    curve[record["round"]] = record["eval"]["accuracy"]
            records.append(
                {"config": cfg, "summary": result.summary, "curve": curve, "state": result.state}
            )
            print(
                f"  {label:<36} seed {seed}: final accuracy "
                f"{result.summary['final']['accuracy']:.4f} "
                f"({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        return records

    def at(self, records: list[dict], round_number: int) -> str:
        """Mean (and std over seeds) accuracy evaluated at exactly `round_number`."""
        values = []
        for record in records:
            if round_number not in record["curve"]:
                raise SystemExit(f"round {round_number} was not evaluated (run.eval_at)")
            values.append(100 * record["curve"][round_number])
        if len(values) == 1:
            return f"{values[0]:.1f}"
        return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"

    # --- the tables -----------------------------------------------------------------------------
    def table_a(self) -> None:
        rows = []
        curves: dict[tuple[str, float], list[dict[int, float]]] = {}
        for method in ("FedAvg", "Trimmed-mean", "Multi-Krum", "SignSGD", "FRL"):
            attack = METHODS[method][2]
            for fraction in self.args.fractions:
                extra = []
                if fraction:
                    extra = [
                        f"attack.name={attack}",
                        f"attack.fraction={fraction}",
                        f"attack.pool_size={self.args.attacker_pool}",
                    ]
                label = f"{method} {int(fraction * 100)}% {attack if fraction else 'clean'}"
                records = self.run(method, extra, label)
                row = {
                    "method": method,
                    "malicious": f"{int(fraction * 100)}%",
                    "attack": attack if fraction else "none",
                }
                for round_number in self.args.report_rounds:
                    row[f"acc@{round_number}"] = self.at(records, round_number)
                rows.append(row)
                curves[(method, fraction)] = [record["curve"] for record in records]
        self.tables["a_robustness"] = rows
        plot_robustness(curves, self.args.fractions, self.out / "a_robustness.png")

    def table_b(self) -> None:
        rows = []
        for method in ("FedAvg", "SignSGD", "TopK", "FRL"):
            records = self.run(method, [], f"{method} clean")
            client_accuracy = []
            for record in records:
                client_accuracy += per_client_accuracy(record["config"], record["state"])
            summary = records[0]["summary"]
            rows.append(
                {
                    "method": method,
                    "final accuracy": self.at(records, self.args.rounds),
                    "client test accuracy mean ± std": f"{100 * np.mean(client_accuracy):.1f} ± "
                    f"{100 * np.std(client_accuracy):.1f}",
                    "upload bytes/client/round": summary["bytes_up"] // summary["clients_done"],
                    "download bytes/client/round": summary["bytes_down"] // summary["clients_done"],
                }
            )
        self.tables["b_communication"] = rows

    def table_c(self) -> None:
        rows = []
        for k in self.args.k_values:
            records = self.run("FRL", [f"algorithm.k={k}"], f"FRL k={k:.0%}")
            rows.append(
                {
                    "k (edges kept)": f"{k:.0%}",
                    **{f"acc@{r}": self.at(records, r) for r in self.args.report_rounds},
                }
            )
        self.tables["c_sparsity"] = rows

    def table_d(self) -> None:
        rows = []
        for init in ("signed_kaiming_constant", "kaiming_normal", "kaiming_uniform"):
            frl = self.run("FRL", [f"algorithm.weight_init={init}"], f"FRL {init}")
            fedavg = self.run("FedAvg", [f"model.init={init}"], f"FedAvg {init}")
            rows.append(
                {
                    "weight init": init,
                    "FRL": self.at(frl, self.args.rounds),
                    "FedAvg": self.at(fedavg, self.args.rounds),
                }
            )
        self.tables["d_init"] = rows

    def table_e(self) -> None:
        rows = []
        splits = {
            "Dirichlet beta=1": ["partition.name=dirichlet", "partition.alpha=1.0"],
            "shards (2 classes/client)": ["partition.name=shards", "partition.shards_per_client=2"],
        }
        for split_name, extra in splits.items():
            frl = self.run("FRL", extra, f"FRL {split_name}")
            fedavg = self.run("FedAvg", extra, f"FedAvg {split_name}")
            rows.append(
                {
                    "split": split_name,
                    "FedAvg": self.at(fedavg, self.args.rounds),
                    "FRL": self.at(frl, self.args.rounds),
                }
            )
        self.tables["e_noniid"] = rows

    def save(self) -> None:
        markdown = [
            f"# FRL study on {self.args.data}: {self.args.rounds} rounds, seeds "
            f"{self.args.seeds} (accuracy in %)\n"
        ]
        for name, rows in self.tables.items():
            columns = list(rows[0])
            with open(self.out / f"table_{name}.csv", "w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
            lines = [
                f"## {name}",
                "",
                "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns),
            ]
            lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
            markdown.append("\n".join(lines) + "\n")
        text = "\n".join(markdown)
        (self.out / "tables.md").write_text(text)
        print("\n" + text)
        print(f"saved CSV and markdown tables in {self.out}")


def plot_robustness(curves, fractions, path: Path) -> None:
    """Table (a) as curves: one panel per malicious fraction, test accuracy against the round
    for each method under its attack (mean over seeds, band from the lowest to the highest)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(
        1, len(fractions), figsize=(4.5 * len(fractions), 3.8), squeeze=False, sharey=True
    )
    methods = list(dict.fromkeys(method for method, _ in curves))
    for panel, fraction in zip(axes[0], fractions, strict=True):
        for index, method in enumerate(methods):
            runs = curves[(method, fraction)]
            rounds = sorted(set.intersection(*(set(curve) for curve in runs)))
            values = 100 * np.array([[curve[r] for r in rounds] for curve in runs])
            colour = f"C{index}"
            panel.plot(rounds, values.mean(axis=0), color=colour, label=method)
            panel.fill_between(rounds, values.min(axis=0), values.max(axis=0), color=colour,
                               alpha=0.2)  # fmt: skip
        panel.set_title(f"{int(fraction * 100)}% malicious", fontsize=10)
        panel.set_xlabel("round")
    axes[0][0].set_ylabel("test accuracy (%)")
    axes[0][-1].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def per_client_accuracy(cfg, state) -> list[float]:
    """Each client's test accuracy of the final global model: its accuracy on the held-out test
    split drawn with the client's own label distribution. The test points are not split among
    the clients; each client's test accuracy is the model's accuracy on each class's test
    points, weighted by the share of that class in the client's training data (the expected
    accuracy on a test set that follows the client's labels)."""
    dataset = load_dataset(cfg)
    split = plan_run(cfg, dataset).split
    ctx = RunContext(cfg, tuple(dataset.train_x.shape[1:]), dataset.num_classes)
    algorithm = build_algorithm(ctx)
    class_accuracy = np.zeros(dataset.num_classes)
    for label in range(dataset.num_classes):
        rows = np.flatnonzero(dataset.test_y == label)
        if len(rows):
            metrics = algorithm.evaluate(state, dataset.test_x[rows], dataset.test_y[rows], ctx)
            class_accuracy[label] = metrics["accuracy"]
    accuracies = []
    for client in range(split.num_clients):
        labels = dataset.train_y[split.client_indices(client)]
        if len(labels):
            shares = np.bincount(labels, minlength=dataset.num_classes) / len(labels)
            accuracies.append(float(shares @ class_accuracy))
    return accuracies


ATTACK_SCENARIOS = {"clean": 0.0, "malicious_10pct": 0.1, "malicious_20pct": 0.2}


def protocol(out: Path, overrides: list[str]) -> None:
    """Table (a) under the protocol: `raysim compare configs/compare_frl.yaml` into `out` (an
    existing comparison there is reused), then per method and scenario the test accuracy at
    each `run.eval_at` round (mean ± std over seeds) and the final models' per-client test
    accuracy (mean ± std over the clients of every seed)."""
    from raysim import compare, load_run
    from raysim.compare_spec import load_comparison

    spec = CONFIGS / "compare_frl.yaml"
    comparison = load_comparison(spec, overrides)
    if (out / "comparison.json").is_file():
        print(f"using the comparison already in {out} (delete it to run it again)", flush=True)
        report = json.loads((out / "comparison.json").read_text())
    else:
        report = compare.run_comparison(comparison, out)
    rows = []
    curves: dict[tuple[str, float], list[dict[int, float]]] = {}
    for method in comparison.methods:
        for scenario in comparison.scenarios:
            accuracy_at: dict[int, list[float]] = {}
            client_accuracy: list[float] = []
            curves[(method.name, ATTACK_SCENARIOS[scenario])] = []
            for seed in comparison.seeds:
                record = load_run(method.run_dir(out, scenario, seed))
                if not record.summary or record.state.round != record.config.run.rounds:
                    raise SystemExit(f"{record.out_dir}: the run did not finish")
                evaluated = {m["round"]: m["eval"]["accuracy"] for m in record.metrics
                             if "eval" in m}  # fmt: skip
                curves[(method.name, ATTACK_SCENARIOS[scenario])].append(evaluated)
                for round_number in record.config.run.eval_at:
                    accuracy_at.setdefault(round_number, []).append(100 * evaluated[round_number])
                client_accuracy += per_client_accuracy(record.config, record.state)
            attack = record.config.attack
            row = {
                "method": method.name,
                "malicious": f"{attack.fraction:.0%}",
                "attack": attack.name if attack.fraction else "none",
            }
            for round_number, values in accuracy_at.items():
                row[f"acc@{round_number}"] = (
                    f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"
                )
            row["client test acc, mean ± std"] = (
                f"{100 * np.mean(client_accuracy):.1f} ± {100 * np.std(client_accuracy):.1f}"
            )
            row["tuned (val)"] = ", ".join(
                f"{k.split('.')[-1]}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                for k, v in report["methods"][method.name]["best_params"].items()
            )
            rows.append(row)
    plot_robustness(curves, sorted(set(ATTACK_SCENARIOS.values())), out / "a_robustness.png")
    columns = list(rows[0])
    with open(out / "table_a_protocol.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = [
        f"# FRL study under the protocol ({spec.name}): {comparison.trials} trials per method "
        f"on {comparison.metric}, seeds {list(comparison.seeds)}; accuracy in %",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    lines += ["| " + " | ".join(str(row[c]) for c in columns) + " |" for row in rows]
    (out / "table_a_protocol.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))
    print(f"saved table_a_protocol.md / .csv and a_robustness.png in {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data",
        choices=list(DATA_OVERRIDES),
        default="digits",
        help="digits (bundled, no files) or the paper's MNIST / CIFAR-10 read from --data-root",
    )
    parser.add_argument("--data-root", help="torchvision root for mnist / cifar10")
    parser.add_argument(
        "--tables",
        nargs="+",
        default=list("abcde"),
        choices=list("abcde"),
        help="tables to run, space-separated: (a) robustness, (b) communication, "
        "(c) sparsity, (d) weight init, (e) non-iid",
    )
    parser.add_argument("--rounds", type=int, default=200, help="rounds per run")
    parser.add_argument("--eval-every", type=int, default=10, help="evaluate every N rounds")
    parser.add_argument(
        "--report-rounds",
        type=int,
        nargs="+",
        help="rounds at which tables (a) and (c) report accuracy, space-separated "
        "(none: rounds // 4 times 1, 2, 3, 4, at least --eval-every)",
    )
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=[0.0, 0.1, 0.2],
        help="fractions of malicious clients for table (a), space-separated",
    )
    parser.add_argument(
        "--k-values",
        type=float,
        nargs="+",
        default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9],
        help="FRL's k (fraction of edges kept) for table (c), space-separated",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="run seeds, space-separated; more than one gives mean ± std",
    )
    parser.add_argument(
        "--attacker-pool",
        type=int,
        default=25,
        help="malicious clients the attacker trains per round to craft its "
        "updates (FRL's code: 25)",
    )
    parser.add_argument(
        "--backend",
        choices=["ray", "local"],
        default="ray",
        help="one Ray session for every run, or in-process",
    )
    parser.add_argument("--out", default="runs/frl_robustness", help="output folder")
    parser.add_argument(
        "--protocol",
        action="store_true",
        help="table (a) under the comparison protocol (configs/compare_frl.yaml: equal tuning "
        "on validation, 3 seeds, per-client test accuracy); ignores the other options but --set",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --protocol: an override every method gets (e.g. run.rounds=50)",
    )
    args = parser.parse_args(argv)
    if args.protocol:
        protocol(Path(args.out), args.overrides)
        return 0
    # Rows and columns in numeric order whatever order the values were typed in; each value
    # is its own run (memoised by its overrides), so the order changes no number.
    args.fractions = sorted(args.fractions)
    args.k_values = sorted(args.k_values)
    if args.report_rounds:
        args.report_rounds = sorted(args.report_rounds)
    if args.data != "digits" and not args.data_root:
        parser.error(f"--data {args.data} needs --data-root (nothing is downloaded)")
    if not args.report_rounds:
        args.report_rounds = sorted(
            {max(args.eval_every, args.rounds // 4 * i) for i in (1, 2, 3, 4)}
        )
    if args.backend == "ray":
        import ray

        from raysim.config import RuntimeConfig
        from raysim.runtime.ray_cluster import connect

        connect(RuntimeConfig())  # one Ray session for every run of the study
    study = Study(args)
    for table in args.tables:
        print(f"table ({table})", flush=True)
        getattr(study, f"table_{table}")()
    study.save()
    if args.backend == "ray":
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
