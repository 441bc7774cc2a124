"""Batched against sequential clients: the numbers of docs/BATCHED.md's "Against the
sequential mode" tables (the regression configs on digits, FedAwS and its Softmax oracle on
Fashion-MNIST and on the embedding-bag synthetic XML data).

Each row runs one config twice through the public API (`raysim.run`, local backend), once with
`clients.batched=false` and once with `clients.batched=true`, and compares the two runs' final
server state (`RunResult.state.arrays`, as scripts/regression_hashes.py reads it: "params" is
theta, FedAwS's "class_embeddings" is W) and their final metrics (`RunResult.summary["final"]`:
test accuracy and test loss on digits, P@1 for FedAwS, and the final training loss). It prints
two markdown tables: per array the largest absolute difference and the relative L2 distance
||seq - batched|| / ||seq||, and the final metrics sequential / batched. The JSON of `--out`
also holds every other array of the final state (server Adam's moments) and every final
metric.

    python benchmarks/batched_vs_sequential.py --out docs/results/batched_vs_sequential.json
    python benchmarks/batched_vs_sequential.py --rows fedavg_digits topk_digits
    python benchmarks/batched_vs_sequential.py --small      # every row a few rounds: a quick check
    python benchmarks/batched_vs_sequential.py --list
    python benchmarks/batched_vs_sequential.py --print docs/results/batched_vs_sequential.json

The digits rows take about a minute on 2 cores, the FedAwS rows several minutes. Runs go one at
a time; clients train on one torch thread (the engine's `clients.num_cpus: 1`) and `--threads`
(default 1) sets the rest of the process (server step, evaluation), so a run uses one core.

The Fashion-MNIST rows need Debian's `dataset-fashion-mnist` package
(`apt-get install dataset-fashion-mnist`); a row whose dataset is missing is skipped with one
line naming it. The embedding-bag rows (`xml_embedding_bag`) are trained one client at a time
on a CPU even with `clients.batched=true` (slower batched there, docs/BATCHED.md); their batched
runs set `raysim.algorithms.fedaws_bag_batched.BATCH_ON_CPU = True`, as the tests and
scripts/regression_hashes.py do, which reaches the clients because the local backend trains
them in this process. A row whose two runs are identical bit for bit (a method that fell back
to one client at a time) is marked so.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOCAL = ["runtime.backend=local", "run.checkpoint_every=0"]
SMALL_ROUNDS = 3


@dataclass(frozen=True)
class Row:
    config: str  # a file of configs/
    rounds: int
    metric: str  # the summary's final test metric
    overrides: tuple[str, ...] = ()
    label: str = ""  # the table's name for the row (default: its name)
    bag_on_cpu: bool = False  # the batched run forces the embedding-bag clients batched
    table: str = "digits"  # which of the two tables


SOFTMAX_FMNIST = ("algorithm={name: fedaws_softmax}", "algorithm.scale=2", "clients.lr=0.001")

ROWS: dict[str, Row] = {
    "fedavg_digits": Row("fedavg_digits.yaml", 30, "accuracy"),
    "signsgd_digits": Row("signsgd_digits.yaml", 30, "accuracy"),
    "topk_digits": Row("topk_digits.yaml", 30, "accuracy"),
    "fedavg_trimmed_mean_digits": Row("fedavg_trimmed_mean_digits.yaml", 30, "accuracy"),
    "frl_digits": Row(  # trained one client at a time on a CPU: expected identical
        "frl_digits.yaml",
        30,
        "accuracy",
        label="frl_digits (not batched on a CPU: the notice, then the sequential run; "
        "its state: the rankings)",
    ),
    "fedaws_fmnist": Row("fedaws_fmnist.yaml", 15, "p@1", table="fedaws"),
    "fedaws_softmax_fmnist": Row(
        "fedaws_fmnist.yaml",
        15,
        "p@1",
        SOFTMAX_FMNIST,
        label="the same, Softmax oracle (`fedaws_softmax`, scale 2, clients.lr 0.001)",
        table="fedaws",
    ),
    "fedaws_synthetic_xml": Row(
        "fedaws_synthetic_xml.yaml",
        25,
        "p@1",
        label="`fedaws_synthetic_xml` (embedding bag, 25 rounds, batched forced on the CPU)",
        bag_on_cpu=True,
        table="fedaws",
    ),
    "fedaws_softmax_synthetic_xml": Row(
        "fedaws_softmax_synthetic_xml.yaml",
        25,
        "p@1",
        label="`fedaws_softmax_synthetic_xml` (the same)",
        bag_on_cpu=True,
        table="fedaws",
    ),
}


def run_once(row: Row, rounds: int, batched: bool, small: bool) -> dict:
    """One run of `row`; its final arrays, final metrics and wall time."""
    import raysim
    from raysim.algorithms import fedaws_bag_batched

    overrides = [*LOCAL, f"run.rounds={rounds}", *row.overrides]
    if small:  # evaluate at the last of the few rounds
        overrides.append(f"run.eval_every={rounds}")
    overrides.append(f"clients.batched={'true' if batched else 'false'}")
    forced = batched and row.bag_on_cpu
    previous = fedaws_bag_batched.BATCH_ON_CPU
    fedaws_bag_batched.BATCH_ON_CPU = forced or previous
    try:
        with tempfile.TemporaryDirectory(prefix="batched_vs_sequential-") as out:
            started = time.perf_counter()
            result = raysim.run(
                REPO / "configs" / row.config,
                Path(out) / "run",
                overrides=overrides,
                progress=False,
                tensorboard=False,
                overwrite=True,
            )
            wall = time.perf_counter() - started
    finally:
        fedaws_bag_batched.BATCH_ON_CPU = previous
    summary = result.summary or {}
    return {
        "overrides": overrides,
        "bag_batched_forced_on_cpu": forced,
        "arrays": {k: np.asarray(v) for k, v in sorted(result.state.arrays.items())},
        "final": summary.get("final") or {},
        "wall_s": wall,
        "environment": summary.get("environment") or {},
    }


def compare_arrays(seq: dict, bat: dict) -> dict:
    """Per array of the final state: max |seq - batched|, ||seq - batched|| / ||seq||, the
    largest |seq| and whether the two are equal bit for bit."""
    out = {}
    for key in sorted(set(seq) | set(bat)):
        if key not in seq or key not in bat or seq[key].shape != bat[key].shape:
            out[key] = {"problem": "in one run only, or of different shapes"}
            continue
        a = seq[key].astype(np.float64)
        b = bat[key].astype(np.float64)
        norm = float(np.linalg.norm(a))
        diff = float(np.linalg.norm(a - b))
        out[key] = {
            "max_abs_difference": float(np.max(np.abs(a - b))) if a.size else 0.0,
            "relative_l2": diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf),
            "max_abs_value": float(np.max(np.abs(a))) if a.size else 0.0,
            "identical": bool(np.array_equal(seq[key], bat[key])),
        }
    return out


def pair(a: float | None, b: float | None, least: int, fixed: bool = False) -> str:
    """'a / b' with the fewest digits (at least `least`, at most 12; decimals if `fixed`, else
    significant digits) that tell them apart; `least` digits if they agree to 12."""

    def show(x: float, digits: int) -> str:
        return f"{x:.{digits}f}" if fixed else f"{x:#.{digits}g}".rstrip(".")

    if a is None or b is None:
        return f"{a} / {b}"
    digits = least
    while digits < 12 and show(a, digits) == show(b, digits):
        digits += 1
    if show(a, digits) == show(b, digits):
        digits = least
    return f"{show(a, digits)} / {show(b, digits)}"


def cell(stats: dict | None, key: str) -> str:
    if stats is None:
        return "-"
    if "problem" in stats:
        return stats["problem"]
    if stats["identical"]:
        return "0 (identical)"
    mantissa, exponent = f"{stats[key]:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def whole_state(arrays: dict) -> dict | None:
    """'params' (theta) if the state has it, else all its arrays at once (FRL's rankings)."""
    if "params" in arrays or not arrays:
        return arrays.get("params")
    if any("problem" in stats for stats in arrays.values()):
        return {"problem": "arrays in one run only, or of different shapes"}
    return {
        "identical": all(stats["identical"] for stats in arrays.values()),
        "max_abs_difference": max(stats["max_abs_difference"] for stats in arrays.values()),
        "relative_l2": max(stats["relative_l2"] for stats in arrays.values()),
    }


def tables(results: dict) -> str:
    """The two markdown tables of docs/BATCHED.md for the rows in `results`."""
    lines = []
    digits = [n for n, r in results.items() if ROWS[n].table == "digits" and "arrays" in r]
    fedaws = [n for n, r in results.items() if ROWS[n].table == "fedaws" and "arrays" in r]
    if digits:
        lines += [
            "| config | max abs param difference | relative L2 | final accuracy seq / batched "
            "| final test loss seq / batched | final train loss seq / batched |",
            "|---|---|---|---|---|---|",
        ]
        for name in digits:
            r = results[name]
            theta = whole_state(r["arrays"])
            test = {mode: r["final"][mode].get("loss") for mode in ("sequential", "batched")}
            lines.append(
                f"| {ROWS[name].label or name} | {cell(theta, 'max_abs_difference')} "
                f"| {cell(theta, 'relative_l2')} "
                f"| {pair(r['metric']['sequential'], r['metric']['batched'], 4, fixed=True)} "
                f"| {pair(test['sequential'], test['batched'], 6)} "
                f"| {pair(r['train_loss']['sequential'], r['train_loss']['batched'], 6)} |"
            )
    if fedaws:
        if lines:
            lines.append("")
        lines += [
            "| config | max abs theta difference | relative L2 (theta) | max abs W difference "
            "| relative L2 (W) | final P@1 seq / batched | final train loss seq / batched |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in fedaws:
            r = results[name]
            theta, w = r["arrays"].get("params"), r["arrays"].get("class_embeddings")
            lines.append(
                f"| {ROWS[name].label or name} | {cell(theta, 'max_abs_difference')} "
                f"| {cell(theta, 'relative_l2')} | {cell(w, 'max_abs_difference')} "
                f"| {cell(w, 'relative_l2')} "
                f"| {pair(r['metric']['sequential'], r['metric']['batched'], 4, fixed=True)} "
                f"| {pair(r['train_loss']['sequential'], r['train_loss']['batched'], 9)} |"
            )
    return "\n".join(lines)


def measure(name: str, small: bool) -> dict:
    from raysim.errors import DataError

    row = ROWS[name]
    rounds = min(SMALL_ROUNDS, row.rounds) if small else row.rounds
    runs = {}
    for mode, batched in (("sequential", False), ("batched", True)):
        try:
            runs[mode] = run_once(row, rounds, batched, small)
        except DataError as error:
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            print(f"{name}: skipped, dataset missing: {message}", flush=True)
            return {"skipped": message}
        print(f"  {name} {mode}: {runs[mode]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    seq, bat = runs["sequential"], runs["batched"]
    return {
        "config": f"configs/{row.config}",
        "rounds": rounds,
        "overrides": {mode: runs[mode]["overrides"] for mode in runs},
        "bag_batched_forced_on_cpu": bat["bag_batched_forced_on_cpu"],
        "arrays": compare_arrays(seq["arrays"], bat["arrays"]),
        "metric_name": row.metric,
        "metric": {mode: runs[mode]["final"].get(row.metric) for mode in runs},
        "train_loss": {mode: runs[mode]["final"].get("train_loss") for mode in runs},
        "final": {mode: runs[mode]["final"] for mode in runs},
        "wall_s": {mode: runs[mode]["wall_s"] for mode in runs},
        "git_commit": seq["environment"].get("git_commit"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--out", type=Path, help="write the measurements here (JSON)")
    parser.add_argument(
        "--small", action="store_true", help=f"{SMALL_ROUNDS} rounds a row: a quick check"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--list", action="store_true", help="name the rows and exit")
    parser.add_argument(
        "--print", type=Path, metavar="JSON", help="print the tables of an --out file and exit"
    )
    args = parser.parse_args(argv)
    if args.print:
        saved = json.loads(args.print.read_text())
        if saved.get("small"):
            print(f"(--small: {SMALL_ROUNDS} rounds a row, not the rounds the labels name)")
        print(tables(saved["rows"]))
        return 0
    if args.list:
        for name, row in ROWS.items():
            print(f"{name:30s} configs/{row.config} {row.rounds} rounds {' '.join(row.overrides)}")
        return 0

    import torch

    torch.set_num_threads(args.threads)
    header = {
        "command": " ".join(["python", "benchmarks/batched_vs_sequential.py", *sys.argv[1:]]),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "small": args.small,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    results: dict[str, dict] = {}
    for name in args.rows:
        results[name] = measure(name, args.small)
        header["git_commit"] = header.get("git_commit") or results[name].get("git_commit")
        if args.out:  # after every row: a later failure keeps what ran
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({**header, "rows": results}, indent=1) + "\n")
    if args.small:
        print(f"(--small: {SMALL_ROUNDS} rounds a row, not the rounds the labels name)")
    print(tables(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
