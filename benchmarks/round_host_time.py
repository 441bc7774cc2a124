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

`--method frl` measures FRL's supermask clients on the same shapes instead (gpu_check part
(e)'s FRL rows). A CPU trains them one at a time (their step is slower batched there), so this
benchmark forces the batched path on to measure the host's share of a batched round, which a GPU
leaves as it is; their rank positions come from one sort per client and layer on the CPU
against one sort for all on a GPU, so that phase (`positions`) is timed apart and left out of
the host's share.

    python benchmarks/round_host_time.py [--per-round 1000 10000] [--rounds 8] [--repeats 3]
                                         [--method fedavg|frl] [--compare DIR] [--out FILE]
                                         [--small]
"""

from __future__ import annotations

import argparse
import contextlib
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
PHASES = ("round", "vmapped", "positions", "clients_rest", "server_add")
# What each method's clients are, beside batched_round's FedAvg / MLP (gpu_check part (e)).
METHODS = {
    "fedavg": {},
    "frl": {"algorithm": {"name": "frl", "k": 0.5}, "clients": {"momentum": 0.9}},
}


def batched_round(
    per_round: int, rounds: int, *, gpus: float = 0.0, batched: bool = True, name: str = "round"
) -> dict:
    """The config of gpu_check part (e)'s FedAvg rounds (also part (e)'s base for FedAwS and
    FRL): `per_round` clients of 8 synthetic samples, MLP 32-64-10, one local step, all of
    them sampled every round, chunks sized from the device's memory, the local backend."""
    return {
        "run": {"name": name, "rounds": rounds, "eval_every": rounds},
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
            "num_gpus": gpus,
            "batched": batched,
            # from the device's memory, up to the round's clients (one call)
            "batch_chunk": "auto",
        },
        "model": {"name": "mlp", "hidden": [64]},
        "algorithm": {"name": "fedavg"},
        "runtime": {"backend": "local"},
    }


@contextlib.contextmanager
def timed_calls(targets: dict[str, tuple[object, str]]):
    """While the block runs, each `name: (owner, attribute)` function is timed: yields
    {name: [seconds of each call]}; the originals are put back after."""
    spent: dict[str, list[float]] = {name: [] for name in targets}
    originals = {name: getattr(owner, attribute) for name, (owner, attribute) in targets.items()}

    def timed(name: str, original):
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[name].append(time.perf_counter() - started)

        return wrapper

    for name, (owner, attribute) in targets.items():
        setattr(owner, attribute, timed(name, originals[name]))
    try:
        yield spent
    finally:
        for name, (owner, attribute) in targets.items():
            setattr(owner, attribute, originals[name])


def summed_per_round(calls: list[float], rounds: int) -> list[float]:
    """Calls' seconds summed per round (a round makes the same number of calls: its chunks)."""
    per = max(1, len(calls) // rounds)
    return [sum(calls[i * per : (i + 1) * per]) for i in range(rounds)]


def child(clients: int, rounds: int, method: str = "fedavg") -> dict:
    """In a child process: one run of `method`; each phase's seconds per round."""
    import raysim
    from raysim.algorithms import frl
    from raysim.core import batched_training, server
    from raysim.runtime import local

    targets = {
        "vmapped": (batched_training, "train_batched"),
        "train_clients": (local, "train_clients"),
        "server_add": (server.Server, "add"),
        "positions": (frl, "batched_positions"),  # FRL's rank positions (the CPU's sorts)
    }
    raw = batched_round(clients, rounds, name="round_host_time")
    for section, values in METHODS[method].items():
        raw[section] = {**raw.get(section, {}), **values}
    if method == "frl":  # batched on the CPU too (see the module's docstring)
        frl.FRL.batching_problem = lambda self, ctx: None
    with timed_calls(targets) as spent, tempfile.TemporaryDirectory() as work:
        result = raysim.run(raw, Path(work) / "run", progress=False, tensorboard=False)
        records = [
            json.loads(line)
            for line in (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
    round_s = [record["wall_s"] for record in records]
    vmapped = summed_per_round(spent["vmapped"], rounds)
    positions = summed_per_round(spent["positions"], rounds) if spent["positions"] else None
    positions = positions or [0.0] * rounds
    return {
        "round": round_s,
        "vmapped": vmapped,
        "positions": positions,
        "clients_rest": [
            c - v - p for c, v, p in zip(spent["train_clients"], vmapped, positions, strict=True)
        ],
        "server_add": spent["server_add"],
        "final_accuracy": records[-1]["eval"]["accuracy"],
        "raysim": str(Path(raysim.__file__).parent),  # which tree ran
    }


def run_child(source: str | None, per_round: int, rounds: int, method: str = "fedavg") -> dict:
    env = dict(os.environ)
    if source is not None:  # another raysim tree first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--child", str(per_round), "--rounds", str(rounds)]
    command += ["--method", method]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"round_host_time: the child run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-round", type=int, nargs="+", default=[1_000, 10_000])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--method", choices=sorted(METHODS), default="fedavg")
    parser.add_argument("--compare", help="another raysim source tree, run alternately")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.rounds, args.method)))
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
                measured[name][per_round].append(
                    run_child(source, per_round, args.rounds, args.method)
                )
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
        "method": args.method,
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
        "| clients a round | source | round s | vmapped call s | rank positions s "
        "| clients' side beside them s | Server.add s | host us a client | clients/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['clients_per_round']:,} | {row['source']} | {row['round_s']:.3f} "
            f"| {row['vmapped_s']:.3f} | {row['positions_s']:.3f} | {row['clients_rest_s']:.3f} "
            f"| {row['server_add_s']:.3f} "
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
