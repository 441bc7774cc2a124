"""The prepared GPU check: every method's GPU path, timed against the CPU in the same run.

    python benchmarks/gpu_check.py            # on a machine with a CUDA GPU (< 8 minutes)
    python benchmarks/gpu_check.py --small    # the same on the CPU, small (a test runs it)

  (a) FedAvg / LeNet on MNIST-shaped synthetic data (1x28x28), clients.num_gpus 0.25 (four
      client tasks share one GPU, one client per task, on the Ray backend): rounds per second
      (median round) against the same run with CPU clients.
  (b) FRL with a Conv8 supernet on CIFAR-shaped synthetic data (3x32x32, 10 classes): the
      client seconds of a round (the second: the first also builds the supernet), GPU
      against CPU.
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
      supermask clients (MLP supernet; batched on a GPU only), 100 and 1,000 a round.

`--parts e` (or any of a b c d e) runs only those parts.

With --small, "accelerator" is the CPU (both columns run there, at a small scale, the Ray
backend replaced by the local one) so the script and every code path it drives stay tested on
machines without a GPU. Prints a table; writes benchmarks/results/gpu_check.json (--small:
gpu_check_small.json, or --json PATH).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import raysim
from raysim.index import build_index

RESULTS = Path(__file__).resolve().parent / "results"


def _rounds(result) -> dict[str, list[float]]:
    """The run's phase seconds per round, from metrics.jsonl."""
    lines = (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    times: dict[str, list[float]] = {}
    for record in records:
        for key, value in {"round_s": record["wall_s"], **record.get("time", {})}.items():
            times.setdefault(key, []).append(float(value))
    return times


def _run(raw: dict, out: Path, address: str | None = None):
    return raysim.run(raw, out, address=address, progress=False, tensorboard=False)


def fedavg_lenet(args, accelerator: str, work: Path) -> dict:
    """(a) client tasks sharing the accelerator: rounds per second, accelerator vs CPU."""
    rounds = 3 if args.small else 20
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
        "runtime": {"backend": "local" if args.small else "ray"},
    }
    gpus = 0.25 if accelerator == "cuda" else 0.0
    rows = {}
    for label, num_gpus in (("cpu", 0.0), ("accelerator", gpus)):
        raw = json.loads(json.dumps(base))
        raw["clients"]["num_gpus"] = num_gpus
        result = _run(raw, work / f"fedavg-{label}", args.address)
        rows[label] = {
            # the median round: the first one also starts workers and CUDA contexts
            "rounds_per_s": 1.0 / result.summary["median_round_s"],
            "accuracy": result.summary["final"]["accuracy"],
        }
    return {
        "clients_num_gpus": gpus,
        "rounds": rounds,
        "cpu_rounds_per_s": rows["cpu"]["rounds_per_s"],
        "accelerator_rounds_per_s": rows["accelerator"]["rounds_per_s"],
        "speedup": rows["accelerator"]["rounds_per_s"] / rows["cpu"]["rounds_per_s"],
        "cpu_accuracy": rows["cpu"]["accuracy"],
        "accelerator_accuracy": rows["accelerator"]["accuracy"],
    }


def frl_conv8(args, accelerator: str, work: Path) -> dict:
    """(b) one FRL round of Conv8 clients: client seconds, accelerator vs CPU."""
    per_round = 2 if args.small else 10
    raw_base = {
        "run": {"name": "gpu_check_frl", "rounds": 2, "eval_every": 2},
        "data": {
            "name": "synthetic_classification",
            "num_samples": 40 * per_round if args.small else 500 * per_round,
            "num_test": 100 if args.small else 1000,
            "num_classes": 10,
            "sample_shape": [3, 32, 32],
        },
        "partition": {"name": "iid", "num_clients": per_round},
        "clients": {"per_round": per_round, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
        "model": {"name": "conv2" if args.small else "conv8"},
        "algorithm": {"name": "frl", "k": 0.5},
        "runtime": {"backend": "local"},
    }
    seconds = {}
    for label, num_gpus in (("cpu", 0.0), ("accelerator", 1.0 if accelerator == "cuda" else 0.0)):
        raw = json.loads(json.dumps(raw_base))
        raw["clients"]["num_gpus"] = num_gpus
        raw["server"] = {"num_gpus": num_gpus}
        phases = _rounds(_run(raw, work / f"frl-{label}"))
        seconds[label] = phases["clients_s"][-1]
    return {
        "model": raw_base["model"]["name"],
        "clients": per_round,
        "cpu_client_s": seconds["cpu"],
        "accelerator_client_s": seconds["accelerator"],
        "speedup": seconds["cpu"] / seconds["accelerator"],
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
    rows = []
    for method, per_rounds in sizes.items():
        for per_round in per_rounds:
            row: dict = {"method": method, "clients_per_round": per_round}
            for mode in ("sequential", "batched"):
                raw = {
                    "run": {"name": "gpu_check_batched", "rounds": 3, "eval_every": 3},
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
                        "batched": mode == "batched",
                        # one chunk up to 1,024 clients: on a GPU a chunk is padded to this many
                        "batch_chunk": min(per_round, 1024),
                    },
                    "model": {"name": "mlp", "hidden": [64]},
                    "algorithm": {"name": "fedavg"},
                    "runtime": {"backend": "local"},
                }
                for section, values in BATCHED_METHODS[method].items():
                    raw[section] = {**raw[section], **values} if section in raw else values
                result = _run(raw, work / f"batched-{method}-{per_round}-{mode}")
                rounds = _rounds(result)["round_s"][1:]  # the first also starts CUDA and caches
                final = result.summary["final"]
                row[f"{mode}_clients_per_s"] = per_round / statistics.median(rounds)
                row[f"{mode}_accuracy"] = final.get("accuracy", final.get("p@1"))
            row["speedup"] = row["batched_clients_per_s"] / row["sequential_clients_per_s"]
            rows.append(row)
    return {"clients_num_gpus": gpus, "rows": rows}


def table(report: dict) -> str:
    acc = report["accelerator"]
    lines = []
    if "batched" in report:
        lines += [
            f"(e) batched clients on {acc}: clients per second",
            "| method | clients a round | one at a time | batched | ratio | "
            "accuracy (one / batched) |",
            "| --- | --- | --- | --- | --- | --- |",
            *(
                f"| {r['method']} | {r['clients_per_round']:,} | "
                f"{r['sequential_clients_per_s']:.0f} | "
                f"{r['batched_clients_per_s']:.0f} | {r['speedup']:.2f}x | "
                f"{r['sequential_accuracy']:.4f} / {r['batched_accuracy']:.4f} |"
                for r in report["batched"]["rows"]
            ),
            "",
        ]
    if not all(key in report for key in ("fedavg_lenet", "frl_conv8", "fedaws", "index")):
        return "\n".join(lines)
    a, b, c, d = (report[key] for key in ("fedavg_lenet", "frl_conv8", "fedaws", "index"))
    lines += [
        f"| check | cpu | {acc} | ratio |",
        "| --- | --- | --- | --- |",
        f"| (a) FedAvg/LeNet, clients.num_gpus={a['clients_num_gpus']:g}: rounds/s | "
        f"{a['cpu_rounds_per_s']:.3f} | {a['accelerator_rounds_per_s']:.3f} | "
        f"{a['speedup']:.2f}x |",
        f"| (b) FRL {b['model']}, one round of {b['clients']} clients: client s | "
        f"{b['cpu_client_s']:.2f} | {b['accelerator_client_s']:.2f} | {b['speedup']:.2f}x |",
        f"| (d) exact index, {d['rows']:,} x {d['dim']}, top-{d['k']} of {d['queries']:,}: s | "
        f"{d['cpu_s']:.3f} | {d['accelerator_s']:.3f} | {d['speedup']:.2f}x |",
        "",
        f"(c) FedAwS, {c['classes']:,} classes, {c['clients']:,} clients, one round on {acc}: "
        f"{c['total_s']:.1f} s for the whole run (start, round, outputs), p@1 {c['p@1']}",
        "| phase | seconds |",
        "| --- | --- |",
        *(f"| {key} | {value:.3f} |" for key, value in c["phases_s"].items()),
        "| peak GPU memory | "
        + (
            f"{c['peak_gpu_memory_gib']:.2f} GiB |"
            if c["peak_gpu_memory_gib"] is not None
            else "n/a (cpu) |"
        ),
        f"exact index: the two devices agree on {d['neighbour_agreement']:.4f} of the neighbours",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--small", action="store_true", help="CPU only, small scale (tests)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of (d)")
    parser.add_argument("--address", default=None, help="Ray cluster for (a) (none: local Ray)")
    parser.add_argument("--json", default=None, help="where to write the JSON report")
    parser.add_argument(
        "--parts", nargs="+", default=list("abcde"), choices=list("abcde"), help="parts to run"
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
    report = {
        "accelerator": accelerator,
        "device_name": torch.cuda.get_device_name() if accelerator == "cuda" else "cpu",
        "small": args.small,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "raysim": raysim.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        work = Path(work)
        for part, key, check in (
            ("d", "index", lambda: exact_index_step(args, accelerator)),
            ("b", "frl_conv8", lambda: frl_conv8(args, accelerator, work)),
            ("a", "fedavg_lenet", lambda: fedavg_lenet(args, accelerator, work)),
            ("c", "fedaws", lambda: fedaws_full_scale(args, accelerator, work)),
            ("e", "batched", lambda: batched_clients(args, accelerator, work)),
        ):
            if part not in args.parts:
                continue
            started = time.perf_counter()
            report[key] = check()
            print(f"gpu_check: {key} done ({time.perf_counter() - started:.1f} s)", flush=True)
    print(table(report))
    path = (
        Path(args.json)
        if args.json
        else RESULTS / ("gpu_check_small.json" if args.small else "gpu_check.json")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
