"""raysim through its public API, `raysim.run(...)`, on the local or the Ray backend.

The config is the workload's raysim overrides (recorded in the .npz by run.py) plus the backend,
the round count and `run.eval_every` = rounds (one evaluation, after the last round). Every
output stays on as in the config defaults: metrics.jsonl, summary.json, TensorBoard, curves,
checkpoints every `run.checkpoint_every` rounds and at the last. Round times are the differences
of consecutive `elapsed_s` in metrics.jsonl (as benchmarks/throughput.py takes them), the rounds
one call brought back (a block of small rounds the Ray backend ran ahead) sharing its time
equally (raysim.core.run_record.round_seconds). The
.npz's client schedule and batch orders were drawn by raysim's own sampling functions from this
config and seed, so this run trains the same clients in the same order. Prints one JSON line.
`--batched 1` trains each task's clients together (`clients.batched: true`, docs/BATCHED.md):
the same batches, agreeing with the sequential path to float rounding.

    python benchmarks/peers/raysim_worker.py --workload FILE.npz --backend local --out DIR
                                             [--batched 1]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, load_workload, quiet_stdout, worker_args  # noqa: E402


def main(argv=None) -> int:
    args = worker_args(argv, backend=(str, "local"), out=(str, None), batched=(int, 0))
    import ray
    import torch  # noqa: F401 - versions below

    import raysim
    from raysim.core.run_record import round_seconds

    work = load_workload(args.workload)
    rounds = work.rounds
    overrides = list(work.meta["raysim_overrides"]) + [
        f"runtime.backend={args.backend}",
        f"run.rounds={rounds}",
        f"run.eval_every={rounds}",
        f"run.name=peers_{work.meta['workload']}_{args.backend}",
    ]
    system = f"raysim_{args.backend}"
    if args.batched:
        overrides.append("clients.batched=true")
        system = f"raysim_batched_{args.backend}"
    with quiet_stdout():
        result = raysim.run({}, args.out, overrides=overrides, progress=False, overwrite=True)
    lines = (Path(args.out) / "metrics.jsonl").read_text().splitlines()
    # (rounds the Ray backend ran ahead in a block share the block's wait)
    times = round_seconds([json.loads(line) for line in lines])
    emit(
        system,
        times,
        float(result.summary["final"]["accuracy"]),
        result.state.arrays["params"],
        rounds,
        {"raysim": raysim.__version__, "ray": ray.__version__},
        out_dir=str(args.out),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
