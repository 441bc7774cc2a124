"""How the vmapped driver's bag pooling scales with the chunk: one vmapped forward and backward
of a chunk of clients' bag means, pooled by a gather and a sum (what the vmapped driver runs:
XMLEmbeddingBag.forward_rows_gathered) against embedding_bag, which vmap has no batching rule
for and runs once per client (XMLEmbeddingBag.forward_rows). Only the pooling: each client's
own table of `width` rows, `rows` batch rows of `features` ids (a quarter of them padding).

    python benchmarks/bag_pooling.py                    # CPU, or the GPU when there is one
    python benchmarks/bag_pooling.py --device cpu --clients 16 128 1024
    python benchmarks/bag_pooling.py --small            # seconds, small shapes (a test runs it)

Prints, per chunk size, the milliseconds of one step (median of --repeats, the two
formulations alternating) and the torch operations each dispatches (torch.profiler's count
of aten calls, forward and backward): the gather's stays the same for any chunk, embedding_bag's
grows ~linearly with the clients (on a GPU each is a kernel launch or more). Writes JSON
(--out, default benchmarks/results/bag_pooling.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from raysim.models.embedding import XMLEmbeddingBag

RESULTS = Path(__file__).resolve().parent / "results"


def _pooling_step(model: XMLEmbeddingBag, gathered: bool):
    forward = model.forward_rows_gathered if gathered else model.forward_rows

    def loss(table, ids):
        return forward(ids, table).square().sum()

    return torch.func.vmap(torch.func.grad(loss))


def _inputs(clients: int, shapes: dict, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    width = shapes["width"]
    tables = torch.randn((clients, width, shapes["bag_dim"]), generator=generator)
    ids = torch.randint(
        0, width, (clients, shapes["rows"], shapes["features"]), generator=generator
    )
    padding = torch.rand(ids.shape, generator=generator) < 0.25
    ids[padding] = width  # the padding id: one past the client's table
    return tables.to(device), ids.to(device)


def _timed(step, tables, ids, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    step(tables, ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def _op_count(step, tables, ids) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # the calls, not their kernels
        step(tables, ids)
    return sum(event.count for event in prof.key_averages() if event.key.startswith("aten::"))


SHAPES = {  # the flagship's shapes at scale 1 on a GPU (64 batch rows, 123 feature ids a
    # point, bag 512; tables of median 75 and up to 545 rows: 128 here; 512 clients gather
    # 8 GB a pass, and batch_chunk's estimate gives the flagship's chunks fewer); smaller on a CPU
    "cuda": {"rows": 64, "features": 123, "width": 128, "bag_dim": 512, "clients": [16, 128, 512]},
    "cpu": {"rows": 16, "features": 64, "width": 128, "bag_dim": 64, "clients": [8, 64, 256]},
    "small": {"rows": 4, "features": 8, "width": 16, "bag_dim": 8, "clients": [2, 8]},
}


def measure(device: torch.device, shapes: dict, repeats: int) -> list[dict]:
    """One row per chunk size of `shapes["clients"]`: each formulation's median ms of a step,
    its aten operations, and how far the two gradients are apart."""
    # vmap's warning that embedding_bag runs in its per-client fallback: what is measured here
    warnings.filterwarnings("ignore", message=r"There is a performance drop", category=UserWarning)
    model = XMLEmbeddingBag(1000, 16, shapes["bag_dim"], [16], sparse_gradients=False)
    model = model.to(device).requires_grad_(False)  # only the tables' gradients are asked for
    steps = {name: _pooling_step(model, name == "gather") for name in ("gather", "embedding_bag")}
    rows = []
    for clients in shapes["clients"]:
        tables, ids = _inputs(clients, shapes, device)
        for step in steps.values():
            step(tables, ids)  # the first call of each
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(repeats):
            for name, step in steps.items():
                seconds[name].append(_timed(step, tables, ids, device))
        row: dict = {"clients": clients}
        for name, step in steps.items():
            row[f"{name}_ms"] = 1000 * statistics.median(seconds[name])
            row[f"{name}_ops"] = _op_count(step, tables, ids)
        gathered, bagged = steps["gather"](tables, ids), steps["embedding_bag"](tables, ids)
        row["max_abs_gradient_difference"] = float((gathered - bagged).abs().max())
        rows.append(row)
        del tables, ids, gathered, bagged
    if device.type == "cuda":
        torch.cuda.empty_cache()  # gpu_check's next parts run in this process
    return rows


def table(rows: list[dict], device: str) -> str:
    lines = [
        f"bag pooling under vmap on {device}: one step's forward and backward",
        "| clients | gather: ms | ops | embedding_bag: ms | ops | embedding_bag / gather |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = row["embedding_bag_ms"] / row["gather_ms"]
        lines.append(
            f"| {row['clients']} | {row['gather_ms']:.2f} | {row['gather_ops']} | "
            f"{row['embedding_bag_ms']:.2f} | {row['embedding_bag_ops']} | {ratio:.2f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--clients", type=int, nargs="+", default=None)
    parser.add_argument("--rows", type=int, default=None, help="batch rows a client")
    parser.add_argument("--features", type=int, default=None, help="feature ids a row")
    parser.add_argument("--width", type=int, default=None, help="rows of a client's table")
    parser.add_argument("--bag-dim", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="small shapes, seconds")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    shapes = dict(SHAPES["small" if args.small else device.type])
    for name in shapes:
        if getattr(args, name) is not None:
            shapes[name] = getattr(args, name)
    repeats = min(args.repeats, 3) if args.small else args.repeats
    rows = measure(device, shapes, repeats)
    print(table(rows, device.type))
    report = {
        "command": "python benchmarks/bag_pooling.py",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "shapes": shapes,
        "repeats": repeats,
        "rows": rows,
    }
    out = args.out or RESULTS / ("bag_pooling_small.json" if args.small else "bag_pooling.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
