"""One FRL round through raysim against a plain-torch floor doing the same arithmetic.

Per repetition, in an order that alternates, each system runs the same round (same global
rankings, same clients, same batches) from the same server state:

  raysim     the local backend's round (`LocalBackend.run_round`, no evaluation): the server
             packs the global rankings, every client runs `raysim.core.clients.train_clients`
             (FRL.client_update: unpack R_g, reorder the scores, edge-popup, rankings,
             positions; the `ranks` codec bit-packs them), and the server decodes and checks
             every message, sums the positions and votes.
  floor      the same work in plain torch, no raysim code: s[R_g[j]] = sort(s0)[j] by a scatter,
             E epochs of edge-popup on the same supermask net (kthvalue mask, straight-through
             gradient, torch.optim.SGD with momentum and weight decay, the lr cosine-annealed
             over the round's steps, the same batch orders), one stable sort per layer of the
             final float32 scores (`torch.sort(stable=True)`), the inverse permutation by a
             scatter, then the vote: the int64 sum of positions and its stable sort. Nothing
             is packed: the floor has no wire.
  floor_int  the floor with raysim's sort: the final scores sorted as int32 keys that order as
             the floats do (radix sort), so the ratio to it is raysim's own overhead.

The new global rankings of all three are compared (they must be identical: a floor that did
less work would show), and so are one client's positions.

Workloads (E=2, batch 8, one torch thread):
  digits_mlp  configs/frl_digits.yaml: MLP 64-512-512-10 (300,032 edges), Dirichlet(1.0) over
              100 clients, 10 a round (~14 samples each)
  lenet28     LeNet on synthetic 28x28 images (1,199,648 edges), 100 iid clients of 60 samples,
              25 a round

    python benchmarks/frl_floor.py [--repetitions 7] [--warmup-rounds 2] [--out FILE]

writes benchmarks/results/frl_floor.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.nn import functional

from raysim import config as config_module
from raysim.assembly import plan_run
from raysim.core.state import RoundInfo
from raysim.data.datasets import load_dataset
from raysim.runtime.local import LocalBackend
from raysim.seeds import client_generator, sample_clients

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ("digits_mlp", "lenet28")
SYSTEMS = ("raysim", "floor", "floor_int")


def workload_config(name: str):
    raw = yaml.safe_load((REPO_ROOT / "configs" / "frl_digits.yaml").read_text())
    raw["runtime"]["backend"] = "local"
    raw["run"]["checkpoint_every"] = 0
    if name == "lenet28":
        raw["data"] = {
            "name": "synthetic_classification",
            "sample_shape": [1, 28, 28],
            "num_samples": 6000,
            "num_test": 100,
        }
        raw["partition"] = {"name": "iid", "num_clients": 100}
        raw["clients"]["per_round"] = 25
        raw["model"] = {"name": "lenet"}
    return config_module.from_dict(raw)


class Workload:
    """The run's data, split and backend, and a server state a few rounds in."""

    def __init__(self, name: str, warmup_rounds: int) -> None:
        self.name = name
        self.config = workload_config(name)
        self.dataset = load_dataset(self.config)
        plan = plan_run(self.config, self.dataset)
        self.split, self.ctx = plan.split, plan.ctx
        self.backend = LocalBackend(self.ctx, self.dataset, self.split)
        self.algorithm = self.backend.algorithm
        for round_index in range(warmup_rounds):  # rankings that have moved from argsort(s0)
            self.backend.run_round(self.info(round_index), evaluate=False)
        self.round_index = warmup_rounds
        self.state = self.backend.server.get_state()
        self.round_info = self.info(self.round_index)

    def info(self, round_index: int) -> RoundInfo:
        ids = sample_clients(
            self.ctx.seed, round_index, self.split.num_clients, self.config.clients.per_round
        )
        return RoundInfo(round_index, ids)

    def rankings(self) -> list[np.ndarray]:
        return self.algorithm.rankings(self.state)

    def raysim_round(self) -> tuple[float, list[np.ndarray]]:
        server = self.backend.server
        server.set_state(self.state)
        # A worker unpacks a round's rankings once for its clients (frl._ROUND_RANKINGS): forget
        # the previous repetition's, which are this round's too, so every repetition pays it.
        frl_module = sys.modules[type(self.algorithm).__module__]
        getattr(frl_module, "_ROUND_RANKINGS", {}).clear()
        started = time.perf_counter()
        self.backend.run_round(self.round_info, evaluate=False)
        seconds = time.perf_counter() - started
        return seconds, self.algorithm.rankings(server.get_state())

    def raysim_client_positions(self, client_id: int) -> np.ndarray:
        """One client's positions as raysim sends them (decoded), for the sanity check."""
        from raysim.core.validation import wire_format

        rows = self.split.indices[self.split.offsets[client_id] : self.split.offsets[client_id + 1]]
        x = torch.from_numpy(self.dataset.train_x[rows])
        y = torch.from_numpy(self.dataset.train_y[rows].astype(np.int64))
        payload = self.algorithm.server_payload(self.state)
        generator = client_generator(self.ctx.seed, self.round_index, client_id)
        update = self.algorithm.client_update(payload, x, y, client_id, generator, self.ctx)
        codec, layout = wire_format(self.algorithm, self.ctx)
        return codec.decode(codec.encode(update.vector, layout), layout)


# --- the floor: plain torch ----------------------------------------------------------------------


class _StraightThroughTopK(torch.autograd.Function):
    """Forward: 1 for scores above the dropped-th smallest (kthvalue), else 0. Backward: the
    identity."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, dropped: int) -> torch.Tensor:
        threshold = torch.kthvalue(scores.detach().reshape(-1), dropped).values
        return (scores > threshold).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


_INT32_MAX = 2**31 - 1


def _int_keys(values: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered as the float32 values (no NaN in the floor's scores)."""
    bits = (values + 0.0).view(torch.int32)
    return bits ^ ((bits >> 31) & _INT32_MAX)


class Floor:
    """The round's arithmetic in plain torch. Taken from raysim at setup only (not timed): the
    seed's weights and initial scores, the clients' rows and their generators' seeds."""

    def __init__(self, workload: Workload, int_keys: bool) -> None:
        config, ctx = workload.config, workload.ctx
        supernet = workload.algorithm.supernet(ctx)
        self.lenet = config.model.name == "lenet"
        self.weights = [layer.weight.detach().clone() for layer in supernet.layers]
        self.sorted_s0 = [s.clone() for s in supernet.sorted_initial_scores]
        k = workload.algorithm.k
        self.dropped = [int((1 - k) * w.numel()) for w in self.weights]
        self.int_keys = int_keys
        clients = config.clients
        self.epochs, self.batch_size = clients.local_epochs, clients.batch_size
        self.momentum, self.weight_decay = clients.momentum, clients.weight_decay
        self.lr = clients.lr * workload.algorithm.lr_decay**workload.round_index
        self.train_x, self.train_y = workload.dataset.train_x, workload.dataset.train_y
        split = workload.split
        ids = workload.round_info.client_ids
        self.rows = [split.indices[split.offsets[c] : split.offsets[c + 1]] for c in ids]
        self.seeds = [
            client_generator(ctx.seed, workload.round_index, int(c)).initial_seed() for c in ids
        ]
        self.global_rankings = [torch.from_numpy(r) for r in workload.rankings()]

    def forward(self, x: torch.Tensor, scores: list[torch.Tensor]) -> torch.Tensor:
        w = [
            weight * _StraightThroughTopK.apply(s, dropped)
            for weight, s, dropped in zip(self.weights, scores, self.dropped, strict=True)
        ]
        if self.lenet:
            x = functional.relu(functional.conv2d(x, w[0]))
            x = functional.relu(functional.conv2d(x, w[1]))
            x = functional.max_pool2d(x, 2).flatten(1)
            return functional.linear(functional.relu(functional.linear(x, w[2])), w[3])
        x = x.flatten(1)
        for layer in w[:-1]:
            x = functional.relu(functional.linear(x, layer))
        return functional.linear(x, w[-1])

    def client(self, rows: np.ndarray, seed: int) -> list[torch.Tensor]:
        """One client's positions per layer."""
        x = torch.from_numpy(self.train_x[rows])
        y = torch.from_numpy(self.train_y[rows].astype(np.int64))
        if not len(y):  # nothing to learn from: the positions of the global ranking
            rankings = self.global_rankings
        else:
            scores = [
                torch.zeros_like(s0).scatter_(0, r, s0).view(w.shape).requires_grad_()
                for s0, r, w in zip(self.sorted_s0, self.global_rankings, self.weights, strict=True)
            ]
            optimizer = torch.optim.SGD(
                scores, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
            generator = torch.Generator().manual_seed(seed)
            total_steps = self.epochs * math.ceil(len(y) / self.batch_size)
            step = 0
            for _ in range(self.epochs):
                order = torch.randperm(len(y), generator=generator)
                for start in range(0, len(y), self.batch_size):
                    batch = order[start : start + self.batch_size]
                    for group in optimizer.param_groups:
                        group["lr"] = self.lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
                    loss = functional.cross_entropy(self.forward(x[batch], scores), y[batch])
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    step += 1
            final = [s.detach().reshape(-1) for s in scores]
            if self.int_keys:
                rankings = [torch.sort(_int_keys(s), stable=True).indices for s in final]
            else:
                rankings = [torch.sort(s, stable=True).indices for s in final]
        return [
            torch.empty_like(r).scatter_(0, r, torch.arange(len(r), dtype=r.dtype))
            for r in rankings
        ]

    def round(self) -> tuple[float, list[np.ndarray]]:
        started = time.perf_counter()
        sums = None
        for rows, seed in zip(self.rows, self.seeds, strict=True):
            positions = self.client(rows, seed)
            sums = (
                positions if sums is None else [a + p for a, p in zip(sums, positions, strict=True)]
            )
        rankings = [torch.sort(total, stable=True).indices for total in sums]
        seconds = time.perf_counter() - started
        return seconds, [r.numpy() for r in rankings]


# --- the measurement -----------------------------------------------------------------------------


def measure(name: str, repetitions: int, warmup_rounds: int) -> dict:
    workload = Workload(name, warmup_rounds)
    floors = {"floor": Floor(workload, int_keys=False), "floor_int": Floor(workload, True)}
    runs = {"raysim": workload.raysim_round, **{k: f.round for k, f in floors.items()}}
    for system in SYSTEMS:  # warm-up (caches, allocator), not timed
        runs[system]()
    times: dict[str, list[float]] = {system: [] for system in SYSTEMS}
    identical = True
    for repetition in range(repetitions):
        order = SYSTEMS if repetition % 2 == 0 else SYSTEMS[::-1]
        new_rankings = {}
        for system in order:
            seconds, new_rankings[system] = runs[system]()
            times[system].append(seconds)
        for system in ("floor", "floor_int"):
            identical &= all(
                np.array_equal(a, b)
                for a, b in zip(new_rankings["raysim"], new_rankings[system], strict=True)
            )
    # One client's positions, raysim's (decoded from its message) against the floor's.
    client_id = int(workload.round_info.client_ids[0])
    floor = floors["floor"]
    ours = workload.raysim_client_positions(client_id)
    theirs = np.concatenate([p.numpy() for p in floor.client(floor.rows[0], floor.seeds[0])])
    client_identical = bool(np.array_equal(ours, theirs))
    ratios = {
        system: statistics.median(
            r / f for r, f in zip(times["raysim"], times[system], strict=True)
        )
        for system in ("floor", "floor_int")
    }
    return {
        "workload": name,
        "edges": int(sum(workload.algorithm.layer_sizes(workload.ctx))),
        "clients_per_round": int(len(workload.round_info.client_ids)),
        "client_samples": [
            int(workload.split.offsets[c + 1] - workload.split.offsets[c])
            for c in workload.round_info.client_ids
        ],
        "round_index": workload.round_index,
        "ms_per_round": {s: 1000 * statistics.median(t) for s, t in times.items()},
        "ratio_raysim_to": ratios,
        "times_s": times,
        "rankings_identical": bool(identical),
        "client_positions_identical": client_identical,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--warmup-rounds", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "frl_floor.json"))
    args = parser.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or not names:
        parser.error(f"--workloads: unknown {unknown}; choose from {WORKLOADS}")
    torch.set_num_threads(1)  # as a client task runs (ctx.client_threads)
    results = [measure(name, args.repetitions, args.warmup_rounds) for name in names]
    header = (
        f"{'workload':<12} {'raysim ms/round':>15} {'floor ms/round':>14} {'ratio':>6}"
        f" {'floor_int ms':>12} {'ratio':>6}  rankings identical"
    )
    print(header)
    for result in results:
        ms, ratio = result["ms_per_round"], result["ratio_raysim_to"]
        same = result["rankings_identical"] and result["client_positions_identical"]
        print(
            f"{result['workload']:<12} {ms['raysim']:>15.1f} {ms['floor']:>14.1f}"
            f" {ratio['floor']:>6.2f} {ms['floor_int']:>12.1f} {ratio['floor_int']:>6.2f}  {same}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "frl_floor",
        "args": vars(args),
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "torch": torch.__version__,
            "numpy": np.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "results": results,
    }
    out.write_text(json.dumps(payload, indent=2, default=float))
    print(f"wrote {out}")
    ok = all(r["rankings_identical"] and r["client_positions_identical"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
