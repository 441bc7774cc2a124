"""The floor: FedAvg as a sequential PyTorch loop, no framework, no outputs.

Each round: for every scheduled client, load the global weights into one model, run the local
SGD (common.local_sgd, in the exported batch order), add n_c * (w_c - w) to a float64 sum;
then w += sum / sum(n_c). `--threads` sets torch's intra-op threads. Prints one JSON line.

    python benchmarks/peers/plain.py --workload FILE.npz --threads 1
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    RoundClock,
    accuracy,
    build_model,
    emit,
    get_vector,
    load_workload,
    local_sgd,
    set_vector,
    worker_args,
)


def main(argv=None) -> int:
    args = worker_args(argv, threads=(int, 1))
    torch.set_num_threads(args.threads)
    work = load_workload(args.workload)
    model = build_model(work)
    params = get_vector(model)
    clock = RoundClock()
    for round_index in range(work.rounds):
        clock.mark()
        total = np.zeros_like(params, dtype=np.float64)
        weight = 0
        for slot, client_id in enumerate(work.schedule[round_index]):
            x, y = work.client_data(int(client_id))
            set_vector(model, params)
            local_sgd(model, x, y, work.orders(round_index, slot), work.lr, work.batch_size)
            total += len(y) * (get_vector(model) - params)
            weight += len(y)
        params = (params + total / max(1, weight)).astype(np.float32)
    clock.mark()
    set_vector(model, params)
    emit(
        f"plain_{args.threads}t",
        clock.round_times(),
        accuracy(model, work.test_x, work.test_y),
        params,
        work.rounds,
        {},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
