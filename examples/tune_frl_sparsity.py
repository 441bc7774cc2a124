"""FRL's sparsity sweep with Ray Tune: test accuracy and upload size for each k.

k is the fraction of edges every supermask keeps (FRL paper, Mozaffari et al. 2023, sparsity
study). This runs configs/tune_frl_k.yaml through `raysim.tune` (one trial per k, each in its
own placement group, two at a time on a 2-CPU machine) and prints, per k, the final accuracy
and the bytes a client uploads per round (FRL sends bit-packed rankings whatever k is, so the
upload does not change with k; the accuracy does).

    python examples/tune_frl_sparsity.py                          # 9 values of k, 100 rounds
    python examples/tune_frl_sparsity.py --rounds 20 --k 0.1 0.5 0.9
    python examples/tune_frl_sparsity.py --address auto           # on a Ray cluster

Outputs in --out: tune_results.csv (every trial), sparsity.md (the table below), best_config.yaml
(`raysim run` repeats the best trial exactly) and one run folder per trial under trials/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from raysim import tune

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tune_frl_k.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=float, nargs="+", help="values of k (default: the config's)")
    parser.add_argument("--rounds", type=int, help="rounds per trial (default: the config's)")
    parser.add_argument("--seed", type=int, help="run seed (default: the config's)")
    parser.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")
    parser.add_argument("--out", default="runs/tune_frl_sparsity")
    args = parser.parse_args(argv)

    overrides = []
    if args.rounds:
        overrides.append(f"run.rounds={args.rounds}")
    if args.seed is not None:
        overrides.append(f"run.seed={args.seed}")
    config, spec = tune.load_sweep(CONFIG, overrides)
    if args.k:
        (domain,) = spec.space
        grid = dataclasses.replace(domain, values=tuple(args.k))
        spec = dataclasses.replace(spec, space=(grid,))
        for value in args.k:
            tune.apply_params(config, {domain.key: value})  # a bad k fails here, clearly
    result = tune.run_sweep(config, spec, args.out, address=args.address)

    lines = [
        f"FRL sparsity on digits, {config.run.rounds} rounds, seed {config.run.seed}",
        "",
        "| k | test accuracy | upload bytes per client per round | status |",
        "| --- | --- | --- | --- |",
    ]
    for row in sorted(result.rows, key=lambda row: row["params"]["algorithm.k"]):
        upload = "-"
        summary_path = Path(row["out"]) / "summary.json" if row["out"] else None
        if summary_path and summary_path.exists():
            summary = json.loads(summary_path.read_text())
            upload = f"{summary['bytes_up'] / summary['clients_done']:,.0f}"
        accuracy = row.get("eval/accuracy")
        shown = f"{100 * accuracy:.1f}" if isinstance(accuracy, float) else "-"
        lines.append(f"| {row['params']['algorithm.k']:g} | {shown} | {upload} | {row['status']} |")
    table = "\n".join(lines)
    print(table)
    (Path(args.out) / "sparsity.md").write_text(table + "\n")
    return 0 if result.best is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
