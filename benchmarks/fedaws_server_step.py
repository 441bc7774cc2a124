"""FedAwS server step at Amazon-670K scale: nearest-class index + spreadout, per index backend.

One server step of FedAwS with stochastic negative mining (Yu et al., ICML 2020, Eq. 8):

  update     the index receives every row that changed since its last search: the rows the
             round's clients returned (--updated rows, moved by noise) plus the rows the
             previous spreadout step moved (w_c and all their neighbours); --update-scope
             clients sends only the former
  search     top-(k+1) nearest classes of each updated class (mine_negatives)
  spreadout  the sparse Eq. 8 gradient (spreadout_topk) and W[ids] -= step * grad, re-normalised

on clustered class embeddings (cluster centres on the sphere + Gaussian noise, normalised),
C x d float32. Each configuration starts from the same W and the same client moves, so round 0
is the same problem for all of them: exact configurations must return identical neighbours and
similarities (checked), approximate ones are scored by recall@k against an exact brute force on
--recall-sample of the round's queries (every round, against that configuration's own W).
The reference is exact search with 1 shard in this process; the table gives ratios to it.

    python benchmarks/fedaws_server_step.py                  # full scale (several minutes)
    python benchmarks/fedaws_server_step.py --quick          # smoke run, ~1 minute

Prints a table and writes benchmarks/results/fedaws_server_step.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from raysim.algorithms.spreadout import mine_negatives, spreadout_topk
from raysim.index import build_index
from raysim.process_memory import peak_rss_bytes


@dataclass
class Setup:
    name: str
    backend: str
    shards: int = 1
    use_ray: bool = False
    options: dict = field(default_factory=dict)


def configurations(args: argparse.Namespace) -> list[Setup]:
    ivf = {"nlist": args.ivf_nlist, "nprobe": args.ivf_nprobe, "train_size": args.ivf_train}
    hnsw = {
        "M": args.hnsw_m,
        "ef_construction": args.hnsw_ef_construction,
        "ef_search": args.hnsw_ef_search,
        "relink_distance": args.hnsw_relink,
        # timed as a speed option: the graph built and re-linked with all threads (its
        # neighbours then vary from run to run; runs keep the one-thread default)
        "parallel_build": True,
    }
    every = [
        Setup("exact-1", "exact"),
        Setup("exact-2", "exact", 2),
        Setup("exact-4", "exact", 4),
        Setup("exact-1-ray", "exact", 1, True),
        Setup("exact-2-ray", "exact", 2, True),
        Setup("exact-4-ray", "exact", 4, True),
        Setup("ivf", "faiss_ivf", 1, False, ivf),
        Setup("hnsw", "hnsw", 1, False, hnsw),
    ]
    chosen = [s for s in every if s.name in args.configs]
    if not chosen or chosen[0].name != "exact-1":
        raise SystemExit("--configs must start with exact-1 (the reference)")
    return chosen


def clustered_embeddings(
    num_rows: int, dim: int, clusters: int, noise: float, seed: int
) -> np.ndarray:
    """Rows = centre (uniform on the sphere) + noise * N(0, I/d), L2-normalised; float32."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((num_rows, dim), dtype=np.float32)
    scale = np.float32(noise / np.sqrt(dim))
    for start in range(0, num_rows, 65536):
        stop = min(num_rows, start + 65536)
        block = rng.standard_normal((stop - start, dim), dtype=np.float32) * scale
        block += centres[rng.integers(0, clusters, stop - start)]
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        out[start:stop] = block
    return out


def normalize(rows: np.ndarray) -> np.ndarray:
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def client_round(num_rows: int, args: argparse.Namespace, round_index: int):
    """The round's updated classes and the noise their clients add (same for every config)."""
    rng = np.random.default_rng([args.seed, 1, round_index])
    updated = np.sort(rng.choice(num_rows, args.updated, replace=False))
    noise = rng.standard_normal((args.updated, args.dim), dtype=np.float32)
    return updated, noise * np.float32(args.client_move / np.sqrt(args.dim))


def brute_force_top_k(weights: np.ndarray, query_ids: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k ids (float32 GEMM; for recall sets, float ties do not matter)."""
    rows = torch.from_numpy(weights)
    scores = rows[torch.from_numpy(query_ids)] @ rows.T
    scores[torch.arange(len(query_ids)), torch.from_numpy(query_ids)] = -torch.inf
    return torch.topk(scores, k, dim=1).indices.numpy()


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    hits = [len(set(a) & set(b)) for a, b in zip(found, truth, strict=True)]
    return float(np.mean(hits)) / truth.shape[1]


def run_setup(setup: Setup, base: np.ndarray, args: argparse.Namespace, reference: dict) -> dict:
    weights = base.copy()
    num_rows, dim = weights.shape
    started = time.perf_counter()
    index = build_index(
        setup.backend, num_rows, dim, shards=setup.shards, use_ray=setup.use_ray, **setup.options
    )
    index.reset(weights)
    build_s = time.perf_counter() - started
    print(f"  {setup.name}: built in {build_s:.1f} s", flush=True)
    rounds, pending = [], np.zeros(0, dtype=np.int64)
    for round_index in range(args.repeats):
        updated, noise = client_round(num_rows, args, round_index)
        weights[updated] = normalize(weights[updated] + noise)
        changed = np.union1d(updated, pending) if args.update_scope == "all" else updated
        t0 = time.perf_counter()
        index.update(changed, weights[changed])
        t1 = time.perf_counter()
        neighbors, nu = mine_negatives(index, weights, updated, args.k)
        t2 = time.perf_counter()
        record = {"round": round_index}
        if round_index == 0:
            if setup.name == "exact-1":
                reference["neighbors"], reference["nu"] = neighbors, nu
            elif setup.backend == "exact":
                record["identical_to_exact_1"] = bool(
                    np.array_equal(neighbors, reference["neighbors"])
                    and np.array_equal(nu, reference["nu"])
                )
            else:
                record["recall_vs_exact_1"] = recall_at_k(neighbors, reference["neighbors"])
        if setup.backend == "exact":
            record["recall"] = 1.0  # exact by construction (and identical at round 0)
        else:  # against a brute force over the W this search saw (untimed)
            rng = np.random.default_rng([args.seed, 2, round_index])
            sample = rng.choice(len(updated), min(args.recall_sample, len(updated)), False)
            truth = brute_force_top_k(weights, updated[sample], args.k)
            record["recall"] = recall_at_k(neighbors[sample], truth)
        t_spread = time.perf_counter()
        value, grad_rows, grad_ids = spreadout_topk(weights, updated, neighbors, nu)
        moved = weights[grad_ids]  # the server's step: W[ids] -= step * grad, re-normalised
        moved -= np.float32(args.spreadout_step) * grad_rows
        moved /= np.sqrt(np.einsum("ij,ij->i", moved, moved))[:, None]
        weights[grad_ids] = moved
        t3 = time.perf_counter()
        pending = grad_ids
        record.update(
            update_s=t1 - t0,
            search_s=t2 - t1,
            spreadout_s=t3 - t_spread,
            changed_rows=int(changed.size),
            spreadout_rows=int(grad_ids.size),
            regularizer=value,
            load_average_1min=os.getloadavg()[0],
        )
        record["total_s"] = record["update_s"] + record["search_s"] + record["spreadout_s"]
        rounds.append(record)
        print(
            f"    round {round_index}: update {record['update_s']:.2f} s "
            f"({record['changed_rows']} rows), search {record['search_s']:.2f} s, "
            f"spreadout {record['spreadout_s']:.2f} s, recall {record['recall']:.4f}",
            flush=True,
        )
    diagnostics = index.diagnostics()
    index.close()
    del index
    gc.collect()
    mean = {
        key: float(np.mean([r[key] for r in rounds]))
        for key in ("update_s", "search_s", "spreadout_s", "total_s", "recall")
    }
    return {
        "name": setup.name,
        "backend": setup.backend,
        "shards": setup.shards,
        "ray": setup.use_ray,
        "options": setup.options,
        "build_s": build_s,
        **mean,
        "identical_to_exact_1": rounds[0].get("identical_to_exact_1"),
        "recall_vs_exact_1_round0": rounds[0].get("recall_vs_exact_1"),
        "rounds": rounds,
        "shard_diagnostics": diagnostics,
        "shard_peak_rss_gb": sum(d["peak_rss_bytes"] for d in diagnostics) / 2**30
        if setup.use_ray
        else None,
        "driver_peak_rss_gb": peak_rss_bytes() / 2**30,
    }


def print_table(results: list[dict]) -> None:
    reference = results[0]["total_s"]
    header = (
        f"{'config':<13} {'build s':>8} {'update s':>9} {'search s':>9} {'spread s':>9} "
        f"{'total s':>8} {'x exact-1':>9} {'recall@k':>9} {'identical':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        identical = {True: "yes", False: "NO", None: "-"}[r["identical_to_exact_1"]]
        print(
            f"{r['name']:<13} {r['build_s']:>8.1f} {r['update_s']:>9.2f} {r['search_s']:>9.2f} "
            f"{r['spreadout_s']:>9.2f} {r['total_s']:>8.2f} {r['total_s'] / reference:>9.2f} "
            f"{r['recall']:>9.4f} {identical:>9}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-classes", type=int, default=670_091)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--updated", type=int, default=4000)
    parser.add_argument("--k", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2, help="server steps per config")
    parser.add_argument("--quick", action="store_true", help="C=20000, d=64, 500 updated, k=20")
    parser.add_argument("--clusters", type=int, default=None, help="default: C / 100")
    parser.add_argument("--noise", type=float, default=1.0, help="noise norm around a centre")
    parser.add_argument("--client-move", type=float, default=0.3, help="norm of a client move")
    parser.add_argument("--spreadout-step", type=float, default=0.05, help="lambda * eta")
    parser.add_argument("--update-scope", choices=("all", "clients"), default="all")
    parser.add_argument("--recall-sample", type=int, default=200)
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["exact-1", "exact-4", "exact-1-ray", "exact-2-ray", "exact-4-ray", "ivf", "hnsw"],
    )
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--ivf-nlist", type=int, default=1024)
    parser.add_argument("--ivf-nprobe", type=int, default=32)
    parser.add_argument("--ivf-train", type=int, default=65_536)
    parser.add_argument("--hnsw-m", type=int, default=12)
    parser.add_argument("--hnsw-ef-construction", type=int, default=48)
    parser.add_argument("--hnsw-ef-search", type=int, default=160)
    parser.add_argument("--hnsw-relink", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "fedaws_server_step.json")
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.num_classes, args.dim, args.updated, args.k = 20_000, 64, 500, 20
        args.ivf_nlist, args.ivf_train = 128, 8192
    clusters = args.clusters or max(1, args.num_classes // 100)
    setups = configurations(args)

    started = time.perf_counter()
    base = clustered_embeddings(args.num_classes, args.dim, clusters, args.noise, args.seed)
    print(
        f"W: {args.num_classes} x {args.dim} float32 ({base.nbytes / 2**30:.2f} GiB), "
        f"{clusters} clusters, made in {time.perf_counter() - started:.1f} s; "
        f"{args.updated} updated classes, k={args.k}, {args.repeats} steps per config, "
        f"torch threads {torch.get_num_threads()}",
        flush=True,
    )
    if any(s.use_ray for s in setups):
        import ray

        ray.init(num_cpus=args.ray_cpus, include_dashboard=False, logging_level="ERROR")
    results, reference = [], {}
    for setup in setups:
        results.append(run_setup(setup, base, args, reference))
    print()
    print_table(results)
    peak = peak_rss_bytes() / 2**30
    print(f"\ndriver peak RSS {peak:.2f} GiB; wall time {time.perf_counter() - started:.0f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "fedaws_server_step",
        "args": vars(args),
        "clusters": clusters,
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
        },
        "reference": "exact-1",
        "results": results,
        "driver_peak_rss_gb": peak,
    }
    out.write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
