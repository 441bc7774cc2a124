"""Scale in the number of registered clients: 100 clients per round out of 1K ... 1M.

Every size trains the same amount per round (100 clients x `--samples-per-client` synthetic
samples, MLP), so seconds per round should not grow with the number of registered clients:
sampling is O(clients per round), the split is two CSR arrays in the object store, and nothing
per round touches all clients. Each size runs in its own process (own Ray, own peak-RSS
reading). Reports seconds per round (median after warm-up), the peak RSS of the driver and of
the server actor, and the driver's memory growth:
    driver_growth = driver peak RSS - RSS before loading data (after imports)
    driver_extra  = driver_growth - dataset bytes
With the Ray backend the features are loaded by a task straight into the object store, so the
driver holds only labels, the split and the test set: driver_growth itself is the honest number
and driver_extra (the issue's "beyond the dataset itself") is smaller still.

    python benchmarks/scale_clients.py [--clients 1000 10000 100000 1000000] [--out FILE]

`--per-round 10 100 1000 10000` measures the other axis instead: seconds per round against
clients per round, sequential vs batched clients (`clients.batched`, docs/BATCHED.md), on the
local backend in this process (the same synthetic MLP workload, `--samples-per-client`
samples each, every registered client sampled every round). The two modes alternate within
each repetition (which goes first rotates) and every size is repeated `--repeats` times, so
their ratio survives a machine whose load drifts; the table gives medians over repetitions.

    python benchmarks/scale_clients.py --per-round 10 100 1000 10000 [--repeats 3]
                                       [--rounds 4] [--method fedavg|fedaws] [--out FILE]

`--method fedaws` measures FedAwS's one-class clients instead (FedAwS's cross-device setting:
the same synthetic data in min(100, clients a round) classes, `partition.name=one_class`, an
MLP embedding 16-64-16, spreadout over the top 10 classes, each client training theta and its
own class row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from raysim.core.run_record import round_seconds as run_round_seconds

ROUNDS, WARMUP = 20, 3


def one_size(num_clients: int, samples_per_client: int, num_cpus: int | None) -> dict:
    """Runs in a child process: one simulation with `num_clients` registered clients."""
    from raysim import config as config_module
    from raysim.assembly import run
    from raysim.process_memory import peak_rss_bytes

    baseline = peak_rss_bytes()  # after importing torch, ray and raysim
    num_samples = num_clients * samples_per_client
    overrides = [
        "data.name=synthetic_classification",
        f"data.num_samples={num_samples}",
        "data.num_test=2000",
        "data.sample_shape=[16]",
        "model.name=mlp",
        "model.hidden=[64]",
        "partition.name=iid",
        f"partition.num_clients={num_clients}",
        "clients.per_round=100",
        "clients.local_epochs=1",
        "clients.batch_size=16",
        f"run.rounds={ROUNDS}",
        f"run.eval_every={ROUNDS}",
        f"run.checkpoint_every={ROUNDS}",
        "runtime.backend=ray",
    ]
    if num_cpus:
        overrides.append(f"runtime.num_cpus={num_cpus}")
    config = config_module.from_dict({}, overrides)
    with tempfile.TemporaryDirectory() as out:
        result = run(config, out, progress=False, tensorboard=False)
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    round_s = run_round_seconds(records)[WARMUP:]
    dataset_bytes = num_samples * 16 * 4 + num_samples * 8  # float32 features + int64 labels
    summary = result.summary
    return {
        "num_clients": num_clients,
        "num_samples": num_samples,
        "median_round_s": statistics.median(round_s),
        "driver_peak_rss_bytes": summary["driver_peak_rss_bytes"],
        "server_peak_rss_bytes": summary["server_peak_rss_bytes"],
        "driver_baseline_rss_bytes": baseline,
        "dataset_bytes": dataset_bytes,
        "driver_growth_bytes": summary["driver_peak_rss_bytes"] - baseline,
        "driver_extra_bytes": summary["driver_peak_rss_bytes"] - baseline - dataset_bytes,
        "final_accuracy": summary["final"].get("accuracy"),
    }


def fedaws_overrides(per_round: int) -> list[str]:
    """--method fedaws: one-class clients of min(100, clients) classes (every class needs a
    client), an MLP embedding, spreadout over the top 10 (fewer with fewer classes)."""
    classes = min(100, per_round)
    k = min(10, classes - 2)
    return [
        f"data.num_classes={classes}",
        "partition.name=one_class",
        "model.name=mlp_embedding",
        "model.embedding_dim=16",
        f"algorithm={{name: fedaws, spreadout: topk, k: {k}, class_lr: 0.1, spreadout_lr: 0.01}}",
        "server.optimizer=adam",
        "server.lr=0.003",
    ]


def per_round_config(
    per_round: int, samples_per_client: int, rounds: int, batched: bool, method: str = "fedavg"
):
    from raysim import config as config_module

    overrides = [
        "data.name=synthetic_classification",
        f"data.num_samples={per_round * samples_per_client}",
        "data.num_test=500",
        "data.sample_shape=[16]",
        "model.name=mlp",
        "model.hidden=[64]",
        "partition.name=iid",
        f"partition.num_clients={per_round}",
        f"clients.per_round={per_round}",
        "clients.local_epochs=1",
        "clients.batch_size=16",
        f"clients.batched={'true' if batched else 'false'}",
        f"run.rounds={rounds}",
        f"run.eval_every={rounds}",
        f"run.checkpoint_every={rounds}",
        "runtime.backend=local",
    ]
    if method == "fedaws":
        overrides += fedaws_overrides(per_round)
    return config_module.from_dict({}, overrides)


def round_seconds(config, warmup: int) -> tuple[float, float]:
    """(median s/round after `warmup` rounds, final accuracy) of one local run."""
    from raysim.assembly import run

    with tempfile.TemporaryDirectory() as out:
        result = run(config, out, progress=False, tensorboard=False)
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    seconds = run_round_seconds(records)[warmup:]
    final = result.summary["final"]
    return float(statistics.median(seconds)), float(final.get("accuracy", final.get("p@1")))


def per_round_table(args) -> int:
    import contextlib
    import io

    rows = []
    warmup = 1
    for per_round in args.per_round:
        times: dict[str, list[float]] = {"sequential": [], "batched": []}
        accuracy: dict[str, float] = {}
        for rep in range(args.repeats):
            modes = ["sequential", "batched"] if rep % 2 == 0 else ["batched", "sequential"]
            for mode in modes:
                config = per_round_config(
                    per_round, args.samples_per_client, args.rounds, mode == "batched", args.method
                )
                with contextlib.redirect_stdout(io.StringIO()):  # the run's header line
                    seconds, accuracy[mode] = round_seconds(config, warmup)
                times[mode].append(seconds)
        ratios = [b / s for b, s in zip(times["batched"], times["sequential"], strict=True)]
        row = {
            "clients_per_round": per_round,
            "sequential_round_s": statistics.median(times["sequential"]),
            "batched_round_s": statistics.median(times["batched"]),
            "batched_over_sequential": statistics.median(ratios),
            "per_repetition": times,
            "accuracy": accuracy,
        }
        rows.append(row)
        print(
            f"measured {per_round} clients a round: {row['sequential_round_s']:.4f} s "
            f"sequential, {row['batched_round_s']:.4f} s batched",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"\nseconds per round (median of {args.repeats} repetitions, each the median of rounds "
        f"{warmup + 1}..{args.rounds}), local backend, "
        + (
            "FedAwS, one-class clients of min(100, clients) classes, MLP embedding 16-64-16, "
            if args.method == "fedaws"
            else "FedAvg, MLP 16-64-10, "
        )
        + f"{args.samples_per_client} samples a client, 1 epoch, batch 16"
    )
    print(
        f"{'clients/round':>14}{'sequential s':>14}{'batched s':>11}{'batched/seq':>13}"
        f"{'acc seq':>9}{'acc bat':>9}"
    )
    for row in rows:
        print(
            f"{row['clients_per_round']:>14}{row['sequential_round_s']:>14.4f}"
            f"{row['batched_round_s']:>11.4f}{row['batched_over_sequential']:>13.2f}"
            f"{row['accuracy']['sequential']:>9.4f}{row['accuracy']['batched']:>9.4f}"
        )
    suffix = "" if args.method == "fedavg" else f"_{args.method}"
    out = (
        args.out
        if args.out != DEFAULT_OUT
        else f"benchmarks/results/scale_clients_per_round{suffix}.json"
    )
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        json.dumps(
            {
                "method": args.method,
                "rounds": args.rounds,
                "warmup": warmup,
                "repeats": args.repeats,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nwrote {out}")
    return 0


DEFAULT_OUT = "benchmarks/results/scale_clients.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--clients", type=int, nargs="+", default=[1_000, 10_000, 100_000, 1_000_000]
    )
    parser.add_argument("--samples-per-client", type=int, default=4)
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument(
        "--per-round",
        type=int,
        nargs="+",
        help="clients per round to measure, sequential vs batched (e.g. 10 100 1000 10000)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="with --per-round (3)")
    parser.add_argument("--rounds", type=int, default=4, help="with --per-round (4, 1 warm-up)")
    parser.add_argument(
        "--method",
        choices=["fedavg", "fedaws"],
        default="fedavg",
        help="with --per-round: FedAvg's clients (default) or FedAwS's one-class clients",
    )
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.per_round:
        if args.rounds < 2 or args.repeats < 1:
            parser.error("--rounds must be >= 2 and --repeats >= 1")
        return per_round_table(args)
    if args.child:
        print("RESULT " + json.dumps(one_size(args.child, args.samples_per_client, args.num_cpus)))
        return 0

    rows = []
    for num_clients in args.clients:
        command = [
            sys.executable,
            __file__,
            "--child",
            str(num_clients),
            "--samples-per-client",
            str(args.samples_per_client),
        ]
        if args.num_cpus:
            command += ["--num-cpus", str(args.num_cpus)]
        completed = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
        if completed.returncode != 0 or not lines:
            print(completed.stdout[-3000:], completed.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"size {num_clients} failed (exit {completed.returncode})")
        rows.append(json.loads(lines[-1][len("RESULT ") :]))
        print(f"measured {num_clients} clients", file=sys.stderr, flush=True)

    reference = rows[0]["median_round_s"]
    mb = 1 / 2**20
    print(f"\n100 clients per round, median s/round over rounds {WARMUP + 1}..{ROUNDS}")
    print(
        f"{'clients':>10}{'s/round':>10}{'x 1st':>8}{'driver MB':>11}{'driver growth MB':>18}"
        f"{'dataset MB':>12}{'server MB':>11}"
    )
    for row in rows:
        row["round_s_over_first"] = row["median_round_s"] / reference
        print(
            f"{row['num_clients']:>10}{row['median_round_s']:>10.4f}"
            f"{row['round_s_over_first']:>8.2f}{row['driver_peak_rss_bytes'] * mb:>11.0f}"
            f"{row['driver_growth_bytes'] * mb:>18.0f}{row['dataset_bytes'] * mb:>12.0f}"
            f"{row['server_peak_rss_bytes'] * mb:>11.0f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"rounds": ROUNDS, "warmup": WARMUP, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
