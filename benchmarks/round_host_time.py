"""Where a large batched round's time goes on the host: the vmapped call, the rest of the
clients' side, the server's fold.

A batched round of thousands of small clients is one vmapped call (`train_batched`) plus
per-client Python around it: the chunk's inputs and each client's generator, its update built
and sent, then the server's checks and its fold into the float64 sum. A GPU shortens the first
only, so the second caps the clients a second any device can reach. This benchmark measures
both on the local backend with in-process timers around `train_batched`, the clients' side
(`train_clients`) and `Server.add`, for FedAvg on gpu_check part (e)'s shapes (MLP 32-64-10,
8 samples a client, one step, every client of the round in one task).

Each run is its own process; the rounds after the first two (torch.func's first call, the
collector's first full pass) give medians. `--compare DIR` also runs another raysim source tree
(e.g. a `git worktree` of an earlier commit) in alternating processes, so the two are measured
under the same load, and prints each phase's ratio.

    python benchmarks/round_host_time.py [--per-round 1000 10000] [--rounds 8] [--repeats 3]
                                         [--compare DIR] [--out FILE] [--small]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 2
PHASES = ("round", "vmapped", "clients_rest", "server_add")


def child(per_round: int, rounds: int) -> dict:
    """In a child process: one run; each phase's seconds per round."""
    import raysim
    from raysim.core import batched_training, server
    from raysim.runtime import local

    spent: dict[str, list[float]] = {"vmapped": [], "train_clients": [], "server_add": []}

    def timed(owner, name: str, key: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[key].append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    timed(batched_training, "train_batched", "vmapped")
    timed(local, "train_clients", "train_clients")
    timed(server.Server, "add", "server_add")
    raw = {
        "run": {"name": "round_host_time", "rounds": rounds, "eval_every": rounds},
        "data": {
            "name": "synthetic_classification",
            "num_samples": 8 * per_round,
            "num_test": 500,
            "num_classes": 10,
            "sample_shape": [32],
        },
        "partition": {"name": "iid", "num_clients": per_round},
        "clients": {
            "per_round": per_round,
            "local_epochs": 1,
            "batch_size": 8,
            "num_gpus": 0,
            "batched": True,
            "batch_chunk": "auto",
        },
        "model": {"name": "mlp", "hidden": [64]},
        "algorithm": {"name": "fedavg"},
        "runtime": {"backend": "local"},
    }
    with tempfile.TemporaryDirectory() as work:
        result = raysim.run(raw, Path(work) / "run", progress=False, tensorboard=False)
        records = [
            json.loads(line)
            for line in (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
    round_s = [record["wall_s"] for record in records]
    vmapped = _per_round(spent["vmapped"], rounds)
    clients = spent["train_clients"]
    return {
        "round": round_s,
        "vmapped": vmapped,
        "clients_rest": [c - v for c, v in zip(clients, vmapped, strict=True)],
        "server_add": spent["server_add"],
        "final_accuracy": records[-1]["eval"]["accuracy"],
        "raysim": str(Path(raysim.__file__).parent),  # which tree ran
    }


def _per_round(calls: list[float], rounds: int) -> list[float]:
    """The vmapped calls' seconds summed per round (a round may take several chunks)."""
    per = len(calls) // rounds
    return [sum(calls[i * per : (i + 1) * per]) for i in range(rounds)]


def run_child(source: str | None, per_round: int, rounds: int) -> dict:
    env = dict(os.environ)
    if source is not None:  # another raysim tree first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--child", str(per_round), "--rounds", str(rounds)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"round_host_time: the child run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-round", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare", help="another raysim source tree, run alternately")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.rounds)))
        return 0
    if args.small:
        args.per_round, args.rounds, args.repeats = [20], WARMUP + 2, 1
    sources = {"this tree": None}
    if args.compare:
        sources["compared"] = str(Path(args.compare).resolve())
    measured: dict = {name: {n: [] for n in args.per_round} for name in sources}
    for repeat in range(args.repeats):
        for per_round in args.per_round:
            order = list(sources.items())
            if repeat % 2:
                order.reverse()  # which goes first alternates
            for name, source in order:
                measured[name][per_round].append(run_child(source, per_round, args.rounds))
    rows = []
    for per_round in args.per_round:
        for name in sources:
            runs = measured[name][per_round]
            row = {"source": name, "clients_per_round": per_round}
            for phase in PHASES:
                # median over repetitions of each run's median over its timed rounds
                row[f"{phase}_s"] = statistics.median(
                    statistics.median(run[phase][WARMUP:]) for run in runs
                )
                row[f"{phase}_s_each"] = [statistics.median(run[phase][WARMUP:]) for run in runs]
            row["host_us_per_client"] = (
                1e6 * (row["clients_rest_s"] + row["server_add_s"]) / per_round
            )
            row["clients_per_s"] = per_round / row["round_s"]
            row["final_accuracy"] = [run["final_accuracy"] for run in runs]
            row["raysim"] = sorted({run["raysim"] for run in runs})
            rows.append(row)
    print(table(rows))
    report = {
        "rounds": args.rounds,
        "warmup_rounds": WARMUP,
        "repeats": args.repeats,
        "compare": args.compare,
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def table(rows: list[dict]) -> str:
    lines = [
        "| clients a round | source | round s | vmapped call s | clients' side beside it s "
        "| Server.add s | host us a client | clients/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['clients_per_round']:,} | {row['source']} | {row['round_s']:.3f} "
            f"| {row['vmapped_s']:.3f} | {row['clients_rest_s']:.3f} | {row['server_add_s']:.3f} "
            f"| {row['host_us_per_client']:.1f} | {row['clients_per_s']:,.0f} |"
        )
    by_size: dict = {}
    for row in rows:
        by_size.setdefault(row["clients_per_round"], {})[row["source"]] = row
    for per_round, pair in by_size.items():
        if "compared" in pair:
            ratios = ", ".join(
                f"{phase} {pair['this tree'][f'{phase}_s'] / pair['compared'][f'{phase}_s']:.2f}x"
                for phase in PHASES
            )
            lines.append(f"{per_round:,} clients, this tree / compared: {ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
