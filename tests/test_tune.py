"""`raysim tune`: the sweep section is validated like a config, trials run in their own placement
groups, and the saved best config reproduces the best trial's final metric exactly."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from raysim import cli
from raysim.errors import ConfigError
from raysim.tune import load_sweep, trial_bundles
from raysim.tune_results import final_metric
from raysim.tune_space import apply_params

SWEEP_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tune_fedavg_digits.yaml"


def _write_sweep(tmp_path, tune_section: dict, **sections) -> str:
    raw = yaml.safe_load(SWEEP_CONFIG.read_text())
    raw["tune"] = tune_section
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_shipped_sweep_parses_and_reserves_one_client_slot():
    config, spec = load_sweep(SWEEP_CONFIG)
    assert spec.scheduler == "asha" and spec.num_samples == 8 and spec.mode == "max"
    assert [(d.key, d.kind) for d in spec.space] == [
        ("clients.lr", "loguniform"),
        ("clients.momentum", "choice"),
    ]
    # empty head (driver + server actor: 0 CPUs) + one client slot of clients.num_cpus
    assert trial_bundles(config, spec) == [{"CPU": 0.0}, {"CPU": 1.0}]
    assert trial_bundles(config.replace(runtime__backend="local"), spec) == [{"CPU": 1.0}]
    # GPUs: the server actor's in the head bundle, the clients' in each slot; in one process
    # (local backend) the larger of the two
    gpus = config.replace(server__num_gpus=0.5, clients__num_gpus=0.25)
    assert trial_bundles(gpus, spec) == [{"CPU": 0.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.25}]
    local = gpus.replace(runtime__backend="local")
    assert trial_bundles(local, spec) == [{"CPU": 1.0, "GPU": 0.5}]


def test_overrides_reach_the_tune_section_and_the_experiment():
    config, spec = load_sweep(
        SWEEP_CONFIG, ["tune.num_samples=3", "tune.scheduler=fifo", "run.rounds=4"]
    )
    assert spec.num_samples == 3 and spec.scheduler == "fifo" and config.run.rounds == 4


def test_params_apply_like_set_overrides():
    config, _ = load_sweep(SWEEP_CONFIG)
    tuned = apply_params(config, {"clients.lr": 0.0123456789, "clients.local_epochs": 2})
    assert tuned.clients.lr == 0.0123456789 and tuned.clients.local_epochs == 2
    assert "tune" not in tuned.to_dict()


@pytest.mark.parametrize(
    ("tune_section", "message"),
    [
        ({"space": {"clients.lr": {"choice": [0.1]}}, "metirc": "x"}, "unknown key 'tune.metirc'"),
        ({"space": {"clients.lrr": {"choice": [0.1]}}}, "clients.lrr"),
        ({"space": {"clients.lr": {"choice": [-0.1]}}}, "value -0.1 gives an invalid config"),
        ({"space": {"clients.lr": {"logunifrom": [0.1, 1]}}}, "unknown domain 'logunifrom'"),
        ({"space": {"clients.lr": {"uniform": [1, 0.1]}}}, "low < high"),
        ({"space": {"clients.lr": {"loguniform": [0, 1]}}}, "low > 0"),
        ({"space": {"clients.num_cpus": [1, 2]}}, "fixed for a sweep"),
        ({"space": {"clients.lr": [0.1]}, "mode": "best"}, "'tune.mode' must be"),
        ({"space": {"clients.lr": [0.1]}, "metric": "accuracy"}, "val/<name>"),
        (
            {"space": {"clients.lr": [0.1]}, "metric": "eval/accuracy"},
            "measured on the test split",
        ),
        ({"space": {"run.rounds": [2, 4]}, "scheduler": "asha"}, "cannot sweep run.rounds"),
        ({"space": {}}, "'tune.space' must map"),
    ],
)
def test_bad_sweeps_are_one_clear_error(tmp_path, tune_section, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        load_sweep(_write_sweep(tmp_path, tune_section))


def test_a_validation_metric_needs_a_validation_split(tmp_path):
    section = {"space": {"clients.lr": [0.1]}, "metric": "val/accuracy"}
    with pytest.raises(ConfigError, match="needs a validation split: set data.validation_fraction"):
        load_sweep(_write_sweep(tmp_path, section, data={"validation_fraction": 0.0}))
    _, spec = load_sweep(_write_sweep(tmp_path, section, data={"validation_fraction": 0.1}))
    assert spec.metric == "val/accuracy"
    # the test split only when asked for, knowingly
    test_metric = {**section, "metric": "eval/accuracy", "allow_test_metric": True}
    assert load_sweep(_write_sweep(tmp_path, test_metric))[1].metric == "eval/accuracy"


def test_a_config_without_tune_section_is_refused(digits_config_path):
    with pytest.raises(ConfigError, match="no 'tune:' section"):
        load_sweep(digits_config_path)


def test_best_trial_is_the_best_that_ran_every_round_and_the_table_lists_errors():
    from raysim.tune_results import _best, _sort_key, format_table

    _, spec = load_sweep(SWEEP_CONFIG)

    def row(trial, status, accuracy, error=""):
        params = {"clients.lr": 0.1, "clients.momentum": 0.9}
        return {"trial": trial, "status": status, "rounds": 30, "params": params,
                "val/accuracy": accuracy, "error": error, "out": ""}  # fmt: skip

    rows = [
        row("a", "completed", 0.90),
        row("b", "stopped@10", 0.95),  # higher, but after 10 rounds only
        row("c", "completed", 0.93),
        row("d", "ERROR", None, error="ValueError: boom"),
        row("e", "completed", float("nan")),
    ]
    rows.sort(key=lambda r: _sort_key(r, spec))
    assert [r["trial"] for r in rows] == ["b", "c", "a", "d", "e"]
    assert _best(rows, spec)["trial"] == "c"
    table = format_table(rows, spec)
    assert table.splitlines()[0].split() == [
        "trial", "status", "rounds", "clients.lr", "clients.momentum", "val/accuracy"
    ]  # fmt: skip
    assert "d: ValueError: boom" in table


@pytest.mark.ray
def test_asha_sweep_and_best_config_reproduces_the_best_trial(ray_session, tmp_path, capsys):
    """`raysim tune`: 2 trials (at once on the session's 2 CPUs) of a 3-round digits run
    with ASHA; `raysim run` on best_config.yaml ends with exactly the best trial's accuracy."""
    sweep = _write_sweep(
        tmp_path,
        {
            "metric": "eval/accuracy",
            "allow_test_metric": True,  # the mechanics under test; protocol: val/ (below)
            "mode": "max",
            "scheduler": "asha",
            "grace_period": 1,
            "reduction_factor": 2,
            "max_concurrent_trials": 2,
            "space": {"clients.lr": {"grid": [0.003, 0.1]}},
        },
        run={"rounds": 3, "checkpoint_every": 0},
        partition={"num_clients": 20},
        clients={"per_round": 4, "local_epochs": 1},
    )
    out = tmp_path / "sweep"
    assert cli.main(["tune", sweep, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "trial        status" in printed and "best: trial" in printed

    with open(out / "tune_results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(float(r["clients.lr"]) for r in rows) == [0.003, 0.1]
    completed = [r for r in rows if r["status"] == "completed"]
    assert completed and all(r["rounds"] == "3" for r in completed)
    assert all(r["status"] == "completed" or r["status"].startswith("stopped@") for r in rows)
    best = rows[0]  # sorted best first; the best completed trial
    assert best["status"] == "completed"
    assert float(best["eval/accuracy"]) == max(float(r["eval/accuracy"]) for r in completed)
    assert float(best["eval/accuracy"]) > 0.3  # lr 0.003 stays near chance (0.1) in 3 rounds

    # Each trial's simulation used only its placement group's one client slot: one task a
    # round (two otherwise, since Ray has 2 CPUs).
    for row in completed:
        records = [json.loads(line) for line in open(f"{row['out']}/metrics.jsonl")]
        assert [r["tasks"] for r in records] == [1, 1, 1]
        # the whole run's outputs exist: Tune stops a trial only after its last report
        summary = json.loads(open(f"{row['out']}/summary.json").read())
        assert summary["final"]["accuracy"] == float(row["eval/accuracy"])
        assert sum(summary["task_nodes"].values()) == 3

    best_config = out / "best_config.yaml"
    assert "tune" not in yaml.safe_load(best_config.read_text())
    rerun = tmp_path / "rerun"
    code = cli.main(
        ["run", str(best_config), "--out", str(rerun), "--no-progress"]
        + ["--set", "runtime.backend=local"]  # same result on either backend (tested elsewhere)
    )
    assert code == 0
    summary = json.loads((rerun / "summary.json").read_text())
    assert final_metric(summary, "eval/accuracy") == float(best["eval/accuracy"])  # exact
