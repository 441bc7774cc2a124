"""FedAwS's embedding-bag clients on the CPU, one at a time against batched (docs/BATCHED.md,
"Which methods"): one round's client phase, local backend, one torch thread.

    python benchmarks/bag_clients_cpu.py [--settings xml a670k a670k_full_model] [--repeats 3]

Settings (all `configs/fedaws_synthetic_xml.yaml`'s FedAwS, 3 rounds):
  xml               the config as it is: 64 one-class clients of 7-251 samples, bag 64
  a670k             synthetic_xml at scale 0.01 (Amazon-670K-shaped), 256 clients a round
  a670k_full_model  the same data with the flagship's model (bag 512, hidden 1024-1024,
                    embedding 512), 64 clients a round

Each run is its own process (a fresh allocator and torch.func start-up); batched runs force the
batched path on the CPU (`raysim.algorithms.fedaws_bag_batched.BATCH_ON_CPU`, off by default:
slower there). Per run the median client phase of rounds 2-3 (the first pays the start-up);
modes alternate within a repetition; the table gives the medians over repetitions. To compare
another commit, run its copy of this file with PYTHONPATH pointing at a worktree of it.
Writes JSON (--out, default benchmarks/results/bag_clients_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("xml", "a670k", "a670k_full_model")
MODES = ("sequential", "batched")
FULL_MODEL = ["model.bag_dim=512", "model.hidden=[1024,1024]", "model.embedding_dim=512"]


def _overrides(setting: str) -> list[str]:
    import numpy as np

    from raysim import config as config_module
    from raysim.data.datasets import load_dataset

    base = ["runtime.backend=local", "run.checkpoint_every=0", "run.rounds=3", "run.eval_every=3"]
    if setting == "xml":
        return base
    scaled = {"name": "synthetic_xml", "scale": 0.01}
    dataset = load_dataset(config_module.from_dict({"data": scaled}))
    classes = len(np.unique(dataset.train_y))  # one client per class with training points
    data = ["data.scale=0.01", *(f"data.{key}=null" for key in ("num_labels", "num_features"))]
    data += ["data.num_train=null", "data.num_test=null", f"partition.num_clients={classes}"]
    if setting == "a670k":
        return [*base, *data, "clients.per_round=256"]
    return [*base, *data, "clients.per_round=64", *FULL_MODEL]


def one_run(setting: str, mode: str) -> dict:
    """One run in this process: the client phase of each round."""
    import torch

    torch.set_num_threads(1)
    from raysim import config as config_module
    from raysim.algorithms import fedaws_bag_batched
    from raysim.assembly import run

    overrides = _overrides(setting)
    if mode == "batched":
        fedaws_bag_batched.BATCH_ON_CPU = True
        overrides.append("clients.batched=true")
    config = config_module.load(REPO / "configs" / "fedaws_synthetic_xml.yaml", overrides)
    with tempfile.TemporaryDirectory() as folder:
        result = run(config, Path(folder) / "run", progress=False, tensorboard=False)
        lines = (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    clients_s = [record["time"]["clients_s"] for record in records]
    return {
        "setting": setting,
        "mode": mode,
        "clients_s": clients_s,
        "median_rounds_2_3_s": statistics.median(clients_s[1:]),
        "p@1": result.summary["final"].get("p@1"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "bag_clients_cpu.json")
    parser.add_argument("--one", nargs=2, metavar=("SETTING", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child process: one run, its JSON on the last line
        print(json.dumps(one_run(*args.one)))
        return 0
    runs = []
    for repetition in range(args.repeats):
        for setting in args.settings:
            for mode in MODES:
                child = subprocess.run(
                    [sys.executable, __file__, "--one", setting, mode],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if child.returncode != 0:
                    print(child.stderr[-2000:], file=sys.stderr)
                    raise SystemExit(f"bag_clients_cpu: the {setting} {mode} run failed")
                record = json.loads(child.stdout.strip().splitlines()[-1])
                record["repetition"] = repetition
                runs.append(record)
                print(
                    f"rep {repetition} {setting:16s} {mode:10s} "
                    f"{record['median_rounds_2_3_s']:.3f} s",
                    flush=True,
                )
    print("\n| setting | sequential s | batched s | batched / sequential |")
    print("| --- | --- | --- | --- |")
    summary = {}
    for setting in args.settings:
        medians = {
            mode: statistics.median(
                r["median_rounds_2_3_s"]
                for r in runs
                if (r["setting"], r["mode"]) == (setting, mode)
            )
            for mode in MODES
        }
        summary[setting] = medians
        ratio = medians["batched"] / medians["sequential"]
        print(
            f"| {setting} | {medians['sequential']:.3f} | {medians['batched']:.3f} | {ratio:.2f}x |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
