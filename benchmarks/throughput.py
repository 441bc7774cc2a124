"""Engine overhead: raysim (Ray backend, local backend) against a plain PyTorch loop.

One FedAvg workload, three ways, in one process run:
  plain   a sequential PyTorch loop over the same sampled clients, same model, same local SGD:
          the least work possible (the reference); measured with 1 thread and with torch's
          default threads
  local   raysim's in-process backend through the full round loop (outputs included)
  ray     raysim's Ray backend (client tasks + server actor) through the full round loop

Per-round times are differences of consecutive `elapsed_s` values in metrics.jsonl, so they
include everything the loop does (dispatch, aggregation, logging, checkpoints); a block of
rounds the Ray backend ran ahead shares its time equally (raysim.core.run_record.round_seconds).
The first rounds are warm-up (worker start, imports) and are dropped. Each way runs --repeats
times and keeps its best median; the plain loop is measured before Ray starts. Prints a table
and writes JSON.

    python benchmarks/throughput.py [--sizes tiny heavy] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from raysim import config as config_module
from raysim.assembly import plan_run, run
from raysim.core.algorithm import RunContext
from raysim.core.run_record import round_seconds
from raysim.data.datasets import load_dataset
from raysim.models.vector import build_model, get_vector, set_vector
from raysim.seeds import client_generator, sample_clients

WORKLOADS = {
    # digits, MLP 64-128-10, 100 clients, 10 per round, 1 epoch, batch 16
    "tiny": {
        "rounds": 60,
        "warmup": 5,
        "overrides": [
            "data.name=digits",
            "model.name=mlp",
            "model.hidden=[128]",
            "partition.name=iid",
            "partition.num_clients=100",
            "clients.per_round=10",
            "clients.local_epochs=1",
            "clients.batch_size=16",
            "clients.lr=0.05",
        ],
    },
    # LeNet on 28x28 synthetic images, 200 clients x 64 samples, 50 per round, 1 epoch
    "heavy": {
        "rounds": 8,
        "warmup": 2,
        "overrides": [
            "data.name=synthetic_classification",
            "data.num_samples=12800",
            "data.num_test=1000",
            "data.sample_shape=[1,28,28]",
            "model.name=lenet",
            "partition.name=iid",
            "partition.num_clients=200",
            "clients.per_round=50",
            "clients.local_epochs=1",
            "clients.batch_size=16",
            "clients.lr=0.05",
        ],
    },
}


def make_config(size: str, backend: str, rounds: int):
    overrides = WORKLOADS[size]["overrides"] + [
        f"runtime.backend={backend}",
        f"run.rounds={rounds}",
        f"run.eval_every={rounds}",
        f"run.checkpoint_every={rounds}",
        f"run.name=throughput_{size}",
    ]
    return config_module.from_dict({}, overrides)


def plain_loop_round_times(config, threads: int) -> list[float]:
    """FedAvg written as directly as possible: no engine, no outputs, same clients and maths."""
    dataset = load_dataset(config)
    split = plan_run(config, dataset).split
    ctx = RunContext(config, tuple(dataset.train_x.shape[1:]), dataset.num_classes)
    model = build_model(ctx)
    params = get_vector(model)
    clients = config.clients
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    times = []
    try:
        for round_index in range(config.run.rounds):
            started = time.perf_counter()
            ids = sample_clients(config.run.seed, round_index, split.num_clients, clients.per_round)
            total = np.zeros_like(params, dtype=np.float64)
            weight = 0
            for client_id in ids:
                rows = split.indices[split.offsets[client_id] : split.offsets[client_id + 1]]
                x = torch.from_numpy(dataset.train_x[rows])
                y = torch.from_numpy(dataset.train_y[rows])
                set_vector(model, params)
                optimizer = torch.optim.SGD(model.parameters(), lr=clients.lr)
                generator = client_generator(config.run.seed, round_index, int(client_id))
                for _ in range(clients.local_epochs):
                    order = torch.randperm(len(y), generator=generator)
                    for start in range(0, len(y), clients.batch_size):
                        batch = order[start : start + clients.batch_size]
                        loss = nn.functional.cross_entropy(model(x[batch]), y[batch])
                        optimizer.zero_grad(set_to_none=True)
                        loss.backward()
                        optimizer.step()
                total += len(y) * (get_vector(model) - params)
                weight += len(y)
            params = (params + total / weight).astype(np.float32)
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return times


def raysim_round_times(config) -> tuple[list[float], np.ndarray]:
    with tempfile.TemporaryDirectory() as out:
        result = run(config, out, progress=False)
        records = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return round_seconds(records), result.state.arrays["params"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, help="override the workload's round count")
    parser.add_argument("--repeats", type=int, default=3, help="runs per way (best kept)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs for the local Ray")
    parser.add_argument("--out", default="benchmarks/results/throughput.json")
    args = parser.parse_args(argv)

    import ray

    from raysim.config import RuntimeConfig
    from raysim.runtime.ray_cluster import connect

    default_threads = torch.get_num_threads()
    measured: dict[str, dict[str, float]] = {size: {} for size in args.sizes}
    rounds = {size: args.rounds or WORKLOADS[size]["rounds"] for size in args.sizes}

    def median(size: str, times: list[float]) -> float:
        return statistics.median(times[WORKLOADS[size]["warmup"] :])

    # The reference first, on a quiet machine (before Ray's processes exist): the target is
    # then as hard as it can be.
    # Every way is measured `--repeats` times and its best median kept, so a burst of
    # background load cannot decide a ratio.
    for size in args.sizes:
        config = make_config(size, "local", rounds[size])
        measured[size]["plain_1thread"] = min(
            median(size, plain_loop_round_times(config, 1)) for _ in range(args.repeats)
        )
        measured[size]["plain"] = min(
            median(size, plain_loop_round_times(config, default_threads))
            for _ in range(args.repeats)
        )

    # Ray started the way `raysim run` starts it (dashboard included), once for all runs.
    connect(RuntimeConfig(num_cpus=args.num_cpus))
    results = {
        "cpus": ray.cluster_resources().get("CPU"),
        "torch_default_threads": default_threads,
        "sizes": {},
    }
    for size in args.sizes:
        for way in ("ray", "local"):
            best = float("inf")
            for _ in range(args.repeats):
                times, params = raysim_round_times(make_config(size, way, rounds[size]))
                best = min(best, median(size, times))
            measured[size][way] = best
            if way == "ray":
                ray_params = params
            else:
                local_params = params
        reference = measured[size]["plain"]
        row = {
            "rounds": rounds[size],
            "warmup_rounds_dropped": WORKLOADS[size]["warmup"],
            "median_round_s": measured[size],
            "ray_over_plain": measured[size]["ray"] / reference,
            "local_over_plain": measured[size]["local"] / reference,
            "plain_1thread_over_default": measured[size]["plain_1thread"] / reference,
            "ray_equals_local_bitwise": bool(np.array_equal(ray_params, local_params)),
        }
        results["sizes"][size] = row
        print(
            f"\n{size}: median seconds per round over rounds "
            f"{WORKLOADS[size]['warmup'] + 1}..{rounds[size]}"
        )
        print(f"  {'way':<24}{'s/round':>10}{'x plain':>10}")
        for way in ("ray", "local", "plain_1thread", "plain"):
            label = {
                "plain": f"plain ({default_threads} threads)",
                "plain_1thread": "plain (1 thread)",
                "ray": "raysim ray backend",
                "local": "raysim local backend",
            }[way]
            seconds = measured[size][way]
            print(f"  {label:<24}{seconds:>10.4f}{seconds / reference:>10.2f}")
        print(f"  ray == local final parameters (bitwise): {row['ray_equals_local_bitwise']}")
    ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
