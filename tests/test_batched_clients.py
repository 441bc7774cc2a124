"""The batched client path (`clients.batched: true`, raysim/core/batched_training.py).

- every batched method's client updates agree with its sequential ones within TOLERANCE;
- ragged clients (0 and 1 samples, an exact batch, a partial last batch, different step
  counts) each match their own sequential training, and a client's batched result is the same
  bit for bit whatever chunk it shares (alone, in pairs, all together, padded slots);
- batched Ray == batched local bit for bit for two packings of clients into tasks;
- a method that cannot be batched trains sequentially after one notice line;
- FedAwS and its baselines (one-class clients, each training theta and its own class row)
  match their sequential updates, and a run does not depend on the chunk.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import REPO_ROOT
from torch import nn

from raysim.assembly import plan_run, run
from raysim.core.algorithm import AlgorithmHooks
from raysim.core.batched_training import ClientBatch, batched_updates, train_batched
from raysim.core.client_step import ClientStep
from raysim.core.clients import single_class_of_clients
from raysim.core.server import build_algorithm
from raysim.core.training import fresh_sgd, local_training, scheduled_lr
from raysim.data.datasets import load_dataset
from raysim.models import devices
from raysim.models.vector import get_vector, set_vector
from raysim.seeds import client_generator

# Largest |batched - sequential| entry of one round's client delta (measured: 1.5e-8 to 1.2e-7
# on these configs; docs/BATCHED.md). Ten times the largest measured.
TOLERANCE = 1e-6

SMALL = ("partition.num_clients=12", "clients.per_round=4", "clients.local_epochs=2")


def _setup(digits_config, *overrides):
    config = digits_config(*SMALL, *overrides)
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    algorithm = build_algorithm(plan.ctx)
    return dataset, plan.split, plan.ctx, algorithm


def _sequential_update(algorithm, payload, dataset, split, client, round_index, ctx):
    """What `client_update` returns for `client` in round `round_index` (the reference)."""
    rows = split.indices[split.offsets[client] : split.offsets[client + 1]]
    x = torch.from_numpy(dataset.train_x[rows])
    y = torch.from_numpy(dataset.train_y[rows].astype(np.int64))
    generator = client_generator(ctx.seed, round_index, client)
    return algorithm.client_update(payload, x, y, client, generator, ctx)


def _batched_and_sequential(algorithm, payload, dataset, split, ctx, ids, round_index):
    """(batched update, its sequential reference) of each of `ids` in round `round_index`."""
    batched = batched_updates(
        ctx, AlgorithmHooks.of(algorithm), payload, dataset.train_x, dataset.train_y,
        split.indices, split.offsets, round_index, ids,
    )  # fmt: skip
    assert batched is not None
    return [
        (update, _sequential_update(algorithm, payload, dataset, split, c, round_index, ctx))
        for update, c in zip(batched, ids, strict=True)
    ]


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.name=fedavg", "clients.weight_decay=0.001"),
        ("algorithm.name=fedprox", "algorithm.mu=0.1"),
        ("algorithm.name=fedavg", "algorithm.lr_decay=0.9", "algorithm.lr_schedule=cosine_steps"),
        ("algorithm.name=signsgd", "aggregator.name=sum"),
        ("algorithm.name=topk", "aggregator.name=weighted_mean"),
    ],
    ids=["fedavg_wd", "fedprox", "lr_schedule", "signsgd", "topk"],
)
def test_batched_updates_match_sequential(digits_config, overrides):
    dataset, split, ctx, algorithm = _setup(digits_config, *overrides)
    state = algorithm.init_server(ctx)
    state.round = 3  # lr_decay: a round other than 0
    payload = algorithm.server_payload(state)
    ids = [0, 3, 5, 7, 11]
    for update, reference in _batched_and_sequential(
        algorithm, payload, dataset, split, ctx, ids, 3
    ):
        assert update.num_samples == reference.num_samples
        assert float(np.abs(update.vector - reference.vector).max()) <= TOLERANCE
        assert update.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
        assert update.stats == reference.stats


def test_batched_run_matches_sequential_run(digits_config, tmp_path):
    """Two rounds of FedAvg with momentum and FedAdam, then trimmed mean under an attack."""
    for extra in (
        ("server.optimizer=adam", "server.lr=0.01"),
        ("aggregator.name=trimmed_mean", "attack.name=sign_flip", "attack.fraction=0.1"),
    ):
        finals = []
        for batched in ("false", "true"):
            config = digits_config(*SMALL, "run.rounds=2", f"clients.batched={batched}", *extra)
            out = tmp_path / f"{extra[0]}-{batched}"
            finals.append(run(config, out, progress=False, tensorboard=False).state)
        sequential, batched_state = (s.arrays["params"] for s in finals)
        assert float(np.abs(sequential - batched_state).max()) <= 10 * TOLERANCE


# --- ragged clients, against the sequential loop itself --------------------------------------

SIZES = [1, 5, 16, 17, 40, 0]  # 1 sample, short, an exact batch, a partial last batch, empty


def _ragged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    rng = np.random.default_rng(0)
    xs = [torch.from_numpy(rng.normal(size=(n, 8)).astype(np.float32)) for n in SIZES]
    ys = [torch.from_numpy(rng.integers(0, 3, n)) for n in SIZES]
    return model, get_vector(model), xs, ys


HYPER = dict(batch_size=16, epochs=2, momentum=0.9, weight_decay=1e-3, proximal_mu=0.01)


def _batched(model, start, xs, ys, ids, slots=None):
    batch = ClientBatch(
        tuple(ids),
        tuple(xs[i] for i in ids),
        tuple(ys[i] for i in ids),
        tuple(torch.Generator().manual_seed(100 + i) for i in ids),
        rows=16,
        slots=slots,
    )
    step = ClientStep(
        model=model,
        loss=nn.functional.cross_entropy,
        lr=0.05,
        lr_schedule="cosine_steps",
        **HYPER,
    )
    return train_batched(step, [start] * len(ids), batch)


def _sequential(model, start, x, y, seed):
    set_vector(model, start)
    n = len(y)
    if not n:
        return start.copy(), float("nan")
    optimizer = fresh_sgd(model, lr=0.05, momentum=0.9, weight_decay=1e-3)
    per_epoch = -(-n // 16)

    def before_step(step):
        for group in optimizer.param_groups:
            group["lr"] = scheduled_lr(
                "cosine_steps", 0.05, step, steps_per_epoch=per_epoch, epochs=2
            )

    loss = local_training(
        n,
        torch.Generator().manual_seed(seed),
        batch_size=16,
        epochs=2,
        loss_fn=lambda b: nn.functional.cross_entropy(model(x[b]), y[b]),
        optimizer=optimizer,
        proximal_mu=0.01,
        before_step=before_step,
    )
    return get_vector(model), loss


def test_ragged_clients_each_match_their_sequential_training():
    model, start, xs, ys = _ragged()
    trained, losses = _batched(model, start, xs, ys, range(len(SIZES)))
    for i, n in enumerate(SIZES):
        vector, loss = _sequential(model, start, xs[i], ys[i], 100 + i)
        assert float(np.abs(trained[i] - vector).max()) <= TOLERANCE, n
        if n:
            assert losses[i] == pytest.approx(loss, rel=1e-5)
        else:  # an empty client does not move and has no loss
            assert (trained[i] == start).all() and np.isnan(losses[i])


@pytest.mark.parametrize("threads", [1, 2])
def test_a_clients_result_does_not_depend_on_its_chunk(threads):
    model, start, xs, ys = _ragged()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together, losses = _batched(model, start, xs, ys, range(len(SIZES)))
        for ids, slots in (([0], None), ([1, 2], None), ([5, 3, 4], None), ([2], 7)):
            trained, chunk_losses = _batched(model, start, xs, ys, ids, slots)
            for k, i in enumerate(ids):
                assert trained[k].tobytes() == together[i].tobytes(), (ids, i)
                assert np.isnan(losses[i]) or chunk_losses[k] == losses[i]
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("on_host", [True, False])
def test_start_rows_are_stacked_with_shared_pieces_broadcast(on_host, monkeypatch):
    """A start (or StartParts piece) every client shares is broadcast, the others stacked,
    padding slots zero; the device way (a GPU's: torch writes) is forced here on the CPU and
    writes the same values as the host way."""
    from raysim.core import batched_training
    from raysim.core.client_step import StartParts

    monkeypatch.setattr(batched_training, "_rows_written_on_host", lambda device: on_host)
    rng = np.random.default_rng(0)
    shared = rng.standard_normal(7).astype(np.float32)
    own = [rng.standard_normal(3).astype(np.float32) for _ in range(3)]
    # theta's dense part seen through a new view per client, as StartParts makes it
    parts = [StartParts(shared.reshape(-1), own[i], np.float32([i])) for i in range(3)]
    stacked = batched_training._stacked_starts(parts, 5, torch.device("cpu")).numpy()
    expected = np.zeros((5, 11), dtype=np.float32)
    for i in range(3):
        expected[i] = np.concatenate([shared, own[i], [i]])
    assert stacked.tobytes() == expected.tobytes()
    # whole rows: one shared (FedAvg's global model), one per client, tensors (FRL's scores)
    for starts in ([shared] * 3, own, [torch.from_numpy(row) for row in own]):
        stacked = batched_training._stacked_starts(starts, 4, torch.device("cpu")).numpy()
        rows = [np.asarray(start) for start in starts]
        assert stacked.tobytes() == np.stack([*rows, np.zeros_like(rows[0])]).tobytes()
    read_only = shared.copy()
    read_only.flags.writeable = False  # Ray's zero-copy payload: no torch warning, same values
    stacked = batched_training._stacked_starts([read_only] * 2, 2, torch.device("cpu"))
    assert stacked.numpy().tobytes() == np.stack([shared, shared]).tobytes()


def test_a_row_loss_trains_each_client_as_the_loss_taken_row_by_row():
    """A step's `row_loss` (one call for a batch's rows) gives every ragged client the very
    result the vmapped driver gets taking `loss` one row at a time, bit for bit."""
    from dataclasses import replace

    from raysim.losses import cross_entropy_rows

    model, start, xs, ys = _ragged()
    ids = range(len(SIZES))
    batch = ClientBatch(
        tuple(ids), tuple(xs), tuple(ys), (), rows=16
    )  # generators below, fresh for each run

    def trained(step):
        generators = tuple(torch.Generator().manual_seed(100 + i) for i in ids)
        return train_batched(step, [start] * len(SIZES), replace(batch, generators=generators))

    step = ClientStep(
        model=model, loss=nn.functional.cross_entropy, lr=0.05, lr_schedule="cosine_steps", **HYPER
    )
    rows, losses = trained(replace(step, row_loss=cross_entropy_rows))
    want_rows, want_losses = trained(step)
    assert rows.tobytes() == want_rows.tobytes()
    assert np.array_equal(np.asarray(losses), np.asarray(want_losses), equal_nan=True)


def test_the_vmapped_driver_runs_the_steps_vmapped_model_and_the_sequential_its_model():
    """`ClientStep.vmapped_model`: the vmapped driver runs it in place of `model` (same
    parameter names; here the same function stated twice, one of them counting its calls),
    and the sequential driver never does; the two agree to float rounding."""
    from dataclasses import replace

    from raysim.core.client_step import train_one

    model, start, xs, ys = _ragged()

    class Counted(nn.Sequential):
        """`model`'s layers under the same names, counting its forward calls."""

        calls = 0

        def forward(self, x):
            Counted.calls += 1
            return super().forward(x)

    counted = Counted(*(copy.deepcopy(layer) for layer in model))
    step = ClientStep(model=model, loss=nn.functional.cross_entropy, lr=0.05, **HYPER)
    ids = range(len(SIZES))
    batch = ClientBatch(
        tuple(ids),
        tuple(xs),
        tuple(ys),
        tuple(torch.Generator().manual_seed(100 + i) for i in ids),
        rows=16,
    )
    rows, _ = train_batched(replace(step, vmapped_model=counted), [start] * len(SIZES), batch)
    assert Counted.calls > 0
    calls = Counted.calls
    for i in ids:
        generator = torch.Generator().manual_seed(100 + i)
        alone, _ = train_one(replace(step, vmapped_model=counted), start, xs[i], ys[i], generator)
        assert float(np.abs(alone - rows[i]).max()) <= 1e-6
    assert Counted.calls == calls  # the sequential driver ran `model`, not the vmapped one


def test_a_fedavg_subclass_with_a_loss_of_its_own_gets_no_row_loss(digits_config):
    """FedAvg's step carries cross_entropy_rows beside its cross-entropy; a subclass that
    states a loss of its own (label smoothing here) gets no row loss, so the vmapped driver
    takes its loss row by row rather than FedAvg's."""
    from raysim.algorithms.fedavg import FedAvg
    from raysim.losses import cross_entropy_rows

    class Smoothed(FedAvg):
        @staticmethod
        def batch_loss(outputs, targets):
            return nn.functional.cross_entropy(outputs, targets, label_smoothing=0.1)

    dataset, split, ctx, algorithm = _setup(digits_config)
    payload = algorithm.server_payload(algorithm.init_server(ctx))
    assert algorithm.client_step(payload, ctx).row_loss is cross_entropy_rows
    smoothed = Smoothed()
    assert smoothed.client_step(payload, ctx).row_loss is None
    for update, reference in _batched_and_sequential(
        smoothed, payload, dataset, split, ctx, [0, 3], 1
    ):
        assert float(np.abs(update.vector - reference.vector).max()) <= TOLERANCE


# --- fallback ----------------------------------------------------------------------------------


def test_unbatchable_method_falls_back_with_one_line(digits_config, tmp_path, capsys):
    devices._NOTICES.clear()
    configs = [
        digits_config(
            *SMALL, "run.rounds=1", "algorithm.mixed_precision=true", f"clients.batched={b}"
        )
        for b in ("false", "true")
    ]
    states = [
        run(c, tmp_path / str(i), progress=False, tensorboard=False).state
        for i, c in enumerate(configs)
    ]
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "clients.batched" in line]
    assert lines == [
        "raysim: notice: clients.batched: algorithm 'fedavg': mixed_precision (bfloat16 "
        "autocast) is not batched; training clients one at a time (docs/BATCHED.md)"
    ]
    assert states[0].arrays["params"].tobytes() == states[1].arrays["params"].tobytes()


def test_a_plugin_written_once_runs_sequentially_and_batched(digits_config):
    """FedAvg states its client once (raysim.core.client_step): a subclass changes a piece of
    that description (examples/plugins/clipped_fedavg.py: `client_messages`) and both drivers
    run it, so it batches and clips alike; overriding `client_update` of a described method
    is refused in one line when the class is defined."""
    import importlib.util

    from raysim.algorithms.fedavg import FedAvg

    spec = importlib.util.spec_from_file_location(
        "clipped_fedavg_batched", REPO_ROOT / "examples" / "plugins" / "clipped_fedavg.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    with pytest.raises(TypeError, match="overrides client_update of a method that describes"):

        class OnlySequential(FedAvg):
            def client_update(self, payload, x, y, client_id, generator, ctx):
                return super().client_update(payload, x, y, client_id, generator, ctx)

    dataset, split, ctx, _ = _setup(digits_config)
    clipped = module.ClippedFedAvg(max_norm=0.05)
    assert clipped.batching_problem(ctx) is None
    payload = clipped.server_payload(clipped.init_server(ctx))
    for update, reference in _batched_and_sequential(
        clipped, payload, dataset, split, ctx, [0, 3, 5], 1
    ):
        assert update.metrics["clipped"] == reference.metrics["clipped"] == 1.0
        assert float(np.linalg.norm(update.vector)) == pytest.approx(0.05, rel=1e-5)
        assert float(np.abs(update.vector - reference.vector).max()) <= TOLERANCE


# --- Ray == local, any packing ------------------------------------------------------------------


@pytest.mark.ray
def test_batched_ray_equals_batched_local_for_two_packings(ray_session, digits_config, tmp_path):
    overrides = (*SMALL, "run.rounds=1", "clients.batched=true", "clients.batch_chunk=3")
    local = run(digits_config(*overrides), tmp_path / "local", progress=False, tensorboard=False)
    expected = local.state.arrays["params"].tobytes()
    for per_task in (1, 3):
        result = run(
            digits_config(*overrides, f"clients.per_task={per_task}", backend="ray"),
            tmp_path / f"ray{per_task}",
            progress=False,
            tensorboard=False,
        )
        assert result.state.arrays["params"].tobytes() == expected, per_task
        assert result.summary["final"]["train_loss"] == local.summary["final"]["train_loss"]


# --- FedAwS: one-class clients, theta and each client's own class row -------------------------

FEDAWS_DIGITS = (  # configs/fedaws_fmnist.yaml's method on digits, a small MLP embedding
    "data.name=digits",
    "partition.num_clients=30",
    "clients.per_round=10",
    "model.hidden=[32]",
    "model.embedding_dim=16",
    "clients.local_epochs=2",
    "clients.batch_size=16",
    "clients.momentum=0.9",
    "clients.weight_decay=0.001",
    "algorithm.class_lr=0.3",  # not clients.lr: the row steps at its own rate
    "runtime.backend=local",
)


def _fedaws_config(*overrides):
    from raysim import config

    return config.load(REPO_ROOT / "configs" / "fedaws_fmnist.yaml", [*FEDAWS_DIGITS, *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("algorithm.spreadout=none",),
        ("algorithm.train_class_embeddings=false",),
        ("algorithm={name: fedaws_softmax, scale: 4.0, class_lr: 0.3}",),
    ],
    ids=["fedaws", "baseline1", "baseline2", "softmax_oracle"],
)
def test_fedaws_batched_updates_match_sequential(overrides):
    config = _fedaws_config(*overrides)
    dataset = load_dataset(config)
    plan = plan_run(config, dataset)
    ctx, split = plan.ctx, plan.split
    algorithm = build_algorithm(ctx)
    hooks = AlgorithmHooks.of(algorithm)
    state = algorithm.init_server(ctx)
    payload = algorithm.server_payload(state)
    ids = np.array([0, 4, 9, 13, 22, 29])
    classes = single_class_of_clients(dataset.train_y, split.indices, split.offsets)[ids]
    personal = None  # FedAwS: each client's own class row; the oracle sends all of W to all
    if hooks.client_payload is not None:
        personal = algorithm.client_payload(state, ids, classes)
    batched = batched_updates(
        ctx, hooks, payload, dataset.train_x, dataset.train_y, split.indices, split.offsets, 2,
        ids, personal,
    )  # fmt: skip
    assert batched is not None
    for position, update in enumerate(batched):
        sent = payload if personal is None else (payload, personal[position])
        reference = _sequential_update(algorithm, sent, dataset, split, int(ids[position]), 2, ctx)
        expected = reference.vector
        assert set(update.vector) == set(expected)
        assert float(np.abs(np.asarray(expected["dense"])).max()) > 100 * TOLERANCE  # moved
        for key, value in expected.items():
            if key == "class":
                assert update.vector[key] == value == int(classes[position])
                continue
            difference = np.abs(update.vector[key] - np.asarray(value)).max()
            assert float(difference) <= TOLERANCE, key
        assert update.num_samples == reference.num_samples
        assert update.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)


def test_fedaws_batched_runs_do_not_depend_on_the_chunk_and_match_sequential(tmp_path):
    states = {}
    for mode in ("false", "true-1", "true-4"):
        batched, _, chunk = mode.partition("-")
        extra = [f"clients.batched={batched}"] + ([f"clients.batch_chunk={chunk}"] if chunk else [])
        config = _fedaws_config("run.rounds=2", "run.eval_every=2", *extra)
        states[mode] = run(config, tmp_path / mode, progress=False, tensorboard=False).state
    for key in ("params", "class_embeddings"):
        one, four = (states[m].arrays[key] for m in ("true-1", "true-4"))
        assert one.tobytes() == four.tobytes(), key
        difference = np.abs(states["false"].arrays[key] - four).max()
        assert float(difference) <= 10 * TOLERANCE, key


def test_fedaws_with_an_embedding_bag_falls_back_with_one_line(tmp_path, capsys):
    devices._NOTICES.clear()
    from test_fedaws import tiny_config

    config = tiny_config(run__rounds=1, clients__batched=True)
    run(config, tmp_path / "bag", progress=False, tensorboard=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "clients.batched" in line]
    assert lines == [
        "raysim: notice: clients.batched: algorithm 'fedaws': embedding-bag clients are slower "
        "batched than one at a time on a CPU; training clients one at a time (docs/BATCHED.md)"
    ]


# --- FRL: supermask clients, batched on a GPU ---------------------------------------------------


@pytest.mark.parametrize("mask_by_abs", [False, True])
@pytest.mark.parametrize("k", [0.5, 0.3, 1.0])
def test_batched_top_k_masks_equal_the_one_client_mask(k, mask_by_abs):
    from raysim.models.supermask import top_k_mask, top_k_masks

    rng = np.random.default_rng(1)
    scores = torch.from_numpy(rng.integers(-3, 4, size=(5, 7, 6)).astype(np.float32))  # ties
    scores[1] = torch.from_numpy(rng.standard_normal((7, 6)).astype(np.float32))
    scores[2] = 0.0  # every score tied
    scores[3, 0, :3] = -0.0
    masks = top_k_masks(scores, k, mask_by_abs)
    for client in range(len(scores)):
        expected = top_k_mask(scores[client], k, mask_by_abs)
        assert torch.equal(masks[client], expected), client


def test_batched_positions_equal_each_clients_own_ranking():
    from raysim.algorithms.frl import batched_positions, positions_of, ranking_of, split_layers

    rng = np.random.default_rng(2)
    sizes = [12, 30, 7]
    scores = rng.integers(-3, 4, size=(4, sum(sizes))).astype(np.float32)  # ties
    scores[1] = rng.standard_normal(sum(sizes))
    scores[2, :5] = -0.0
    scores[2, 5:9] = np.nan
    scores[3, 3] = np.inf
    positions = batched_positions(torch.from_numpy(scores), sizes)
    for client in range(len(scores)):
        layers = split_layers(scores[client], sizes)
        expected = np.concatenate([positions_of(ranking_of(layer)) for layer in layers])
        assert np.array_equal(positions[client], expected), client


def test_frl_batched_rankings_match_sequential_and_a_cpu_trains_one_at_a_time():
    from raysim import config

    cfg = config.load(
        REPO_ROOT / "configs" / "frl_digits.yaml",
        ["runtime.backend=local", "model.hidden=[64]", "clients.batched=true"],
    )
    dataset = load_dataset(cfg)
    plan = plan_run(cfg, dataset)
    ctx, split = plan.ctx, plan.split
    algorithm = build_algorithm(ctx)
    assert algorithm.batching_problem(ctx) == (
        "supermask clients are slower batched than one at a time on a CPU"
    )
    state = algorithm.init_server(ctx)
    state.round = 2  # lr_decay: a round other than 0
    payload = algorithm.server_payload(state)
    ids = (0, 3, 5, 42)
    rows = [split.indices[split.offsets[c] : split.offsets[c + 1]] for c in ids]
    xs = [torch.from_numpy(dataset.train_x[r]) for r in rows]
    ys = [torch.from_numpy(dataset.train_y[r].astype(np.int64)) for r in rows]
    empty = (torch.zeros((0, *xs[0].shape[1:])), torch.zeros(0, dtype=torch.int64))
    batch = ClientBatch(
        client_ids=(*ids, 99),
        xs=(*xs, empty[0]),
        ys=(*ys, empty[1]),
        generators=tuple(client_generator(ctx.seed, 2, c) for c in (*ids, 99)),
        rows=cfg.clients.batch_size,
    )
    batched = algorithm.batched_client_updates(payload, batch, ctx)
    for position, update in enumerate(batched):
        c = batch.client_ids[position]
        generator = client_generator(ctx.seed, 2, c)
        x, y = batch.xs[position], batch.ys[position]
        reference = algorithm.client_update(payload, x, y, c, generator, ctx)
        if not len(y):  # votes for the global ranking, as sequentially
            assert np.array_equal(update.vector, reference.vector)
            continue
        # Scores that agree to float rounding: only near-tied edges swap places
        differing = update.vector != reference.vector
        assert differing.mean() < 1e-3, c
        assert int(np.abs(update.vector - reference.vector).max()) <= 3, c
        assert update.metrics["loss"] == pytest.approx(reference.metrics["loss"], rel=1e-5)
