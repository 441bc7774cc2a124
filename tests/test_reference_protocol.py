"""The FRL reference code's training and attack details, as raysim options: the per-epoch
cosine schedule and the 0.999^round decay of the FedAvg family, the 1e5 x model naive attack,
the padded bias-free LeNet, best-so-far metrics, and the comparison's edge check."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import raysim
from raysim import config, registry
from raysim.compare_report import edge_findings
from raysim.core.algorithm import RunContext
from raysim.core.best_so_far import BestSoFar, best_of_records
from raysim.core.state import RoundInfo, ServerState
from raysim.core.training import scheduled_lr
from raysim.errors import ConfigError
from raysim.models.vector import build_model, get_vector

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _fedavg_config(*overrides: str) -> config.Config:
    return config.load(
        CONFIGS / "fedavg_digits.yaml",
        ["runtime.backend=local", "model.hidden=[16]", *overrides],
    )


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step()`")
def test_cosine_epochs_is_torchs_cosine_annealing_stepped_per_epoch():
    params = [torch.nn.Parameter(torch.zeros(1))]
    optimizer = torch.optim.SGD(params, lr=0.4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3)
    steps_per_epoch = 5
    for epoch in range(3):
        for step_in_epoch in range(steps_per_epoch):
            step = epoch * steps_per_epoch + step_in_epoch
            ours = scheduled_lr("cosine_epochs", 0.4, step, steps_per_epoch=5, epochs=3)
            assert ours == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12)
        scheduler.step()
    # E = 2: the reference trains epoch 0 at lr and epoch 1 at lr / 2
    assert scheduled_lr("cosine_epochs", 0.4, 7, steps_per_epoch=7, epochs=2) == pytest.approx(0.2)
    assert scheduled_lr("constant", 0.4, 99, steps_per_epoch=7, epochs=2) == 0.4
    with pytest.raises(ValueError, match="unknown lr schedule"):
        scheduled_lr("warmup", 0.4, 0, steps_per_epoch=1, epochs=1)


def test_fedavg_trains_round_t_at_lr_times_decay_to_the_t_scheduled_per_epoch(monkeypatch):
    """The learning rate each step of a client in round 3 sees: 0.01 * 0.5^3, then halved in
    the second epoch (cosine_epochs, E = 2)."""
    import raysim.core.client_step as client_step_module  # FedAvg's sequential driver

    seen = []
    real = client_step_module.local_training

    def recording(num_samples, generator, *, optimizer, before_step=None, **options):
        def record(step):
            if before_step is not None:
                before_step(step)
            seen.append(optimizer.param_groups[0]["lr"])

        return real(num_samples, generator, optimizer=optimizer, before_step=record, **options)

    monkeypatch.setattr(client_step_module, "local_training", recording)
    cfg = _fedavg_config(
        "clients.lr=0.01", "clients.batch_size=4", "clients.local_epochs=2",
        "algorithm={name: fedavg, lr_decay: 0.5, lr_schedule: cosine_epochs}",
    )  # fmt: skip
    ctx = RunContext(cfg, (64,), 10)
    algorithm = registry.algorithms.build("fedavg", lr_decay=0.5, lr_schedule="cosine_epochs")
    params = get_vector(build_model(ctx))
    payload = algorithm.server_payload(ServerState(3, {"params": params}))
    x, y = torch.randn(8, 64), torch.arange(8) % 10
    algorithm.client_update(payload, x, y, 0, torch.Generator().manual_seed(0), ctx)
    base = 0.01 * 0.5**3
    assert seen == pytest.approx([base, base, base / 2, base / 2])
    # the default keeps plain FedAvg: a bare params payload, a constant rate
    plain = registry.algorithms.build("fedavg")
    assert isinstance(plain.server_payload(ServerState(3, {"params": params})), np.ndarray)
    with pytest.raises(ConfigError, match="lr_schedule"):
        registry.algorithms.build("fedavg", lr_schedule="warmup")
    with pytest.raises(ConfigError, match="lr_decay"):
        registry.algorithms.build("fedavg", lr_decay=0.0)


def test_naive_scaling_of_the_model_sends_scale_times_the_received_model():
    attack = registry.attacks.build("naive_scaling", scale=1e5, of="model")
    model = np.array([0.5, -2.0, 3.0], dtype=np.float32)
    info = RoundInfo(round_index=0, client_ids=np.array([0, 1, 7]), malicious_below=2)
    honest = [np.ones(3, np.float32), np.ones(3, np.float32)]
    crafted = attack.craft(honest, RoundInfoWithBase(info, model), None, None, None)
    assert len(crafted) == 2
    for vector in crafted:
        np.testing.assert_array_equal(vector, (1e5 * model.astype(np.float64)).astype(np.float32))
    with pytest.raises(ConfigError, match="attack.of"):
        registry.attacks.build("naive_scaling", of="weights")


def RoundInfoWithBase(info: RoundInfo, base: np.ndarray) -> RoundInfo:  # noqa: N802
    import dataclasses

    return dataclasses.replace(info, delta_base=base)


def test_a_fedavg_run_under_the_model_scaling_attack_is_wrecked_without_the_guard(tmp_path):
    """End to end: the server hands the attack the received model; with the update-size guard
    off (as in the reference) the 1e5 x model update reaches the mean and wrecks the model."""
    result = raysim.run(
        CONFIGS / "fedavg_digits.yaml",
        out=tmp_path / "run",
        overrides=[
            "runtime.backend=local", "model.hidden=[16]", "run.rounds=2", "clients.per_round=10",
            "attack={name: naive_scaling, scale: 100000.0, of: model, fraction: 0.2}",
            "server.max_update_ratio=0", "run.max_idle_rounds=0", "run.checkpoint_every=0",
        ],
        progress=False,
    )  # fmt: skip
    assert result.summary["final"]["accuracy"] < 0.3


def test_reference_lenet_is_padded_and_bias_free():
    cfg = _fedavg_config("model={name: lenet, padding: 1, bias: false}")
    model = build_model(RunContext(cfg, (1, 28, 28), 10))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears[0].in_features == 12544 and linears[0].out_features == 128
    assert all(m.bias is None for m in model.modules() if hasattr(m, "bias"))
    default = build_model(RunContext(_fedavg_config("model={name: lenet}"), (1, 28, 28), 10))
    first = [m for m in default.modules() if isinstance(m, torch.nn.Linear)][0]
    assert first.in_features == 9216 and first.bias is not None


def test_reference_supermask_lenet_is_padded():
    from raysim.models.supermask import SupermaskLinear, build_supernet

    net = build_supernet("lenet", (1, 28, 28), 10, 0, padding=1)
    first = [m for m in net.modules() if isinstance(m, SupermaskLinear)][0]
    assert first.weight.shape == (128, 12544)
    assert net(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_torch_default_supermask_weights_are_kaiming_uniform_with_a_sqrt5():
    """The FRL reference code's `conv_init=default`: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), the
    bound torch's kaiming_uniform_(a=sqrt(5)) gives, drawn from the seed alone."""
    from raysim.models.supermask import build_supernet, supermask_layers

    net = build_supernet("lenet", (1, 28, 28), 10, 3, padding=1, weight_init="torch_default")
    again = build_supernet("lenet", (1, 28, 28), 10, 3, padding=1, weight_init="torch_default")
    for layer, twin in zip(supermask_layers(net), supermask_layers(again), strict=True):
        bound = 1 / math.sqrt(layer.fan_in)
        reference = torch.empty_like(layer.weight)
        torch.nn.init.kaiming_uniform_(reference, a=math.sqrt(5))
        assert math.isclose(float(reference.abs().max()), bound, rel_tol=0.05)
        assert float(layer.weight.abs().max()) <= bound * (1 + 1e-6)  # float32 rounding
        assert float(layer.weight.abs().max()) > 0.95 * bound  # fills the interval
        assert len(torch.unique(layer.weight.abs())) > 100  # not a signed constant
        assert torch.equal(layer.weight, twin.weight)


def test_an_frl_run_under_the_reference_rules_attacks_with_the_pool_alone(tmp_path):
    """FRL with the reference's |score| mask, torch-default weights and the pool-only benign
    set runs, and the benign set changes what the attack sends (so the run differs from the
    sampled-and-pool one from the first attacked round)."""
    from raysim.assembly import run

    def go(benign_set: str):
        cfg = config.load(
            CONFIGS / "frl_digits.yaml",
            [
                "runtime.backend=local",
                "run.rounds=3",
                "run.checkpoint_every=0",
                "model.hidden=[32]",
                "algorithm.mask_by_abs=true",
                "algorithm.weight_init=torch_default",
                "attack.name=frl_reversal",
                "attack.fraction=0.2",
                "attack.pool_size=5",
                f"attack.benign_set={benign_set}",
            ],
        )
        return run(cfg, tmp_path / benign_set, progress=False, tensorboard=False)

    pool, both = go("pool"), go("sampled_and_pool")
    assert pool.summary["clients_done"] == both.summary["clients_done"]
    rankings = [name for name in pool.state.arrays if name.startswith("ranking.")]
    assert rankings and any(
        not np.array_equal(pool.state.arrays[n], both.state.arrays[n]) for n in rankings
    )


def test_best_so_far_takes_the_highest_quality_and_the_lowest_loss_earliest_on_ties():
    best = BestSoFar()
    best.add(1, {"accuracy": 0.5, "loss": 2.0})
    best.add(2, {"accuracy": 0.7, "loss": 1.0})
    best.add(3, {"accuracy": 0.7, "loss": 1.5, "p@1": math.nan})
    best.add(4, {"accuracy": 0.6, "loss": 0.9})
    assert best.summary() == {
        "accuracy": {"value": 0.7, "round": 2},
        "loss": {"value": 0.9, "round": 4},
    }
    assert BestSoFar().summary() is None


def test_a_run_reports_best_so_far_beside_final_and_keeps_it_through_a_resume(tmp_path):
    overrides = ["runtime.backend=local", "model.hidden=[16]", "run.checkpoint_every=2",
                 "clients.lr=0.5"]  # fmt: skip
    whole = raysim.run(CONFIGS / "fedavg_digits.yaml", out=tmp_path / "whole",
                       overrides=[*overrides, "run.rounds=6"], progress=False)  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    expected = best_of_records(records).summary()
    assert whole.summary["best"] == expected
    assert expected["accuracy"]["value"] == max(r["eval"]["accuracy"] for r in records)
    assert whole.summary["best"]["accuracy"]["value"] >= whole.summary["final"]["accuracy"]
    raysim.run(CONFIGS / "fedavg_digits.yaml", out=tmp_path / "part",
               overrides=[*overrides, "run.rounds=4"], progress=False)  # fmt: skip
    resumed = raysim.resume(tmp_path / "part", overrides=["run.rounds=6"], progress=False)
    assert resumed.summary["best"] == expected


def test_the_edge_check_flags_winners_at_the_edge_of_their_space():
    space = {
        "clients.lr": {"loguniform": [0.3, 3.0]},
        "algorithm.k": {"choice": [0.3, 0.5, 0.7]},
        "clients.momentum": {"choice": [0.0, 0.9]},
        "clients.local_epochs": {"randint": [1, 6]},
    }
    found = edge_findings(
        space,
        {"clients.lr": 0.33, "algorithm.k": 0.5, "clients.momentum": 0.0,
         "clients.local_epochs": 5},
    )  # fmt: skip
    assert len(found) == 2
    assert "clients.lr=0.33 at the low edge" in found[0]
    assert "clients.local_epochs=5 at the high edge" in found[1]
    inside = edge_findings(space, {"clients.lr": 0.95, "algorithm.k": 0.7})
    assert inside == ["algorithm.k=0.7 is the highest of choice [0.3, 0.5, 0.7]"]
    grids = {"clients.lr": [0.01, 0.1, 1.0], "algorithm.scale": {"grid": [0.5, 2.0, 8.0]}}
    assert edge_findings(grids, {"clients.lr": 0.01, "algorithm.scale": 2.0}) == [
        "clients.lr=0.01 is the lowest of grid [0.01, 0.1, 1.0]"
    ]
