"""FedAwS on CIFAR: each client holds the images of one class only (Yu et al., ICML 2020, §6).

Compares FedAwS (positive loss + spreadout) with Baseline-1 (positive loss only), Baseline-2
(class embeddings frozen) and the Softmax oracle on a CIFAR ResNet with a 64-d embedding
(He et al.'s ResNet-8/32/56). With C = 10 classes spreadout has every pair of classes to work
with (`spreadout: full`, Eq. 7); with CIFAR-100 the example mines the k nearest (Eq. 8).

    python examples/fedaws_cifar.py                                   # synthetic CIFAR-shaped data
    python examples/fedaws_cifar.py --data cifar10 --data-root ~/data --model resnet32 --rounds 2000
    python examples/fedaws_cifar.py --data cifar100 --data-root ~/data --address auto
    python examples/fedaws_cifar.py --methods fedaws softmax --rounds 100

CIFAR is read from a torchvision layout under --data-root (`cifar-10-batches-py/`,
`cifar-100-python/`); nothing is downloaded. The default, with no files, is
`synthetic_classification` shaped like CIFAR-10 (3 x 32 x 32, 10 classes), so the example runs
anywhere in a few minutes. Paper (CIFAR-10, ResNet-32): FedAwS 92.4% = softmax 92.4%.
Outputs in --out: table.md, results.json and one run folder per method.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from raysim import config as config_module
from raysim.assembly import run

sys.path.insert(0, str(Path(__file__).resolve().parent))  # example_cli, beside this file
from example_cli import old_method_form  # noqa: E402

METHODS = {
    "FedAwS": ("fedaws", {}),
    "Baseline-1": ("fedaws", {"spreadout": "none"}),
    "Baseline-2": ("fedaws", {"train_class_embeddings": False}),
    "Softmax": ("fedaws_softmax", {}),
}
# --methods takes these keys (no capitals or dashes to remember); the display names above stay
# the names in the table, results.json and the run folders.
METHOD_KEYS = {
    "fedaws": "FedAwS",
    "baseline1": "Baseline-1",
    "baseline2": "Baseline-2",
    "softmax": "Softmax",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--data",
        choices=("synthetic", "cifar10", "cifar100"),
        default="synthetic",
        help="synthetic CIFAR-10-shaped data (no files), or CIFAR read from --data-root",
    )
    parser.add_argument(
        "--data-root",
        default=None,
        help="torchvision root holding cifar-10-batches-py/ or cifar-100-python/ "
        "(needed by --data cifar10 / cifar100)",
    )
    parser.add_argument(
        "--model",
        choices=("resnet8", "resnet32", "resnet56"),
        default="resnet8",
        help="CIFAR ResNet with a 64-d embedding and GroupNorm",
    )
    parser.add_argument("--rounds", type=int, default=60, help="rounds per method")
    parser.add_argument(
        "--clients-per-class",
        type=int,
        default=10,
        help="clients per class, each holding a share of that class's images",
    )
    parser.add_argument("--clients-per-round", type=int, default=20, help="clients per round")
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=list(METHOD_KEYS),
        default=list(METHOD_KEYS),
        metavar="METHOD",
        help="methods to run in this order, space-separated, from: "
        + ", ".join(f"{key} ({name})" for key, name in METHOD_KEYS.items()),
    )
    parser.add_argument(
        "--address",
        default=None,
        help="Ray cluster to join ('auto', ray://HOST:PORT); none: start a local Ray",
    )
    parser.add_argument("--seed", type=int, default=0, help="run seed (data, init, sampling)")
    parser.add_argument("--out", default="runs/fedaws_cifar", help="output folder")
    argv = sys.argv[1:] if argv is None else list(argv)
    return parser.parse_args(old_method_form(argv, METHOD_KEYS, "fedaws_cifar.py"))


def base_config(args: argparse.Namespace) -> dict:
    if args.data == "synthetic":
        data = {
            "name": "synthetic_classification",
            "num_samples": 4000,
            "num_test": 1000,
            "num_classes": 10,
            "sample_shape": [3, 32, 32],
            "class_separation": 2.0,
        }
        classes = 10
    else:
        if not args.data_root:
            raise SystemExit(f"--data {args.data} needs --data-root (a torchvision CIFAR root)")
        data = {"name": args.data, "root": args.data_root}
        classes = 10 if args.data == "cifar10" else 100
    spreadout = (
        {"spreadout": "full", "nu": 1.0} if classes <= 20 else {"spreadout": "topk", "k": 10}
    )
    return {
        "run": {
            "name": "fedaws_cifar",
            "seed": args.seed,
            "rounds": args.rounds,
            "eval_every": max(1, args.rounds // 10),
            "checkpoint_every": 0,
        },
        "data": data,
        # Several clients per class, each holding a share of that class's images only.
        "partition": {"name": "one_class", "num_clients": classes * args.clients_per_class},
        "clients": {
            "per_round": args.clients_per_round,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.1,
            "momentum": 0.0,
        },
        "server": {"optimizer": "adam", "lr": 0.003, "eps": 1.0e-6},
        # GroupNorm: a one-class client's batch has one class only, and BatchNorm would
        # subtract that class's own mean (its statistics are also meaningless to average).
        "model": {"name": args.model, "embedding_dim": 64, "norm": "group"},
        "algorithm": {"name": "fedaws", "class_lr": 0.1, "spreadout_lr": 0.01, **spreadout},
        "runtime": {"backend": "ray", "address": args.address},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = [METHOD_KEYS[key] for key in args.methods]
    from raysim.config import RuntimeConfig
    from raysim.runtime import ray_cluster

    started_ray = ray_cluster.connect(RuntimeConfig(address=args.address), args.address)
    results = {}
    try:
        for name in wanted:
            algorithm, options = METHODS[name]
            raw = base_config(args)
            if algorithm == "fedaws_softmax":
                raw["algorithm"] = {"name": algorithm}
            else:
                raw["algorithm"] = {**raw["algorithm"], **options}
            print(f"\n== {name} ==", flush=True)
            started = time.perf_counter()
            result = run(  # the study's folders: each invocation replaces the last one's
                config_module.from_dict(raw, source=name),
                out / name,
                address=args.address,
                overwrite=True,
            )
            results[name] = {**result.summary["final"], "wall_s": time.perf_counter() - started}
    finally:
        if started_ray:
            ray_cluster.disconnect()
    lines = [
        "| method | accuracy | P@3 | P@5 | mean cos(W) | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for name, final in results.items():
        lines.append(
            f"| {name} | {final['accuracy']:.4f} | {final['p@3']:.4f} | {final['p@5']:.4f} | "
            f"{final['class_cosine_mean']:.3f} | {final['wall_s']:.0f} |"
        )
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
