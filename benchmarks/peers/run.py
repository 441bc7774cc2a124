"""Seconds per federated round: raysim (Ray backend, local backend) against its peers.

Systems, each run as its own worker process that prints one JSON line:
  raysim_ray    raysim.run(...) on the Ray backend (raysim_worker.py, this Python)
  raysim_local  raysim.run(...) on the in-process backend (raysim_worker.py, this Python)
  raysim_batched  the same two with `clients.batched: true` (runs raysim_batched_ray and
                raysim_batched_local): each task's clients trained together, one vmapped step
                for all of them (docs/BATCHED.md)
  pfl           pfl-research (`pfl` ~0.6): FederatedAveraging.run over a SimulatedBackend
                (peer_pfl.py, in benchmarks/peers/.venvs/pfl)
  flower        Flower (`flwr` ~1.42): its Simulation Runtime (run_simulation: ServerApp with
                the message-API FedAvg strategy, ClientApp) with the Ray backend replaced by a
                one-worker in-process backend, since Flower ships none (peer_flower.py, in
                benchmarks/peers/.venvs/flower)
  plain         a sequential PyTorch loop, no framework, no outputs (plain.py, this Python);
                measured with 1 and with 2 torch threads (plain_1t, plain_2t), the faster of
                the two in a repetition is that repetition's floor

One workload is exported once from raysim's own generators to WORK_DIR/WORKLOAD.npz: the data
and test split (raysim's load_dataset), the client split (raysim's partitioner), the clients of
every round (raysim.seeds.sample_clients), every client's batch order in every round
and epoch (torch.randperm from raysim's client_generator(seed, round, client), as raysim's
local training draws it), the initial weights (raysim's build_model) and the local training
(plain SGD, lr, epochs, batch size). Every system reads that file, so all train the same
clients on the same batches from the same start, and their final test accuracies must agree
within a few points (a warning line says when they do not: then the timing comparison is void).

Workloads (raysim overrides of benchmarks/throughput.py, imported from it):
  tiny   digits, MLP 64-128-10, 100 iid clients, 10 a round, 1 epoch, batch 16, lr 0.05
  many   the same with 1000 clients, 100 a round (1-2 samples a client: per-client overhead)
  heavy  LeNet on 1x28x28 synthetic images, 200 clients x 64 samples, 50 a round, batch 16

raysim runs with its full outputs on (metrics.jsonl, TensorBoard, checkpoints every
`run.checkpoint_every` rounds as in the config defaults) and evaluates once, after the last
round (`run.eval_every` = rounds); its round times are differences of consecutive `elapsed_s`
in metrics.jsonl. Every worker's round runs from the start of one round to the start of the
next (the last: to the end of its aggregation), so each includes what that system does between
rounds. The first rounds of every run are warm-up (process start, imports, Ray's workers) and
are dropped; a system's time in a repetition is its median over the rest.

Threads: raysim trains every client with one torch thread (`clients.num_cpus` 1, on both
backends), and pfl and Flower get the same (--peer-threads 1; 0 leaves torch's default, one per
core), so the comparison is of the frameworks rather than of torch's threading on small
tensors; the plain loop is measured both ways.

Systems are rotated within each repetition (repetition r starts at system r mod n) so that no
system always runs first or last on a machine whose load drifts. Per repetition: each system's
median s/round and its ratio to pfl's. The table reports the median over repetitions of those
ratios and of the s/round, the ratio to the floor, and the final test accuracy beside them.
Prints the table and writes JSON (--out; the exported workloads, raysim's run folders and every
worker's log go to --work-dir).

Peers live in their own virtual environments, made on request (never raysim dependencies):

    python benchmarks/peers/run.py --setup          # create missing venvs, then run
    python benchmarks/peers/run.py --setup-only     # only create them
    python benchmarks/peers/run.py [--workloads tiny many heavy] [--systems ...]
                                   [--repeats 3] [--rounds N] [--peer-threads 1]
                                   [--out FILE] [--work-dir DIR] [--timeout S]

`--setup` makes benchmarks/peers/.venvs/NAME with `python -m venv --system-site-packages` and
pip-installs the peer into it. torch and numpy must come from this Python's site-packages; when
this Python is itself a virtual environment, --system-site-packages would show the base
interpreter's packages instead (no torch there: every peer run failed with "No module named
'torch'"), so setup also writes a .pth file into the peer's venv naming this Python's own
site-packages (an existing venv is repaired the same way). Without --setup, a peer whose venv
is missing or cannot import its module or torch is skipped with a line naming the command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VENVS = HERE / ".venvs"
SETUP_COMMAND = "python benchmarks/peers/run.py --setup"

# Peer name -> what its venv holds and which worker runs in it.
PEERS = {
    "pfl": {"requirement": "pfl~=0.6.0", "module": "pfl", "script": "peer_pfl.py"},
    "flower": {"requirement": "flwr~=1.42.0", "module": "flwr", "script": "peer_flower.py"},
}
SYSTEMS = ("raysim_ray", "raysim_local", "raysim_batched", "pfl", "flower", "plain")
LABELS = {
    "raysim_ray": "raysim (Ray backend)",
    "raysim_local": "raysim (local backend)",
    "raysim_batched_ray": "raysim batched (Ray)",
    "raysim_batched_local": "raysim batched (local)",
    "pfl": "pfl",
    "flower": "Flower",
    "plain_1t": "plain, 1 thread",
    "plain_2t": "plain, 2 threads",
    "floor": "plain floor (faster)",
}
# Final accuracies of systems that trained the same thing may differ by float summation order
# only; more than this (a fraction) means they did not, and the timings compare nothing.
ACCURACY_TOLERANCE = 0.03


def workloads() -> dict[str, dict[str, Any]]:
    """The raysim overrides of benchmarks/throughput.py's workloads, and `many` made from tiny."""
    sys.path.insert(0, str(HERE.parent))
    from throughput import WORKLOADS

    tiny, heavy = WORKLOADS["tiny"], WORKLOADS["heavy"]
    many = [
        o
        for o in tiny["overrides"]
        if not o.startswith(("partition.num_clients=", "clients.per_round="))
    ] + ["partition.num_clients=1000", "clients.per_round=100"]
    return {
        "tiny": {
            "rounds": tiny["rounds"],
            "warmup": tiny["warmup"],
            "overrides": list(tiny["overrides"]),
        },
        "many": {"rounds": 20, "warmup": 3, "overrides": many},
        "heavy": {
            "rounds": heavy["rounds"],
            "warmup": heavy["warmup"],
            "overrides": list(heavy["overrides"]),
        },
    }


def export_workload(name: str, spec: dict[str, Any], rounds: int, path: Path) -> dict[str, Any]:
    """Everything a system needs to train what raysim trains, drawn by raysim's own code."""
    import numpy as np
    import torch

    from raysim import config as config_module
    from raysim.assembly import plan_run
    from raysim.core.algorithm import RunContext
    from raysim.data.datasets import load_dataset
    from raysim.models.vector import build_model, get_vector
    from raysim.seeds import client_generator, sample_clients

    config = config_module.from_dict({}, spec["overrides"] + [f"run.rounds={rounds}"])
    if config.algorithm.name != "fedavg" or config.clients.momentum or config.clients.weight_decay:
        raise SystemExit(f"{name}: the peers implement FedAvg with plain SGD only")
    dataset = load_dataset(config)
    split = plan_run(config, dataset).split
    ctx = RunContext(config, tuple(dataset.train_x.shape[1:]), dataset.num_classes)
    model = build_model(ctx)
    seed, clients = config.run.seed, config.clients
    sizes = np.diff(split.offsets)
    schedule = np.stack(
        [sample_clients(seed, r, split.num_clients, clients.per_round) for r in range(rounds)]
    )
    orders, offsets = [], [0]
    for r in range(rounds):
        for client_id in schedule[r]:
            generator = client_generator(seed, r, int(client_id))
            for _ in range(clients.local_epochs):
                order = torch.randperm(int(sizes[client_id]), generator=generator).numpy()
                orders.append(order)
                offsets.append(offsets[-1] + len(order))
    tensors = [
        [key, list(t.shape)] for key, t in model.state_dict().items() if t.is_floating_point()
    ]
    meta = {
        "workload": name,
        "raysim_overrides": spec["overrides"],
        "seed": seed,
        "rounds": rounds,
        "warmup": spec["warmup"],
        "num_clients": int(split.num_clients),
        "per_round": int(clients.per_round),
        "local_epochs": int(clients.local_epochs),
        "batch_size": int(clients.batch_size),
        "lr": float(clients.lr),
        "model": config.model.name,
        "model_options": dict(config.model.options),
        "input_shape": list(dataset.train_x.shape[1:]),
        "num_classes": int(dataset.num_classes),
        "tensors": tensors,
        "train_rows": int(len(dataset.train_y)),
        "client_sizes": [int(sizes.min()), int(sizes.max())],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path,
        meta=np.array(json.dumps(meta)),
        train_x=np.ascontiguousarray(dataset.train_x, dtype=np.float32),
        train_y=np.asarray(dataset.train_y, dtype=np.int64),
        test_x=np.ascontiguousarray(dataset.test_x, dtype=np.float32),
        test_y=np.asarray(dataset.test_y, dtype=np.int64),
        offsets=np.asarray(split.offsets, dtype=np.int64),
        indices=np.asarray(split.indices, dtype=np.int64),
        schedule=schedule.astype(np.int64),
        order_offsets=np.asarray(offsets, dtype=np.int64),
        order_flat=np.concatenate(orders).astype(np.int64),
        init_params=get_vector(model),
    )
    return meta


# --- peer environments --------------------------------------------------------------------------


def venv_python(peer: str) -> Path:
    return VENVS / peer / "bin" / "python"


def this_site_packages() -> list[str]:
    """This Python's own site-packages (a venv's, when it runs in one)."""
    import sysconfig

    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def link_site_packages(peer: str) -> None:
    """Make this Python's site-packages visible in the peer's venv (a .pth file there).

    `venv --system-site-packages` shows the *base* interpreter's packages; run from inside a
    virtual environment (the usual case), that base has no torch. A .pth line is appended to
    the peer's sys.path after its own packages, so what pip installed for the peer wins."""
    if sys.prefix == sys.base_prefix:
        return  # not in a venv: --system-site-packages already shows these packages
    found = subprocess.run(
        [str(venv_python(peer)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    pth = Path(found.stdout.strip()) / "_raysim_benchmark_parent.pth"
    pth.write_text("".join(f"{path}\n" for path in this_site_packages()))
    print(f"setup: {pth} -> {', '.join(this_site_packages())}", flush=True)


def setup_peer(peer: str) -> None:
    """Create the peer's venv (system site-packages visible, and this Python's when it is a
    venv) and pip-install the peer."""
    target = VENVS / peer
    requirement = PEERS[peer]["requirement"]
    if not venv_python(peer).exists():
        command = [sys.executable, "-m", "venv", "--system-site-packages", str(target)]
        print(f"setup: {' '.join(command)}", flush=True)
        subprocess.run(command, check=True)
    link_site_packages(peer)
    command = [str(venv_python(peer)), "-m", "pip", "install", "--quiet", requirement]
    print(f"setup: {' '.join(command)}", flush=True)
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"setup of {peer} failed ({' '.join(command)})")
    probe = subprocess.run(
        [str(venv_python(peer)), "-c", "import torch; print(torch.__file__)"],
        capture_output=True,
        text=True,
    )
    if str(target.resolve()) in probe.stdout:
        print(f"setup: warning: {peer}'s venv installed its own torch ({probe.stdout.strip()})")


def peer_version(peer: str) -> tuple[str | None, str]:
    """(version, '') when the peer's venv imports it, else (None, why not)."""
    python = venv_python(peer)
    if not python.exists():
        return None, (
            f"skipping {peer}: no virtual environment at {python.parent.parent} "
            f"(create it with: {SETUP_COMMAND})"
        )
    module = PEERS[peer]["module"]
    probe = subprocess.run(
        [str(python), "-c", f"import torch, {module}; print({module}.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, (
            f"skipping {peer}: its venv {python.parent.parent} cannot import torch and {module} "
            f"({last}); "
            f"recreate it with: {SETUP_COMMAND}"
        )
    return probe.stdout.strip(), ""


def other_ray_cluster() -> str | None:
    """A raylet already running on this machine (another Ray cluster), if any."""
    if shutil.which("pgrep") is None:
        return None
    found = subprocess.run(["pgrep", "-f", "ray/raylet/raylet"], capture_output=True, text=True)
    pids = found.stdout.split()
    return pids[0] if pids else None


# --- running the systems ------------------------------------------------------------------------


def run_command(run: str, npz: Path, work_dir: Path, tag: str, peer_threads: int) -> list[str]:
    if run.startswith("raysim_"):
        out = work_dir / "runs" / tag
        backend = run.removeprefix("raysim_").removeprefix("batched_")
        return [
            sys.executable,
            str(HERE / "raysim_worker.py"),
            "--workload",
            str(npz),
            "--backend",
            backend,
            "--out",
            str(out),
            "--batched",
            "1" if run.startswith("raysim_batched_") else "0",
        ]
    if run.startswith("plain_"):
        threads = run.removeprefix("plain_").removesuffix("t")
        return [
            sys.executable,
            str(HERE / "plain.py"),
            "--workload",
            str(npz),
            "--threads",
            threads,
        ]
    return [
        str(venv_python(run)),
        str(HERE / PEERS[run]["script"]),
        "--workload",
        str(npz),
        "--threads",
        str(peer_threads),
    ]


def run_worker(command: list[str], log: Path, timeout: float) -> tuple[dict | None, str]:
    """Run one worker; (its JSON record, '') or (None, why it failed)."""
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", PYTHONDONTWRITEBYTECODE="1")
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as stderr:
        # Its own session, so a timeout ends the worker with everything it started (a Ray
        # cluster of raysim_ray's) and nothing else.
        worker = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=HERE.parent.parent,
            start_new_session=True,
        )
        try:
            stdout, _ = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.communicate()
            return None, f"timed out after {timeout:.0f} s (log: {log})"
    for line in reversed(stdout.strip().splitlines()):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "round_s" in record:
            return record, ""
    tail = " | ".join(log.read_text().strip().splitlines()[-3:])[-400:]
    return None, f"exit {worker.returncode}, no result line (log: {log}): {tail}"


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


def summarise(reps: list[dict[str, dict]], warmup: int) -> dict[str, dict[str, Any]]:
    """Per repetition: each run's median s/round, its ratios to pfl's and to the floor (the
    faster plain run of that repetition); then, per run, the medians over repetitions."""
    runs = sorted({run for rep in reps for run in rep}, key=_order)
    per_rep: list[dict[str, float]] = []
    records: list[dict[str, dict]] = []  # run (and "floor") -> its worker record, per rep
    fastest: list[str] = []
    for rep in reps:
        medians = {run: median_after_warmup(r["round_s"], warmup) for run, r in rep.items()}
        plains = [run for run in rep if run.startswith("plain_")]
        chosen = dict(rep)
        if plains:
            floor = min(plains, key=medians.__getitem__)
            medians["floor"], chosen["floor"] = medians[floor], rep[floor]
            fastest.append(floor)
        per_rep.append(medians)
        records.append(chosen)
    rows: dict[str, dict[str, Any]] = {}
    for run in [*runs, *(["floor"] if fastest else [])]:
        seconds = [m[run] for m in per_rep if run in m]
        to_pfl = [m[run] / m["pfl"] for m in per_rep if run in m and "pfl" in m]
        to_floor = [m[run] / m["floor"] for m in per_rep if run in m and "floor" in m]
        ran = [r[run] for r in records if run in r]
        rows[run] = {
            "median_round_s": statistics.median(seconds),
            "ratio_to_pfl": statistics.median(to_pfl) if to_pfl else None,
            "ratio_to_floor": statistics.median(to_floor) if to_floor else None,
            "accuracy": statistics.median(r["accuracy"] for r in ran),
            "params_l2": statistics.median(r["params_l2"] for r in ran),
            "repetitions": len(seconds),
            "per_repetition_round_s": seconds,
            "per_repetition_ratio_to_pfl": to_pfl,
            "per_repetition_accuracy": [r["accuracy"] for r in ran],
        }
        if run == "floor":
            rows[run]["faster_plain_per_repetition"] = fastest
        else:
            rows[run]["versions"] = ran[0].get("versions", {})
            rows[run]["torch_threads"] = ran[0].get("torch_threads")
    return rows


def _order(run: str) -> int:
    names = [
        "raysim_ray",
        "raysim_local",
        "raysim_batched_ray",
        "raysim_batched_local",
        "pfl",
        "flower",
        "plain_1t",
        "plain_2t",
        "floor",
    ]
    return names.index(run) if run in names else len(names)


def print_table(name: str, meta: dict, rows: dict, warmup: int, repeats: int) -> list[str]:
    print(
        f"\n{name}: {meta['model']} {meta['input_shape']}, {meta['num_clients']} clients "
        f"({meta['client_sizes'][0]}-{meta['client_sizes'][1]} samples), {meta['per_round']} "
        f"a round, {meta['rounds']} rounds ({warmup} warm-up dropped), {repeats} repetitions"
    )
    print(f"  {'system':<24}{'s/round':>10}{'x pfl':>9}{'x floor':>9}{'accuracy':>10}")
    for run, row in rows.items():
        to_pfl = f"{row['ratio_to_pfl']:.2f}" if row["ratio_to_pfl"] is not None else "-"
        to_floor = f"{row['ratio_to_floor']:.2f}" if row["ratio_to_floor"] is not None else "-"
        print(
            f"  {LABELS.get(run, run):<24}{row['median_round_s']:>10.4f}{to_pfl:>9}"
            f"{to_floor:>9}{row['accuracy']:>10.4f}"
        )
    warnings = []
    # Every run of every repetition: the training is deterministic, so one odd run is news.
    accuracies = {
        run: (min(row["per_repetition_accuracy"]), max(row["per_repetition_accuracy"]))
        for run, row in rows.items()
        if run != "floor"
    }
    if accuracies:
        spread = max(hi for _, hi in accuracies.values()) - min(lo for lo, _ in accuracies.values())
        if spread > ACCURACY_TOLERANCE:
            listed = ", ".join(
                f"{LABELS.get(k, k)} {lo:.4f}" + (f"-{hi:.4f}" if hi != lo else "")
                for k, (lo, hi) in accuracies.items()
            )
            warnings.append(
                f"warning: {name}: final accuracies differ by {100 * spread:.1f} points "
                f"({listed}); the systems did not train the same thing, so this comparison is void"
            )
    norms = [row["params_l2"] for row in rows.values()]
    print(
        f"  final weights' L2 norm: {min(norms):.6g} to {max(norms):.6g} across systems "
        "(equal up to float summation order when all trained the same)"
    )
    if "pfl" not in rows:
        print("  (pfl did not run: no ratios to pfl)")
    for line in warnings:
        print(line)
    return warnings


def main(argv=None) -> int:
    specs = workloads()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(specs), choices=list(specs))
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--repeats", type=int, default=3, help="repetitions, 3 to 8 (3)")
    parser.add_argument("--rounds", type=int, help="override every workload's round count")
    parser.add_argument(
        "--setup", action="store_true", help="create the peers' missing virtual environments first"
    )
    parser.add_argument("--setup-only", action="store_true", help="--setup, then stop")
    parser.add_argument("--out", default="benchmarks/results/peers.json")
    parser.add_argument(
        "--work-dir",
        default="benchmarks/results/peers",
        help="exported workloads, raysim run folders, worker logs",
    )
    parser.add_argument(
        "--peer-threads",
        type=int,
        default=1,
        help="torch threads of pfl's and Flower's processes: 1 (default) as raysim's clients "
        "(clients.num_cpus 1); 0: torch's default",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per worker run")
    args = parser.parse_args(argv)
    if not 3 <= args.repeats <= 8:
        parser.error("--repeats must be 3 to 8")
    if args.rounds is not None and args.rounds < 2:
        parser.error("--rounds must be at least 2")

    wanted_peers = [p for p in PEERS if p in args.systems]
    if args.setup or args.setup_only:
        for peer in wanted_peers or list(PEERS):
            version, _ = peer_version(peer)
            if version is None:
                setup_peer(peer)
            else:
                print(f"setup: {peer} {version} already in {VENVS / peer}")
        if args.setup_only:
            return 0

    runs: list[str] = []
    skipped: dict[str, str] = {}
    peer_versions: dict[str, str] = {}
    for system in args.systems:
        if system in PEERS:
            version, why = peer_version(system)
            if version is None:
                print(why, flush=True)
                skipped[system] = why
                continue
            peer_versions[system] = version
        if system == "plain":
            runs += ["plain_1t", "plain_2t"]
        elif system == "raysim_batched":
            runs += ["raysim_batched_ray", "raysim_batched_local"]
        else:
            runs += [system]
    if "raysim_ray" in runs or "raysim_batched_ray" in runs:
        raylet = other_ray_cluster()
        if raylet:
            print(
                f"warning: another Ray cluster runs on this machine (raylet pid {raylet}); "
                "raysim's Ray backend will start its own beside it and share the CPUs"
            )
    if not runs:
        print("nothing to run")
        return 1

    work_dir = Path(args.work_dir).resolve()  # workers run in the repository root
    results: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "repeats": args.repeats,
        "runs": runs,
        "skipped": skipped,
        "peer_versions": peer_versions,
        "workloads": {},
    }
    all_warnings: list[str] = []
    for name in args.workloads:
        spec = specs[name]
        rounds = args.rounds or spec["rounds"]
        warmup = min(spec["warmup"], rounds // 2)
        npz = work_dir / f"{name}.npz"
        meta = export_workload(name, spec, rounds, npz)
        load_before = os.getloadavg()
        print(
            f"\n{name}: exported to {npz}; running {', '.join(runs)} x {args.repeats} "
            f"(load average {load_before[0]:.2f})",
            flush=True,
        )
        reps: list[dict[str, dict]] = []
        failures: list[str] = []
        for rep in range(args.repeats):
            order = runs[rep % len(runs) :] + runs[: rep % len(runs)]
            done: dict[str, dict] = {}
            for position, run in enumerate(order):
                tag = f"{name}/{run}-rep{rep}"
                started = time.perf_counter()
                record, why = run_worker(
                    run_command(run, npz, work_dir, tag, args.peer_threads),
                    work_dir / "logs" / f"{tag}.log",
                    args.timeout,
                )
                if record is None:
                    failures.append(f"{name} {run} repetition {rep}: {why}")
                    print(f"  rep {rep} {run}: FAILED: {why}", flush=True)
                    continue
                record["position"] = position
                done[run] = record
                print(
                    f"  rep {rep} {run:<13} {median_after_warmup(record['round_s'], warmup):.4f}"
                    f" s/round, accuracy {record['accuracy']:.4f} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            reps.append(done)
        load_after = os.getloadavg()
        if not any(reps):
            results["workloads"][name] = {"meta": meta, "failures": failures}
            write_results(args.out, results)
            continue
        rows = summarise(reps, warmup)
        warnings = print_table(name, meta, rows, warmup, args.repeats)
        all_warnings += warnings
        results["workloads"][name] = {
            "meta": {k: v for k, v in meta.items() if k != "tensors"},
            "rounds": rounds,
            "warmup_rounds_dropped": warmup,
            "load_average_before_after": [load_before[0], load_after[0]],
            "systems": rows,
            "repetitions": [
                {
                    run: {
                        "position": r["position"],
                        "round_s": r["round_s"],
                        "accuracy": r["accuracy"],
                        "params_l2": r["params_l2"],
                    }
                    for run, r in rep.items()
                }
                for rep in reps
            ],
            "failures": failures,
            "warnings": warnings,
        }
        results["warnings"] = all_warnings
        write_results(args.out, results)  # after every workload: a stopped run keeps its tables
    print(f"\nwrote {args.out}")
    return 0


def write_results(path: str, results: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
