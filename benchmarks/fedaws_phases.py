"""FedAwS round phases at Amazon-670K scale: raysim's own code path against a direct floor.

One FedAwS round (Yu et al., ICML 2020) has a clients phase and four server phases. Each is
timed through the code raysim runs, and against a floor that does the same work written
directly with torch / faiss / numpy, in the same run, alternated, repeated:

  clients      the round's sampled clients' local training and the sum of their updates, on
               --client-workers worker processes (default: one per CPU, one torch thread
               each, as Ray's client workers). raysim: the client task body
               (`train_clients`, with FedAwS's exact in-task reduction) on each worker's
               contiguous share of the clients, the shares' sums added as the server adds
               tasks' results. Floor: a plain torch loop over the same clients on the same
               workers (same model, loss and SGD; float32 sum). See fedaws_clients.py.

  aggregation  the round's aggregate (theta delta + the clients' class rows) applied: theta
               through the server optimizer (Adam), W's rows written back. raysim: the part of
               `FedAwS.server_update` that is neither index nor spreadout (what the server
               reports as aggregate_s). Floor: the delta built in a reused buffer, in-place
               Adam (the faster of torch's fused ops over whole tensors and numpy in
               cache-sized chunks on a thread pool), W[ids] = normalized rows.
  index        top-(k+1) nearest classes of the round's classes, and keeping the index equal
               to W. raysim: `index_s` of `server_update` (raysim.index through
               `FedAwS._synced_index`, `spreadout.mine_negatives`, `index.update`). Floor:
               faiss.knn over W.
  spreadout    the Eq. 8 gradient over the mined pairs and the re-normalised step on W.
               raysim: `spreadout_s` of `server_update`. Floor: the same gathers and batched
               products in torch, the scatter as one sparse (rows x classes) product (MKL).
  evaluation   P@1/3/5 of the first `eval_max_points` test points against all classes and the
               mean pairwise cosine of W. raysim: `FedAwS.evaluate`. Floor: the model's
               forward, faiss.knn top-5, and the two sums of the cosine in torch (float64).

The state is the one raysim's FedAwS server holds: `init_server` of the synthetic_xml dataset
at --scale (theta of the paper's Amazon-670K network, W = C x 512 random unit rows, Adam
slots). The aggregate of each round is synthetic but shaped as the in-task reduction returns
it (fixed-point sums): the bag rows the round's clients touch (from their real training rows),
the dense layers, one returned row per sampled class.

Threads (server phases). The floor runs with --threads (default: every CPU this process may
use). raysim's phases are called with torch and faiss set to --inherited-threads first
(default 1: what raysim's server actor inherits on Ray, which sets OMP_NUM_THREADS=1 for a
num_cpus=0 actor), so a phase that does not set its own thread count runs on that many.

    python benchmarks/fedaws_phases.py                 # scale 1: 670,091 classes (~12 GB)
    python benchmarks/fedaws_phases.py --scale 0.05    # quick: 33,505 classes
    python benchmarks/fedaws_phases.py --phases clients # one phase (or a comma list)

Prints a table (medians over the repetitions of each repetition's raysim / floor ratio) and
writes benchmarks/results/fedaws_phases.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from raysim import config as config_module
from raysim.assembly import plan_run
from raysim.core.clients import single_class_of_clients
from raysim.core.fixed_point import FIXED_SCALE
from raysim.core.server import _non_finite_arrays, build_algorithm
from raysim.data.datasets import load_dataset
from raysim.models.layout import layout_of
from raysim.models.vector import cached_model
from raysim.process_memory import peak_rss_bytes
from raysim.seeds import sample_clients

SERVER_PHASES = ("aggregation", "index", "spreadout", "evaluation")
PHASES = ("clients", *SERVER_PHASES)
FULL_MODEL = {"bag_dim": 512, "hidden": [1024, 1024], "embedding_dim": 512}


def _faiss():
    import faiss

    return faiss


def set_threads(count: int) -> None:
    torch.set_num_threads(count)
    _faiss().omp_set_num_threads(count)


def cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def make_config(args: argparse.Namespace, num_clients: int):
    """The configuration examples/fedaws_amazon670k.py runs at --scale (exact index, Adam),
    with --k negatives and --eval-points."""
    return config_module.from_dict(config_dict(args, num_clients))


def config_dict(args: argparse.Namespace, num_clients: int) -> dict:
    return {
        "run": {"seed": args.seed, "rounds": 2, "eval_every": 1, "checkpoint_every": 0},
        "data": {"name": "synthetic_xml", "scale": args.scale},
        "partition": {"name": "one_class", "num_clients": num_clients},
        "clients": {
            "per_round": min(args.clients_per_round, num_clients),
            "local_epochs": 1,
            "batch_size": 64,
            "lr": 1.0,
        },
        "server": {"optimizer": "adam", "lr": 0.01, "eps": 1.0e-6},
        "model": {"name": "xml_embedding_bag", **FULL_MODEL},
        "algorithm": {
            "name": "fedaws",
            "k": args.k,
            "class_lr": 0.1,
            "spreadout_lr": 0.01,
            "eval_max_points": args.eval_points,
        },
        "index": {"backend": "exact", "shards": 1},
        "runtime": {"backend": "local"},
    }


def synthetic_aggregate(
    round_index: int, setup: dict, rng: np.random.Generator, classes: np.ndarray
) -> dict:
    """A round's reduced aggregate as `FedAwS.finish_reduced` returns it (fixed-point sums):
    the bag rows the sampled clients' training rows touch, the dense layers, one returned row
    per sampled class (a unit row near the class's current row)."""
    dataset, split, layout = setup["dataset"], setup["split"], setup["layout"]
    clients = sample_clients(setup["seed"], round_index, split.num_clients, setup["per_round"])
    rows = np.concatenate([split.indices[split.offsets[c] : split.offsets[c + 1]] for c in clients])
    features = np.unique(dataset.train_x[rows])
    bag_ids = features[(features >= 0) & (features < layout.bag_rows - 1)].astype(np.int64)
    weight = len(rows)
    scale = weight * FIXED_SCALE

    def fixed(shape, size=1e-3):
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(size)
        return np.rint(values.astype(np.float64) * scale).astype(np.int64)

    class_ids = np.unique(setup["client_classes"][clients])
    moved = classes[class_ids] + rng.standard_normal(
        (len(class_ids), classes.shape[1]), dtype=np.float32
    ) * np.float32(0.3 / np.sqrt(classes.shape[1]))
    moved /= np.linalg.norm(moved, axis=1, keepdims=True)
    class_rows = np.rint(moved.astype(np.float64) * FIXED_SCALE).astype(np.int64)
    counts = np.ones(len(class_ids), dtype=np.int64)
    return {
        "weight": weight,
        "dense": fixed(len(layout.dense_index)),
        "bag_ids": bag_ids,
        "bag_rows": fixed((len(bag_ids), layout.bag_width)),
        "class_ids": class_ids,
        "class_rows": class_rows,
        "class_ids_c": class_ids,
        "class_counts": counts,
        "classes_dense": None,
        "bounds": {},
    }


# --- the floor: the same arithmetic, written directly ------------------------------------------
class Floor:
    """The round done directly on its own copy of the state, with `threads` threads.

    Where two direct ways of doing a phase's arithmetic exist, both run and the faster counts
    (aggregation: torch in-place ops over whole tensors, or numpy in-place ops in cache-sized
    chunks on a thread pool)."""

    def __init__(self, state, layout, model, k: int, step: float, server, threads: int) -> None:
        self.W = torch.from_numpy(state.arrays["class_embeddings"].copy())
        self.theta = torch.from_numpy(state.arrays["params"].copy())
        self.m = torch.zeros_like(self.theta)
        self.v = torch.zeros_like(self.theta)
        self.delta = torch.zeros_like(self.theta)
        self.layout, self.model, self.k, self.step = layout, model, k, step
        self.server, self.threads = server, threads

    def _delta(self, aggregate: dict) -> None:
        layout, total = self.layout, float(aggregate["weight"]) * FIXED_SCALE
        delta = self.delta
        delta.zero_()
        delta[torch.from_numpy(layout.dense_index)] = torch.from_numpy(
            (aggregate["dense"] / total).astype(np.float32)
        )
        table = delta[layout.bag_offset : layout.bag_offset + layout.bag_rows * layout.bag_width]
        table.view(layout.bag_rows, layout.bag_width)[torch.from_numpy(aggregate["bag_ids"])] = (
            torch.from_numpy((aggregate["bag_rows"] / total).astype(np.float32))
        )

    def _adam_torch(self) -> None:
        b1, b2, lr, eps = self.server.beta1, self.server.beta2, self.server.lr, self.server.eps
        d = self.delta
        self.m.mul_(b1).add_(d, alpha=1 - b1)
        self.v.mul_(b2).addcmul_(d, d, value=1 - b2)
        self.theta.addcdiv_(self.m, self.v.sqrt().add_(eps), value=lr)

    def _adam_numpy(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        b1, b2, lr, eps = self.server.beta1, self.server.beta2, self.server.lr, self.server.eps
        p, m, v, d = (t.numpy() for t in (self.theta, self.m, self.v, self.delta))
        chunk = 1 << 16

        def run(lo: int) -> None:
            part = slice(lo, lo + chunk)
            mm, vv, dd = m[part], v[part], d[part]
            mm *= b1
            mm += (1 - b1) * dd
            vv *= b2
            vv += (1 - b2) * dd * dd
            p[part] += lr * mm / (np.sqrt(vv) + eps)

        with ThreadPoolExecutor(self.threads) as pool:
            list(pool.map(run, range(0, len(p), chunk)))

    def aggregation(self, aggregate: dict) -> tuple[np.ndarray, float]:
        ids = aggregate["class_ids"]
        times = []
        for adam in (self._adam_torch, self._adam_numpy):
            started = time.perf_counter()
            self._delta(aggregate)
            adam()
            rows = torch.from_numpy(aggregate["class_rows"] / FIXED_SCALE).float()
            self.W[torch.from_numpy(ids)] = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)
            times.append(time.perf_counter() - started)
        return ids, min(times)

    def index(self, ids: np.ndarray):
        faiss = _faiss()
        queries = self.W[torch.from_numpy(ids)].numpy()
        sims, found = faiss.knn(queries, self.W.numpy(), self.k + 2, faiss.METRIC_INNER_PRODUCT)
        own = found == ids[:, None]
        keep = np.argsort(own, axis=1, kind="stable")[:, : self.k + 1]  # own id to the end
        return np.take_along_axis(found, keep, 1), np.take_along_axis(sims, keep, 1)

    def spreadout(self, ids: np.ndarray, found: np.ndarray, sims: np.ndarray) -> None:
        """Eq. 8 for cosine: c-side by batched products over gathered neighbours, y-side as a
        sparse (rows x classes) product with the classes' rows, then the normalised step."""
        W, k, dim = self.W, self.k, self.W.shape[1]
        count = len(ids)
        neighbors = torch.from_numpy(found[:, :k])
        nu = torch.from_numpy(1.0 - sims[:, k])
        own = W[torch.from_numpy(ids)]
        block = max(1, (1 << 24) // (k * dim))
        coefs, own_grads = [], []
        for lo in range(0, count, block):
            hi = min(count, lo + block)
            other = W.index_select(0, neighbors[lo:hi].reshape(-1)).view(hi - lo, k, dim)
            hinge = nu[lo:hi, None] - 1.0 + torch.bmm(other, own[lo:hi, :, None])[:, :, 0]
            coef = 2.0 * hinge.clamp_min(0)
            coefs.append(coef)
            own_grads.append(torch.bmm(coef[:, None, :], other)[:, 0, :])
        coef = torch.cat(coefs)
        grad_ids, inverse = torch.unique(
            torch.cat([torch.from_numpy(ids), neighbors.reshape(-1)]), return_inverse=True
        )
        pair_rows = inverse[count:]
        pair_classes = torch.arange(count).repeat_interleave(k)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "sparse CSR support is in beta"
            y_side = torch.sparse_coo_tensor(
                torch.stack([pair_rows, pair_classes]),
                coef.reshape(-1),
                (len(grad_ids), count),
                check_invariants=False,
            ).to_sparse_csr()
        grad = torch.sparse.mm(y_side, own)
        grad.index_add_(0, inverse[:count], torch.cat(own_grads))
        rows = W[grad_ids] - self.step * grad
        W[grad_ids] = rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def evaluation(self, x: np.ndarray, y: np.ndarray, count: int) -> dict:
        from raysim.metrics.xml import precision_at_k

        faiss = _faiss()
        model = self.model
        model.eval()
        with torch.no_grad():
            embedding = torch.cat(
                [
                    model(torch.from_numpy(x[lo : min(count, lo + 512)]))
                    for lo in range(0, count, 512)
                ]
            )
        model.train()
        _, top = faiss.knn(embedding.numpy(), self.W.numpy(), 5, faiss.METRIC_INNER_PRODUCT)
        result = precision_at_k(top, np.asarray(y[:count]))
        total = torch.zeros(self.W.shape[1], dtype=torch.float64)
        squares = 0.0
        for lo in range(0, len(self.W), 1 << 16):
            block = self.W[lo : lo + (1 << 16)]
            total += block.sum(0, dtype=torch.float64)
            squares += float(torch.linalg.vector_norm(block, dtype=torch.float64) ** 2)
        rows = len(self.W)
        result["class_cosine_mean"] = float((total @ total - squares) / (rows * (rows - 1)))
        return result


# --- the run -----------------------------------------------------------------------------------
def timed(call):
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="synthetic_xml scale (1: 670K)")
    parser.add_argument("--repeats", type=int, default=3, help="alternated repetitions (>= 1)")
    parser.add_argument("--k", type=int, default=100, help="negatives per class")
    parser.add_argument("--clients-per-round", type=int, default=4000)
    parser.add_argument("--eval-points", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=cpus(), help="the floor's threads")
    parser.add_argument(
        "--inherited-threads",
        type=int,
        default=1,
        help="torch/faiss threads set before each raysim call (1: a Ray server actor's)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--phases", default=",".join(PHASES), help=f"comma-separated subset of {PHASES}"
    )
    parser.add_argument(
        "--client-workers", type=int, default=cpus(), help="worker processes (clients phase)"
    )
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "fedaws_phases.json")
    )
    args = parser.parse_args(argv)
    phases = [phase for phase in PHASES if phase in args.phases.split(",")]
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown or not phases:
        parser.error(f"--phases: unknown {sorted(unknown)}; choose from {PHASES}")
    started = time.perf_counter()
    probe = config_module.from_dict(
        {"run": {"seed": args.seed}, "data": {"name": "synthetic_xml", "scale": args.scale}}
    )
    dataset = load_dataset(probe)
    config = make_config(args, int(len(np.unique(dataset.train_y))))  # one client per class
    plan = plan_run(config, dataset)
    split, ctx = plan.split, plan.ctx
    algorithm = build_algorithm(ctx)
    state = algorithm.init_server(ctx)
    model = cached_model(ctx)
    layout = layout_of(model)
    setup = {
        "dataset": dataset,
        "split": split,
        "layout": layout,
        "seed": args.seed,
        "per_round": config.clients.per_round,
        "client_classes": single_class_of_clients(dataset.train_y, split.indices, split.offsets),
    }
    W = state.arrays["class_embeddings"]
    print(
        f"state: W {W.shape[0]:,} x {W.shape[1]} float32 ({W.nbytes / 2**30:.2f} GiB), theta "
        f"{state.arrays['params'].size:,} ({state.arrays['params'].nbytes / 2**20:.0f} MiB), "
        f"Adam slots; {config.clients.per_round} clients a round, k={args.k}, "
        f"{args.eval_points} eval points; floor threads {args.threads}, raysim called with "
        f"{args.inherited_threads} inherited; built in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    step = algorithm.lambda_ * (algorithm.spreadout_lr or config.clients.lr)
    floor = Floor(state, layout, model, args.k, step, config.server, args.threads)
    count = min(len(dataset.test_x), args.eval_points)
    setup["num_clients"] = split.num_clients

    clients_repetitions = []
    if "clients" in phases:
        clients_repetitions = clients_phase(args, config, setup, state, algorithm)
    repetitions = []
    if any(phase in phases for phase in SERVER_PHASES):
        repetitions = server_phases(args, setup, state, algorithm, ctx, floor, dataset)
    for record in repetitions:  # one record per repetition, the clients phase's merged in
        if clients_repetitions:
            clients = clients_repetitions[record["repetition"]]
            for key in ("raysim_s", "floor_s", "ratio"):
                record[key]["clients"] = clients[key]
            record["clients"] = clients
    if not repetitions:
        repetitions = [
            {
                "repetition": r["repetition"],
                "raysim_s": {"clients": r["raysim_s"]},
                "floor_s": {"clients": r["floor_s"]},
                "ratio": {"clients": r["ratio"]},
                "clients": r,
            }
            for r in clients_repetitions
        ]
    phases = [phase for phase in phases if phase in repetitions[0]["ratio"]]

    summary = {}
    for phase in phases:
        summary[phase] = {
            "raysim_s": statistics.median(r["raysim_s"][phase] for r in repetitions),
            "floor_s": statistics.median(r["floor_s"][phase] for r in repetitions),
            "ratio": statistics.median(r["ratio"][phase] for r in repetitions),
        }
    checks = [r["server_finite_check_s"] for r in repetitions if "server_finite_check_s" in r]
    check_s = statistics.median(checks) if checks else None
    print()
    header = f"{'phase':<12} {'raysim s':>9} {'floor s':>9} {'ratio':>7}  (median of ratios)"
    print(header)
    print("-" * len(header))
    for phase in phases:
        row = summary[phase]
        print(f"{phase:<12} {row['raysim_s']:>9.2f} {row['floor_s']:>9.2f} {row['ratio']:>7.2f}")
    if check_s is not None:
        print(f"(the Server's non-finite check of the new state, outside FedAwS: {check_s:.2f} s)")
    print(
        f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB (this process; the clients phase's "
        f"workers apart); wall {time.perf_counter() - started:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "fedaws_phases",
        "args": vars(args),
        "shapes": {
            "classes": int(W.shape[0]),
            "dim": int(W.shape[1]),
            "theta": int(state.arrays["params"].size),
            "clients_per_round": int(config.clients.per_round),
            "eval_points": count,
        },
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": cpus(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
        "summary": summary,
        "server_finite_check_s": check_s,
        "repetitions": repetitions,
        "peak_rss_gb": peak_rss_bytes() / 2**30,
    }
    out.write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {out}")


def clients_phase(args, config, setup, state, algorithm) -> list[dict]:
    """The clients phase (benchmarks/fedaws_clients.py): per repetition one round's sampled
    clients, split over --client-workers processes, through raysim's task body and through
    the plain loop, alternated; each timed from sending the work to holding the summed
    result."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import fedaws_clients

    from raysim.core.clients import chunk_clients

    spawn = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    workers = [
        ProcessPoolExecutor(
            1,
            mp_context=spawn,
            initializer=fedaws_clients.start_worker,
            initargs=(config_dict(args, config.partition.num_clients),),
        )
        for _ in range(args.client_workers)
    ]
    try:
        theta_sum = float(np.asarray(state.arrays["params"], dtype=np.float64).sum())
        for worker in workers:
            if worker.submit(fedaws_clients.theta_checksum).result() != theta_sum:
                raise SystemExit("a clients-phase worker built another theta than the server")
        print(
            f"clients phase: {len(workers)} worker processes (1 torch thread each) built the "
            f"run in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        classes = state.arrays["class_embeddings"]

        def run(system: str, round_index: int, token: int, clients) -> tuple[dict, float]:
            halves = chunk_clients(clients, len(workers))
            began = time.perf_counter()
            futures = [
                worker.submit(
                    fedaws_clients.run_half,
                    system,
                    round_index,
                    token,
                    half,
                    [(int(c), classes[c]) for c in setup["client_classes"][half]],
                )
                for worker, half in zip(workers, halves, strict=False)
            ]
            parts = [future.result()[0] for future in futures]
            if system == "raysim":
                merged = None
                for part in parts:
                    merged = algorithm.merge_reduced(merged, part, None)
            else:
                merged = fedaws_clients.merge_floor(parts)
            return merged, time.perf_counter() - began

        records = []
        for repetition in range(-1, args.repeats):  # -1: the warm-up, untimed
            round_index = repetition + 1
            token = round_index + 1  # a new payload: each worker loads theta once a round
            clients = np.sort(
                sample_clients(setup["seed"], round_index, setup["num_clients"], setup["per_round"])
            )
            raysim_first = repetition % 2 == 0
            load = os.getloadavg()[0]
            times, results = {}, {}
            for system in ("raysim", "floor") if raysim_first else ("floor", "raysim"):
                results[system], times[system] = run(system, round_index, token, clients)
            if repetition < 0:
                continue
            mine = fedaws_clients.mean_dense_delta("raysim", results["raysim"])
            theirs = fedaws_clients.mean_dense_delta("floor", results["floor"])
            difference = float(np.abs(mine - theirs).max() / max(np.abs(theirs).max(), 1e-30))
            record = {
                "repetition": repetition,
                "raysim_first": raysim_first,
                "raysim_s": times["raysim"],
                "floor_s": times["floor"],
                "ratio": times["raysim"] / times["floor"],
                "clients": int(len(clients)),
                "weight": [int(results["raysim"]["weight"]), int(results["floor"]["weight"])],
                "mean_delta_max_relative_difference": difference,
                "load_average_1min": load,
            }
            records.append(record)
            print(
                f"  clients repetition {repetition}: {times['raysim']:.2f}/{times['floor']:.2f} s "
                f"(raysim/floor; mean dense delta agrees to {difference:.1e} relative; "
                f"load {load:.1f})",
                flush=True,
            )
        return records
    finally:
        for worker in workers:
            worker.shutdown()


def server_phases(args, setup, state, algorithm, ctx, floor, dataset) -> list[dict]:
    """The four server phases, raysim's and the floor's, alternated per repetition."""
    test_x, test_y = dataset.test_x, dataset.test_y
    count = min(len(test_x), args.eval_points)
    rng = np.random.default_rng([args.seed, 7])

    def raysim_round(round_state, aggregate):
        set_threads(args.inherited_threads)
        (next_state, times), wall = timed(
            lambda: algorithm.server_update(round_state, aggregate, ctx)
        )
        phases = {
            "index": times["index_s"],
            "spreadout": times["spreadout_s"],
            "aggregation": wall - times["index_s"] - times["spreadout_s"],
        }
        _, check = timed(lambda: _non_finite_arrays(next_state))
        return next_state, phases, check

    def raysim_eval(eval_state):
        set_threads(args.inherited_threads)
        return timed(lambda: algorithm.evaluate(eval_state, test_x, test_y, ctx))

    def floor_round(aggregate):
        set_threads(args.threads)
        (ids, aggregation), _ = timed(lambda: floor.aggregation(aggregate))
        (found, sims), index = timed(lambda: floor.index(ids))
        _, spreadout = timed(lambda: floor.spreadout(ids, found, sims))
        return {"aggregation": aggregation, "index": index, "spreadout": spreadout}

    def floor_eval():
        set_threads(args.threads)
        return timed(lambda: floor.evaluation(test_x, test_y, count))

    # Warm-up (untimed): raysim builds its index from W at its first round.
    aggregate = synthetic_aggregate(0, setup, rng, state.arrays["class_embeddings"])
    state, _, _ = raysim_round(state, aggregate)
    floor_round(aggregate)
    repetitions = []
    for repetition in range(args.repeats):
        aggregate = synthetic_aggregate(
            repetition + 1, setup, rng, state.arrays["class_embeddings"]
        )
        load = os.getloadavg()[0]
        raysim_first = repetition % 2 == 0
        if raysim_first:
            state, mine, check = raysim_round(state, aggregate)
            theirs = floor_round(aggregate)
            metrics, mine["evaluation"] = raysim_eval(state)
            floor_metrics, theirs["evaluation"] = floor_eval()
        else:
            theirs = floor_round(aggregate)
            state, mine, check = raysim_round(state, aggregate)
            floor_metrics, theirs["evaluation"] = floor_eval()
            metrics, mine["evaluation"] = raysim_eval(state)
        record = {
            "repetition": repetition,
            "raysim_first": raysim_first,
            "raysim_s": mine,
            "floor_s": theirs,
            "ratio": {phase: mine[phase] / theirs[phase] for phase in SERVER_PHASES},
            "server_finite_check_s": check,
            "load_average_1min": load,
            "raysim_eval": metrics,
            "floor_eval": floor_metrics,
        }
        repetitions.append(record)
        print(
            f"  repetition {repetition}: "
            + ", ".join(
                f"{phase} {mine[phase]:.2f}/{theirs[phase]:.2f} s" for phase in SERVER_PHASES
            )
            + f" (raysim/floor; load {load:.1f})",
            flush=True,
        )
    return repetitions


if __name__ == "__main__":
    main()
