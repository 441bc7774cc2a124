"""Regression hashes: run a fixed set of short local-backend cases and print the sha256 of
every final server-state array, so that a refactor can be checked bit for bit against an
earlier commit on the same machine (floats can differ in their last digits across machines and
torch builds, README "Your first run").

    python scripts/regression_hashes.py --out /tmp/after.json
    git stash; python scripts/regression_hashes.py --out /tmp/before.json; git stash pop
    python scripts/regression_hashes.py --compare /tmp/before.json /tmp/after.json

`--cases NAME ...` runs some of them; `--list` names them. Each case is a config of configs/
with overrides (few rounds, the local backend), covering every method family, the batched
driver, the robust aggregators, the HNSW index and simulated time (sync, deadline, FedBuff,
FedAsync).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LOCAL = ["runtime.backend=local", "run.checkpoint_every=0"]
DIGITS_FEDAWS = [  # tests/test_batched_clients.py's FedAwS on digits (a small MLP embedding)
    "data.name=digits",
    "partition.num_clients=30",
    "clients.per_round=10",
    "model.hidden=[32]",
    "model.embedding_dim=16",
    "clients.local_epochs=2",
    "clients.batch_size=16",
    "clients.momentum=0.9",
    "clients.weight_decay=0.001",
    "algorithm.class_lr=0.3",
]
XML = ["run.rounds=4", "run.eval_every=2", "clients.per_round=16"]
SIM = [
    "run.rounds=6",
    "devices.profiles=sampled",
    "devices.compute_median=1e6",
    "devices.online_fraction=0.8",
    "devices.period_s=600",
]

# name -> (config file, overrides)
CASES: dict[str, tuple[str, list[str]]] = {
    "fedavg_digits": ("fedavg_digits.yaml", []),  # the README's first run, all 30 rounds
    "fedavg_batched": ("fedavg_digits.yaml", ["run.rounds=8", "clients.batched=true"]),
    "fedprox": ("fedavg_digits.yaml", ["run.rounds=8", "algorithm.name=fedprox"]),
    "trimmed_mean": ("fedavg_trimmed_mean_digits.yaml", ["run.rounds=6"]),
    "multi_krum": ("fedavg_multi_krum_digits.yaml", ["run.rounds=6"]),
    "signsgd": ("signsgd_digits.yaml", ["run.rounds=6"]),
    "topk": ("topk_digits.yaml", ["run.rounds=6"]),
    "frl": ("frl_digits.yaml", ["run.rounds=4"]),
    "frl_batched": ("frl_digits.yaml", ["run.rounds=4", "clients.batched=true"]),
    "flag": ("flag_flag.yaml", ["run.rounds=4"]),
    "flag_fedavg": ("flag_fedavg.yaml", ["run.rounds=4"]),
    "flag_fedprox": ("flag_fedprox.yaml", ["run.rounds=4"]),
    "per_fedavg": ("flag_per_fedavg.yaml", ["run.rounds=4"]),
    "personal_bn": ("flag_personal_bn.yaml", ["run.rounds=4"]),
    "local_only": ("flag_local_only.yaml", ["run.rounds=4"]),
    "fedaws_xml": ("fedaws_synthetic_xml.yaml", XML),
    "fedaws_xml_batched": ("fedaws_synthetic_xml.yaml", [*XML, "clients.batched=true"]),
    # the embedding-bag clients vmapped on the CPU too (off there by default: slower)
    "fedaws_xml_bag_vmapped": ("fedaws_synthetic_xml.yaml", [*XML, "clients.batched=true"]),
    "softmax_xml_bag_vmapped": (
        "fedaws_softmax_synthetic_xml.yaml",
        [*XML, "clients.batched=true"],
    ),
    "fedaws_xml_hnsw": (
        "fedaws_synthetic_xml.yaml",
        [*XML, "index.backend=hnsw", "index.options={relink_distance: 0.01}"],
    ),
    "softmax_xml": ("fedaws_softmax_synthetic_xml.yaml", XML),
    "fedaws_mlp": ("fedaws_fmnist.yaml", [*DIGITS_FEDAWS, "run.rounds=4"]),
    "fedaws_mlp_batched": (
        "fedaws_fmnist.yaml",
        [*DIGITS_FEDAWS, "run.rounds=4", "clients.batched=true"],
    ),
    "sim_sync": ("fedavg_digits.yaml", SIM),
    "sim_deadline": (
        "fedavg_digits.yaml",
        [*SIM, "devices.deadline_s=10", "devices.over_selection=0.3"],
    ),
    "fedbuff": (
        "fedavg_digits.yaml",
        [*SIM, "devices.aggregation=fedbuff", "devices.buffer_size=5", "devices.concurrency=10"],
    ),
    "fedasync": (
        "fedavg_digits.yaml",
        [*SIM, "devices.aggregation=fedasync", "devices.concurrency=5", "devices.mixing=0.6"],
    ),
}


def run_case(name: str) -> dict[str, str]:
    from raysim import config as config_module
    from raysim.algorithms import fedaws_bag_batched
    from raysim.assembly import run

    fedaws_bag_batched.BATCH_ON_CPU = name.endswith("_bag_vmapped")
    file, overrides = CASES[name]
    config = config_module.load(REPO / "configs" / file, [*LOCAL, *overrides])
    with tempfile.TemporaryDirectory() as out:
        result = run(config, Path(out) / "run", progress=False, tensorboard=False)
    hashes = {
        key: hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:16]
        for key, value in sorted(result.state.arrays.items())
    }
    final = result.summary.get("final", {})
    hashes["final"] = json.dumps(final, sort_keys=True, default=str)
    return hashes


def compare(before: Path, after: Path) -> int:
    old, new = json.loads(before.read_text()), json.loads(after.read_text())
    differ = 0
    for name in sorted(set(old) | set(new)):
        verdict = "identical" if old.get(name) == new.get(name) else "DIFFERENT"
        differ += verdict != "identical"
        print(f"{name:22s} {verdict}")
    print(f"{len(set(old) | set(new)) - differ} identical, {differ} different")
    return 1 if differ else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    parser.add_argument("--out", type=Path, help="write the hashes here (JSON)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--list", action="store_true", help="name the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(sorted(CASES)))
        return 0
    if args.compare:
        return compare(*args.compare)
    results = {}
    for name in args.cases:
        started = time.perf_counter()
        results[name] = run_case(name)
        print(f"{name:22s} {time.perf_counter() - started:6.1f} s  {results[name]['final']}")
        if args.out:  # after every case: a later failure keeps what ran
            args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
