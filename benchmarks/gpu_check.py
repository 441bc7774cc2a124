"""The prepared GPU check: every method's GPU path, timed against the CPU in the same run.

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU (< 8 minutes)
    python benchmarks/gpu_check.py --small    # the same on the CPU, small (a test runs it)

  (a) FedAvg / LeNet on MNIST-shaped synthetic data (1x28x28), clients.num_gpus 0.25 (four
      client tasks share one GPU, on the Ray backend): rounds per second (median round) with
      one client per task trained one at a time, and with clients.batched (5 clients a task,
      vmapped together), against the same run with CPU clients (one at a time).
  (b) FRL with a Conv8 supernet on CIFAR-shaped synthetic data (3x32x32, 10 classes): the
      client seconds of a round per client (the second round: the first also builds the
      supernet), a round of 10 clients on the GPU against a round of 2 on the CPU (the CPU
      reference is kept small: its round of 10 took 73 s on the H200's host).
  (c) FedAwS at full scale (synthetic_xml --scale 1: 670,091 classes, the paper's model),
      one round with the clients, the exact index search, spreadout and evaluation on the GPU
      (clients.num_gpus 1, server.num_gpus 1, local backend so every phase runs in this
      process): each phase's seconds and the peak GPU memory.
  (d) The exact index step at full scale (670,091 x 512 unit rows, top-101 of 4,000 updated
      rows): GPU against CPU seconds (median of --repeats, alternating), and how many
      neighbours the two devices agree on.
  (e) Batched clients (clients.batched, docs/BATCHED.md): FedAvg / MLP on small synthetic
      clients (8 samples each, one epoch), 100, 1,000 and 10,000 clients a round on the
      accelerator (clients.num_gpus 1, local backend), trained one after another and batched:
      clients per second (the median round of 3, the first dropped) and the final accuracies,
      which agree to float rounding. Also FedAwS's one-class clients (MLP embedding) and FRL's
      supermask clients (MLP supernet; batched on a GPU only), 100 and 1,000 a round. And
      benchmarks/bag_pooling.py at the flagship's shapes: the vmapped bag clients' pooling
      step (a gather and a sum) against embedding_bag in vmap's per-client fallback, 16, 128
      and 512 clients: milliseconds and operations a step.
  (f) The flagship, examples/fedaws_amazon670k.py's FedAwS at full scale (its `--scale 1`
      config, built by the example's own base_config: 670,091 classes, 4,000 one-class
      clients a round), 3 rounds on the Ray backend with clients.batched, the one GPU shared by
      the client tasks (clients.num_gpus 0.5) and the server actor (server.num_gpus 0.5:
      exact index search, spreadout, evaluation): each round's seconds by phase, the peak GPU
      memory in use on the device (all processes, sampled) and the host processes' peaks.

`--parts e f` (or any of a b c d e f) runs only those parts (always in the order d b a e c f).
Each part has a wall-time budget on an H200 (BUDGET_S, 465 s together); a line after each part
gives its seconds against it, and a part whose budget no longer fits in what is left of
--budget-s (480 s without --small) is skipped, with a line, so the whole check ends within it.
The JSON report is written after every part.

With --small, "accelerator" is the CPU (both columns run there, at a small scale, the Ray
backend replaced by the local one unless --backend ray) so the script and every code path it
drives stay tested on machines without a GPU. Prints a table; writes
benchmarks/results/gpu_check.json (--small: gpu_check_small.json, or --json PATH).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

import raysim
from raysim.core.run_record import spread_over_calls
from raysim.index import build_index

RESULTS = Path(__file__).resolve().parent / "results"
FLAGSHIP = Path(__file__).resolve().parents[1] / "examples" / "fedaws_amazon670k.py"
# Wall seconds each part may take on one H200, in the order they run (the longest and least
# known last, so that a kill loses only it: the report is written after every part); together
# under 8 minutes. (b) was measured there (169 s before its CPU reference shrank); the others
# are estimates: replace them with a run's `part_s`.
BUDGET_S = {"d": 45, "b": 60, "a": 60, "e": 75, "c": 75, "f": 150}


def _rounds(result) -> dict[str, list[float]]:
    """The run's phase seconds per round, from metrics.jsonl."""
    lines = (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    times: dict[str, list[float]] = {}
    for record in records:
        for key, value in record.get("time", {}).items():
            times.setdefault(key, []).append(float(value))
    # (a round run ahead in a block shares the block's wait: spread_over_calls)
    calls = [record.get("rounds_in_call", 1) for record in records]
    times["round_s"] = spread_over_calls([float(r["wall_s"]) for r in records], calls)
    return times


def _run(raw: dict, out: Path, address: str | None = None):
    return raysim.run(raw, out, address=address, progress=False, tensorboard=False)


def _backend(args) -> str:
    """The backend of the Ray parts, (a) and (f): Ray, or with --small the local backend."""
    if args.backend != "auto":
        return args.backend
    return "local" if args.small else "ray"


@contextlib.contextmanager
def _one_ray(args, backend: str):
    """One Ray (no dashboard: not this check's subject) for every run of a part, instead of a
    start and a stop per run; nothing where the backend is local or Ray is already up."""
    if backend != "ray":
        yield
        return
    from raysim.config import RuntimeConfig
    from raysim.runtime import ray_cluster

    started = ray_cluster.connect(RuntimeConfig(address=args.address, dashboard=False))
    try:
        yield
    finally:
        if started:
            ray_cluster.disconnect()


class GpuMemoryPeak:
    """The most GPU memory in use on the device while the block runs: every process (the
    driver, Ray's server actor and client workers), sampled every 0.1 s (cudaMemGetInfo).
    `baseline_bytes`: in use when it began (the driver's context, after emptying its cache)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.peak_bytes, self.baseline_bytes = enabled, 0, 0
        self._stop = threading.Event()

    def _sample(self) -> None:
        free, total = torch.cuda.mem_get_info()
        self.peak_bytes = max(self.peak_bytes, total - free)

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self._sample()

    def __enter__(self):
        if self.enabled:
            gc.collect()
            torch.cuda.empty_cache()  # what earlier parts left cached in this process
            self._sample()
            self.baseline_bytes = self.peak_bytes
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._sample()

    @property
    def peak_gib(self) -> float | None:
        return self.peak_bytes / 2**30 if self.enabled else None

    @property
    def baseline_gib(self) -> float | None:
        return self.baseline_bytes / 2**30 if self.enabled else None


def fedavg_lenet(args, accelerator: str, work: Path) -> dict:
    """(a) client tasks sharing the accelerator: rounds per second, accelerator (one client a
    task trained alone, and 5 a task batched) vs CPU."""
    rounds = 3 if args.small else 10  # the median round of 10 (the first starts the workers)
    backend = _backend(args)
    base = {
        "run": {"name": "gpu_check_fedavg", "rounds": rounds, "eval_every": rounds},
        "data": {
            "name": "synthetic_classification",
            "num_samples": 600 if args.small else 6000,
            "num_test": 200 if args.small else 1000,
            "num_classes": 10,
            "sample_shape": [1, 28, 28],
        },
        "partition": {"name": "dirichlet", "num_clients": 100, "alpha": 1.0},
        "clients": {"per_round": 20, "local_epochs": 2, "batch_size": 16, "per_task": 1},
        "model": {"name": "lenet"},
        "algorithm": {"name": "fedavg"},
        "runtime": {"backend": backend, "dashboard": False},
    }
    gpus = 0.25 if accelerator == "cuda" else 0.0
    # Batched with clients.per_task auto: one task per GPU takes the round's 20 clients and
    # trains them in one vmapped chunk (clients.batch_chunk auto: up to a round's clients).
    batched = {"batched": True, "per_task": "auto", "batch_chunk": "auto"}
    rows = {}
    with _one_ray(args, backend):
        for label, num_gpus, extra in (
            ("cpu", 0.0, {}),
            ("accelerator", gpus, {}),
            ("accelerator_batched", gpus, batched),
        ):
            raw = json.loads(json.dumps(base))
            raw["clients"].update(num_gpus=num_gpus, **extra)
            result = _run(raw, work / f"fedavg-{label}", args.address)
            packing = (result.summary.get("placement") or {}).get("packing") or {}
            rows[label] = {
                # the median round: the first one also starts workers and CUDA contexts
                "rounds_per_s": 1.0 / result.summary["median_round_s"],
                "accuracy": result.summary["final"]["accuracy"],
                "packing": packing.get("rule", f"{backend} backend"),
            }
    cpu = rows["cpu"]["rounds_per_s"]
    one, many = rows["accelerator"]["rounds_per_s"], rows["accelerator_batched"]["rounds_per_s"]
    return {
        "clients_num_gpus": gpus,
        "rounds": rounds,
        "backend": backend,
        "cpu_rounds_per_s": cpu,
        "accelerator_rounds_per_s": one,
        "speedup": one / cpu,
        "cpu_accuracy": rows["cpu"]["accuracy"],
        "accelerator_accuracy": rows["accelerator"]["accuracy"],
        "batched_packing": rows["accelerator_batched"]["packing"],
        "accelerator_batched_rounds_per_s": many,
        "batched_speedup": many / cpu,
        "batched_over_one_at_a_time": many / one,
        "accelerator_batched_accuracy": rows["accelerator_batched"]["accuracy"],
    }


def frl_conv8(args, accelerator: str, work: Path) -> dict:
    """(b) FRL Conv8 clients: client seconds per client of the second round, a round of 10 on
    the accelerator vs a round of 2 on the CPU (same clients' size: 500 samples each)."""
    per_round = {"cpu": 2, "accelerator": 2 if args.small else 10}
    samples = 40 if args.small else 500  # per client
    seconds = {}
    for label, num_gpus in (("cpu", 0.0), ("accelerator", 1.0 if accelerator == "cuda" else 0.0)):
        clients = per_round[label]
        raw = {
            "run": {"name": "gpu_check_frl", "rounds": 2, "eval_every": 2},
            "data": {
                "name": "synthetic_classification",
                "num_samples": samples * clients,
                "num_test": 100 if args.small else 200,  # evaluation is not what (b) times
                "num_classes": 10,
                # --small: 16x16 images, a 4x smaller dense layer (its scores are sorted)
                "sample_shape": [3, 16, 16] if args.small else [3, 32, 32],
            },
            "partition": {"name": "iid", "num_clients": clients},
            "clients": {"per_round": clients, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
            "model": {"name": "conv2" if args.small else "conv8"},
            "algorithm": {"name": "frl", "k": 0.5},
            "runtime": {"backend": "local"},
        }
        raw["clients"]["num_gpus"] = num_gpus
        raw["server"] = {"num_gpus": num_gpus}
        phases = _rounds(_run(raw, work / f"frl-{label}"))
        seconds[label] = phases["clients_s"][-1]
    cpu_each = seconds["cpu"] / per_round["cpu"]
    acc_each = seconds["accelerator"] / per_round["accelerator"]
    return {
        "model": "conv2" if args.small else "conv8",
        "clients": per_round["accelerator"],
        "cpu_clients": per_round["cpu"],
        "samples_per_client": samples,
        "cpu_client_s": seconds["cpu"],
        "accelerator_client_s": seconds["accelerator"],
        "cpu_s_per_client": cpu_each,
        "accelerator_s_per_client": acc_each,
        "speedup": cpu_each / acc_each,
    }


def fedaws_full_scale(args, accelerator: str, work: Path) -> dict:
    """(c) one FedAwS round with every phase on the accelerator: phase seconds, peak memory."""
    scale = 0.002 if args.small else 1.0
    on_gpu = 1.0 if accelerator == "cuda" else 0.0
    model = (
        {"bag_dim": 64, "hidden": [128, 128], "embedding_dim": 64}
        if args.small
        else {"bag_dim": 512, "hidden": [1024, 1024], "embedding_dim": 512}
    )
    raw = {
        "run": {"name": "gpu_check_fedaws", "rounds": 1, "eval_every": 1},
        "data": {"name": "synthetic_xml", "scale": scale},
        "partition": {"name": "one_class"},
        "clients": {
            "per_round": 64 if args.small else 4000,
            "local_epochs": 1,
            "batch_size": 64,
            "lr": 1.0,
            "num_gpus": on_gpu,
        },
        "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6, "num_gpus": on_gpu},
        "model": {"name": "xml_embedding_bag", **model},
        "algorithm": {
            "name": "fedaws",
            "k": 10 if args.small else 100,
            "class_lr": 0.1,
            "spreadout_lr": 0.01,
            "eval_max_points": 200 if args.small else 2000,
        },
        "index": {"backend": "exact", "options": {"device": "auto" if on_gpu else "cpu"}},
        "runtime": {"backend": "local"},
    }
    # one client per class: the number of classes comes from the data
    from raysim import config as config_module
    from raysim.data.datasets import load_dataset

    probe = config_module.from_dict({"data": dict(raw["data"])})
    dataset = load_dataset(probe)
    raw["partition"]["num_clients"] = int(len(np.unique(dataset.train_y)))
    raw["clients"]["per_round"] = min(raw["clients"]["per_round"], raw["partition"]["num_clients"])
    del dataset
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = _run(raw, work / "fedaws")
    phases = {key: values[0] for key, values in _rounds(result).items()}
    return {
        "classes": raw["partition"]["num_clients"],
        "clients": raw["clients"]["per_round"],
        "total_s": time.perf_counter() - started,
        "phases_s": phases,
        "peak_gpu_memory_gib": (
            torch.cuda.max_memory_allocated() / 2**30 if accelerator == "cuda" else None
        ),
        "p@1": result.summary["final"].get("p@1"),
    }


def _flagship_example():
    """examples/fedaws_amazon670k.py as a module (it finds example_cli beside itself)."""
    spec = importlib.util.spec_from_file_location("fedaws_amazon670k", FLAGSHIP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLAGSHIP_PHASES = ("clients_s", "aggregate_s", "index_s", "spreadout_s", "evaluate_s", "round_s")


def fedaws_flagship(args, accelerator: str, work: Path) -> dict:
    """(f) the flagship example's FedAwS at full scale, 3 rounds on Ray with batched clients on
    the one GPU: each round's seconds by phase, peak memory."""
    from raysim import config as config_module
    from raysim.data.datasets import load_dataset

    example = _flagship_example()
    rounds, scale = 3, 0.002 if args.small else 1.0
    argv = ["--scale", str(scale), "--rounds", str(rounds)]
    argv += ["--clients-per-round", "64"] if args.small else []
    argv += ["--address", args.address] if args.address else []
    options = example.parse_args(argv)
    # What the example's --scale study does before its runs (fedaws_amazon670k._study): one
    # client per class that has training points, min(4000, those) a round, the paper's k=10.
    data = {"name": "synthetic_xml", "scale": options.scale}
    probe = config_module.from_dict({"run": {"seed": options.seed}, "data": dict(data)})
    dataset = load_dataset(probe)
    classes, clients = dataset.num_classes, int(len(np.unique(dataset.train_y)))
    del dataset
    data["_num_clients"] = clients
    per_round = min(options.clients_per_round or 4000, clients)
    model = {**example.SMALL_MODEL, "embedding_dim": 64} if args.small else dict(example.FULL_MODEL)
    raw = example.base_config(options, data, model, rounds, per_round, options.k or 10)
    raw["algorithm"]["eval_max_points"] = 2000
    # The one GPU, shared: the server actor reserves half of it (exact index search, spreadout,
    # evaluation) and the client tasks the other half. Ray's fractions only schedule (each
    # process may use the whole device); server.num_gpus 1 with clients.num_gpus 1 would leave
    # no client task room to start on a one-GPU machine.
    gpus = 0.5 if accelerator == "cuda" else 0.0
    backend = _backend(args)
    raw["run"]["name"] = "gpu_check_flagship"
    raw["clients"].update(batched=True, num_gpus=gpus)
    raw["server"]["num_gpus"] = gpus
    raw["runtime"].update(backend=backend, dashboard=False)
    started = time.perf_counter()
    with _one_ray(args, backend), GpuMemoryPeak(accelerator == "cuda") as memory:
        result = _run(raw, work / "flagship", args.address)
    total_s = time.perf_counter() - started
    times = _rounds(result)
    summary = result.summary
    return {
        "example": "examples/fedaws_amazon670k.py --scale " + f"{scale:g}",
        "classes": classes,
        "clients_total": clients,
        "clients": per_round,
        "rounds": rounds,
        "backend": backend,
        "batched": True,
        "clients_num_gpus": gpus,
        "server_num_gpus": gpus,
        "total_s": total_s,
        # the phases asked about first, then any other the run reports (client_compute_s)
        "phases_s": {
            **{key: times[key] for key in FLAGSHIP_PHASES if key in times},
            **{key: values for key, values in times.items() if key not in FLAGSHIP_PHASES},
        },
        "peak_gpu_memory_gib": memory.peak_gib,
        "gpu_memory_before_gib": memory.baseline_gib,
        "driver_peak_rss_gib": summary["driver_peak_rss_bytes"] / 2**30,
        "server_peak_rss_gib": summary["server_peak_rss_bytes"] / 2**30,
        "p@1": summary["final"].get("p@1"),
    }


def exact_index_step(args, accelerator: str) -> dict:
    """(d) the exact top-(k+1) search of the updated rows: accelerator vs CPU seconds."""
    rows, dim = (20_000, 64) if args.small else (670_091, 512)
    queries, k = (256, 11) if args.small else (4000, 101)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((rows, dim), dtype=np.float32)
    weights /= np.linalg.norm(weights, axis=1, keepdims=True)
    query_ids = np.sort(rng.choice(rows, size=queries, replace=False)).astype(np.int64)
    indexes = {}
    for label, device in (("cpu", "cpu"), ("accelerator", accelerator)):
        index = build_index("exact", rows, dim, device=device)
        index.reset(weights)
        index.search(query_ids[:8], weights[query_ids[:8]], k)  # warm-up (CUDA context, BLAS)
        indexes[label] = index
    seconds: dict[str, list[float]] = {"cpu": [], "accelerator": []}
    found = {}
    for _ in range(args.repeats):  # alternating, so drift hits both alike
        for label, index in indexes.items():
            started = time.perf_counter()
            ids, _ = index.search(query_ids, weights[query_ids], k)
            if accelerator == "cuda":
                torch.cuda.synchronize()
            seconds[label].append(time.perf_counter() - started)
            found[label] = ids
    agree = np.mean(
        [len(set(a) & set(b)) / k for a, b in zip(found["cpu"], found["accelerator"], strict=True)]
    )
    cpu_s, acc_s = statistics.median(seconds["cpu"]), statistics.median(seconds["accelerator"])
    return {
        "rows": rows,
        "dim": dim,
        "queries": queries,
        "k": k,
        "cpu_s": cpu_s,
        "accelerator_s": acc_s,
        "speedup": cpu_s / acc_s,
        "neighbour_agreement": float(agree),
    }


BATCHED_METHODS = {  # (e): what each method's clients are, beside the FedAvg/MLP default
    "fedavg": {},
    # one-class clients training theta and their own class row (an MLP embedding, no bag)
    "fedaws": {
        "partition": {"name": "one_class"},
        "model": {"name": "mlp_embedding", "hidden": [64], "embedding_dim": 16},
        "algorithm": {"name": "fedaws", "spreadout": "topk", "k": 5, "class_lr": 0.1},
        "server": {"optimizer": "adam", "lr": 0.003},
    },
    # supermask clients (edge-popup on the scores; batched on a GPU only)
    "frl": {"algorithm": {"name": "frl", "k": 0.5}, "clients": {"momentum": 0.9}},
}


def batched_clients(args, accelerator: str, work: Path) -> dict:
    """(e) clients per second, one at a time vs batched, on the accelerator: FedAvg at 100,
    1,000 and 10,000 clients a round, FedAwS and FRL at 100 and 1,000."""
    sizes = {"fedavg": (10, 50), "fedaws": (10,), "frl": (10,)}
    if not args.small:
        sizes = {"fedavg": (100, 1_000, 10_000), "fedaws": (100, 1_000), "frl": (100, 1_000)}
    gpus = 1.0 if accelerator == "cuda" else 0.0
    host_time = _benchmark_module("round_host_time")  # part (e)'s config and its timers
    from raysim.core import batched_training

    vmapped_driver = {"vmapped": (batched_training, "train_batched")}
    rows = []
    for method, per_rounds in sizes.items():
        for per_round in per_rounds:
            row: dict = {"method": method, "clients_per_round": per_round}
            for mode in ("sequential", "batched"):
                raw = host_time.batched_round(
                    per_round, 3, gpus=gpus, batched=mode == "batched", name="gpu_check_batched"
                )
                for section, values in BATCHED_METHODS[method].items():
                    raw[section] = {**raw[section], **values} if section in raw else values
                with host_time.timed_calls(vmapped_driver) as spent:
                    result = _run(raw, work / f"batched-{method}-{per_round}-{mode}")
                rounds = _rounds(result)["round_s"][1:]  # the first also starts CUDA and caches
                final = result.summary["final"]
                row[f"{mode}_clients_per_s"] = per_round / statistics.median(rounds)
                # where a batched round's time goes (rounds after the first), when it batched
                if mode == "batched" and spent["vmapped"]:
                    calls = host_time.summed_per_round(spent["vmapped"], len(rounds) + 1)
                    vmapped = statistics.median(calls[1:])
                    row["batched_vmapped_s"] = vmapped
                    row["batched_host_us_per_client"] = (
                        1e6 * (statistics.median(rounds) - vmapped) / per_round
                    )
                row[f"{mode}_accuracy"] = final.get("accuracy", final.get("p@1"))
            row["speedup"] = row["batched_clients_per_s"] / row["sequential_clients_per_s"]
            rows.append(row)
    pooling = _bag_pooling_module()
    shapes = pooling.SHAPES["small" if args.small else ("cuda" if gpus else "cpu")]
    device = torch.device("cuda" if gpus else "cpu")
    bag_pooling = pooling.measure(device, shapes, repeats=3)
    return {"clients_num_gpus": gpus, "rows": rows, "bag_pooling": bag_pooling, "shapes": shapes}


def _bag_pooling_module():
    """benchmarks/bag_pooling.py as a module: the vmapped bag pooling, gather vs embedding_bag."""
    return _benchmark_module("bag_pooling")


def _benchmark_module(name: str):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).resolve().parent / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gib(value: float | None) -> str:
    return f"{value:.2f} GiB" if value is not None else "n/a (cpu)"


def _p1(value: float | None) -> str:
    return f"{value:.4f}" if value is not None else "n/a"


def table(report: dict) -> str:
    acc = report["accelerator"]
    lines = []
    if "batched" in report:
        lines += [
            f"(e) batched clients on {acc}: clients per second; a batched round's vmapped "
            "calls, and the rest of the round a client (host)",
            "| method | clients a round | one at a time | batched | ratio | "
            "accuracy (one / batched) | batched: vmapped s, host us a client |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *(
                f"| {r['method']} | {r['clients_per_round']:,} | "
                f"{r['sequential_clients_per_s']:.0f} | "
                f"{r['batched_clients_per_s']:.0f} | {r['speedup']:.2f}x | "
                f"{r['sequential_accuracy']:.4f} / {r['batched_accuracy']:.4f} | "
                f"{r.get('batched_vmapped_s', float('nan')):.3f}, "
                f"{r.get('batched_host_us_per_client', float('nan')):.1f} |"
                for r in report["batched"]["rows"]
            ),
            "",
        ]
        if "bag_pooling" in report["batched"]:
            lines += [_bag_pooling_module().table(report["batched"]["bag_pooling"], acc), ""]
    rows = []
    if "fedavg_lenet" in report:
        a = report["fedavg_lenet"]
        gpus = f"clients.num_gpus={a['clients_num_gpus']:g}"
        rows += [
            f"| (a) FedAvg/LeNet, {gpus}, one client a task, one at a time: rounds/s | "
            f"{a['cpu_rounds_per_s']:.3f} | {a['accelerator_rounds_per_s']:.3f} | "
            f"{a['speedup']:.2f}x |",
            f"| (a) FedAvg/LeNet, {gpus}, clients.batched ({a['batched_packing']}; "
            f"{a['batched_over_one_at_a_time']:.2f}x one at a time): rounds/s | "
            f"{a['cpu_rounds_per_s']:.3f} | {a['accelerator_batched_rounds_per_s']:.3f} | "
            f"{a['batched_speedup']:.2f}x |",
        ]
    if "frl_conv8" in report:
        b = report["frl_conv8"]
        rows.append(
            f"| (b) FRL {b['model']}, a round of {b['cpu_clients']} clients on cpu, "
            f"{b['clients']} on {acc}: client s per client | {b['cpu_s_per_client']:.3f} | "
            f"{b['accelerator_s_per_client']:.3f} | {b['speedup']:.2f}x |"
        )
    if "index" in report:
        d = report["index"]
        rows.append(
            f"| (d) exact index, {d['rows']:,} x {d['dim']}, top-{d['k']} of {d['queries']:,}: "
            f"s | {d['cpu_s']:.3f} | {d['accelerator_s']:.3f} | {d['speedup']:.2f}x |"
        )
    if rows:
        lines += [f"| check | cpu | {acc} | ratio |", "| --- | --- | --- | --- |", *rows, ""]
    if "fedaws" in report:
        c = report["fedaws"]
        lines += [
            f"(c) FedAwS, {c['classes']:,} classes, {c['clients']:,} clients, one round on "
            f"{acc}: {c['total_s']:.1f} s for the whole run (start, round, outputs), "
            f"p@1 {_p1(c['p@1'])}",
            "| phase | seconds |",
            "| --- | --- |",
            *(f"| {key} | {value:.3f} |" for key, value in c["phases_s"].items()),
            f"| peak GPU memory | {_gib(c['peak_gpu_memory_gib'])} |",
            "",
        ]
    if "fedaws_flagship" in report:
        f = report["fedaws_flagship"]
        rounds = range(1, f["rounds"] + 1)
        lines += [
            f"(f) FedAwS flagship ({f['example']}), {f['classes']:,} classes, {f['clients']:,} "
            f"of {f['clients_total']:,} clients a round, {f['rounds']} rounds on the "
            f"{f['backend']} backend, clients.batched, clients.num_gpus="
            f"{f['clients_num_gpus']:g}, server.num_gpus={f['server_num_gpus']:g} on {acc}: "
            f"{f['total_s']:.1f} s for the whole run, p@1 {_p1(f['p@1'])}",
            "| phase | " + " | ".join(f"round {r} s" for r in rounds) + " |",
            "| --- |" + " --- |" * len(rounds),
            *(
                f"| {key} | " + " | ".join(f"{value:.3f}" for value in values) + " |"
                for key, values in f["phases_s"].items()
            ),
            f"| peak GPU memory in use (device, all processes) | {_gib(f['peak_gpu_memory_gib'])}"
            + (
                f" ({f['gpu_memory_before_gib']:.2f} GiB before the run)"
                if f["gpu_memory_before_gib"] is not None
                else ""
            )
            + " |" * len(rounds),
            f"| peak host memory (driver / server) | {f['driver_peak_rss_gib']:.2f} / "
            f"{f['server_peak_rss_gib']:.2f} GiB" + " |" * len(rounds),
            "",
        ]
    if "index" in report:
        lines.append(
            f"exact index: the two devices agree on {report['index']['neighbour_agreement']:.4f} "
            "of the neighbours"
        )
    return "\n".join(lines).rstrip("\n")


PARTS = {  # part: the report's key, in the order they run
    "d": "index",
    "b": "frl_conv8",
    "a": "fedavg_lenet",
    "e": "batched",
    "c": "fedaws",
    "f": "fedaws_flagship",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="CPU only, small scale (tests)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of (d)")
    parser.add_argument(
        "--address", default=None, help="Ray cluster for (a) and (f) (none: local Ray)"
    )
    parser.add_argument(
        "--backend",
        choices=("auto", "ray", "local"),
        default="auto",
        help="backend of (a) and (f) (auto: ray, or local with --small)",
    )
    parser.add_argument("--json", default=None, help="where to write the JSON report")
    parser.add_argument(
        "--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="parts to run"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="skip a part whose budget (BUDGET_S) no longer fits in what is left of this many "
        "seconds (none: 480, or no limit with --small; 0: no limit)",
    )
    args = parser.parse_args(argv)
    if args.small:
        accelerator = "cpu"
    elif torch.cuda.is_available():
        accelerator = "cuda"
    else:
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); "
            "run with --small to check the same paths on the CPU",
            file=sys.stderr,
        )
        return 2
    limit = args.budget_s if args.budget_s is not None else (0.0 if args.small else 480.0)
    report = {
        "accelerator": accelerator,
        "device_name": torch.cuda.get_device_name() if accelerator == "cuda" else "cpu",
        "small": args.small,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "raysim": raysim.__version__,
        "budget_s": limit or None,
        "part_s": {},
        "skipped": [],
    }
    path = (
        Path(args.json)
        if args.json
        else RESULTS / ("gpu_check_small.json" if args.small else "gpu_check.json")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    checks = {
        "d": lambda work: exact_index_step(args, accelerator),
        "b": lambda work: frl_conv8(args, accelerator, work),
        "a": lambda work: fedavg_lenet(args, accelerator, work),
        "c": lambda work: fedaws_full_scale(args, accelerator, work),
        "f": lambda work: fedaws_flagship(args, accelerator, work),
        "e": lambda work: batched_clients(args, accelerator, work),
    }
    chosen = [part for part in PARTS if part in args.parts]
    planned = sum(BUDGET_S[part] for part in chosen)
    print(
        f"gpu_check: parts {' '.join(chosen)}, budgets on an H200 "
        f"{' + '.join(str(BUDGET_S[part]) for part in chosen)} = {planned} s"
        + (f" of --budget-s {limit:g}" if limit else ""),
        flush=True,
    )
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        work = Path(work)
        for part in chosen:
            key, budget = PARTS[part], BUDGET_S[part]
            used = time.perf_counter() - began
            if limit and used + budget > limit:
                report["skipped"].append(part)
                print(
                    f"gpu_check: ({part}) {key} skipped: its budget {budget} s does not fit in "
                    f"the {limit - used:.0f} s left of --budget-s {limit:g} (--parts {part} "
                    f"runs it alone)",
                    flush=True,
                )
                continue
            started = time.perf_counter()
            report[key] = checks[part](work)
            took = time.perf_counter() - started
            report["part_s"][part] = took
            total = time.perf_counter() - began
            print(
                f"gpu_check: ({part}) {key} done in {took:.1f} s (budget {budget} s"
                + (", over it" if took > budget and not args.small else "")
                + f"); {total:.1f} s so far"
                + (f" of {limit:g}" if limit else ""),
                flush=True,
            )
            path.write_text(json.dumps(report, indent=2) + "\n")  # what is done survives a kill
    print(table(report))
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
