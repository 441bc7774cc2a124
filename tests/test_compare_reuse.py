"""`raysim compare --reuse`: a method's finished grid sweep and re-runs in --out are read back
instead of trained again only when every run there is, by its config fingerprint and its round
count, what the spec gives; anything else (another grid, an edited config, a run that stopped,
a random search) is tuned and re-run. The folders here are written by hand in the formats a
run writes (config.yaml with its fingerprint header, summary.json, metrics.jsonl), so no test
trains anything."""

from __future__ import annotations

import csv
import json

import pytest
import yaml
from conftest import DIGITS_CONFIG

from raysim import compare as compare_module
from raysim import config as config_module
from raysim.compare_reuse import reusable_results
from raysim.compare_spec import load_comparison
from raysim.outputs.identity import config_fingerprint, config_header
from raysim.tune_space import apply_params

ROUNDS = 2
SHARED = [
    "data.validation_fraction=0.1",
    f"run.rounds={ROUNDS}",
    "run.checkpoint_every=0",
    "partition.num_clients=10",
    "clients.per_round=3",
    "runtime.backend=local",
]
GRIDS = {
    "fedavg": {"clients.lr": [0.01, 0.1, 0.3]},
    "fedprox": {"clients.lr": [0.03, 0.1, 0.3]},
}
# validation accuracy per trial point: fedavg's best is 0.1, fedprox's 0.3 (an edge)
VALIDATION = {"fedavg": {0.01: 0.5, 0.1: 0.8, 0.3: 0.7}, "fedprox": {0.03: 0.4, 0.1: 0.6, 0.3: 0.9}}


def _spec(tmp_path, grids=GRIDS, space_kind="grid") -> str:
    methods = {}
    for name, space in grids.items():
        methods[name] = {
            "space": {key: {space_kind: values} for key, values in space.items()},
            **({"set": ["algorithm.name=fedprox"]} if name == "fedprox" else {}),
        }
    spec = {
        "base": str(DIGITS_CONFIG),
        "set": SHARED,
        "compare": {
            "metric": "val/accuracy",
            "trials": 1,
            "seeds": [0, 1],
            "report": ["accuracy"],
            "reference": "fedavg",
        },
        "methods": methods,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def _write_run(folder, config, *, accuracy, val_accuracy=None, rounds=ROUNDS) -> None:
    folder.mkdir(parents=True)
    header = config_header({"raysim": "test"}, config_fingerprint(config))
    (folder / "config.yaml").write_text(header + config.to_yaml())
    summary = {
        "rounds": rounds,
        "final": {"accuracy": accuracy, "loss": 1 - accuracy},
        "final_val": None if val_accuracy is None else {"accuracy": val_accuracy},
        "best": {"accuracy": {"value": accuracy, "round": rounds}},
    }
    (folder / "summary.json").write_text(json.dumps(summary))
    record = {"round": rounds, "eval": {"accuracy": accuracy}}
    (folder / "metrics.jsonl").write_text(json.dumps(record) + "\n")


def _write_finished_comparison(comparison, out) -> None:
    """What `run_comparison` leaves in OUT for each method: its sweep's trials and CSV, and its
    winner re-run on every seed."""
    for method in comparison.methods:
        sweep = out / method.name / "tune"
        rows = []
        for index, lr in enumerate(GRIDS[method.name]["clients.lr"]):
            trial = f"t{method.name}_{index:05d}"
            config = apply_params(method.config, {"clients.lr": lr})
            val = VALIDATION[method.name][lr]
            _write_run(sweep / "trials" / trial, config, accuracy=val - 0.1, val_accuracy=val)
            rows.append({"trial": trial, "status": "completed", "rounds": ROUNDS,
                         "clients.lr": lr, "val/accuracy": val})  # fmt: skip
        rows.sort(key=lambda row: -row["val/accuracy"])
        with (sweep / "tune_results.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]), lineterminator="\n")
            writer.writeheader()
            writer.writerows(rows)
        best_lr = rows[0]["clients.lr"]
        for seed in comparison.seeds:
            config = apply_params(method.config, {"clients.lr": best_lr})
            config = config_module.from_dict(config.to_dict(), [f"run.seed={seed}"])
            _write_run(method.run_dir(out, None, seed), config, accuracy=0.6 + seed / 100)


@pytest.fixture
def finished(tmp_path):
    comparison = load_comparison(_spec(tmp_path))
    out = tmp_path / "out"
    _write_finished_comparison(comparison, out)
    return comparison, out


def test_a_finished_grid_method_is_read_back_with_its_winner_chosen_again(finished):
    comparison, out = finished
    for method, lr in zip(comparison.methods, (0.1, 0.3), strict=True):
        results, why_not = reusable_results(comparison, method, out)
        assert why_not == ""
        assert results["best_params"] == {"clients.lr": lr}
        assert results["best_validation"] == VALIDATION[method.name][lr]
        assert results["trials"] == 3
        assert [results["runs"][None][s]["final"]["accuracy"] for s in (0, 1)] == [0.6, 0.61]


def test_reuse_trains_nothing_and_reports_as_from_the_folders(finished, monkeypatch, capsys):
    comparison, out = finished

    def no_training(*args, **kwargs):
        raise AssertionError("a reusable method was trained again")

    from raysim.runtime import ray_cluster

    monkeypatch.setattr(ray_cluster, "connect", lambda *args, **kwargs: False)
    monkeypatch.setattr("raysim.tune.run_sweep", no_training)
    monkeypatch.setattr("raysim.assembly.run", no_training)
    report = compare_module.run_comparison(comparison, out, reuse=True)
    assert "fedavg: reused, not trained again" in capsys.readouterr().out
    assert report["table"] == compare_module.report_from_folders(comparison, out)["table"]
    assert report["methods"]["fedprox"]["metrics"]["accuracy"]["per_seed"] == [0.6, 0.61]


def test_a_method_whose_grid_changed_is_tuned_again_and_the_others_reused(
    finished, tmp_path, monkeypatch, capsys
):
    _, out = finished
    recentred = {**GRIDS, "fedprox": {"clients.lr": [0.1, 0.3, 1.0]}}  # its edge winner, 0.3
    comparison = load_comparison(_spec(tmp_path, grids=recentred))

    class Tuned(Exception):
        pass

    def tune(config, spec, out_dir, **kwargs):
        raise Tuned(out_dir)

    from raysim.runtime import ray_cluster

    monkeypatch.setattr(ray_cluster, "connect", lambda *args, **kwargs: False)
    monkeypatch.setattr("raysim.tune.run_sweep", tune)
    with pytest.raises(Tuned, match="fedprox"):
        compare_module.run_comparison(comparison, out, reuse=True)
    printed = capsys.readouterr().out
    assert "fedavg: reused" in printed
    assert "fedprox: not reused: " in printed and "is not at a point of this spec's grid" in printed


def _edit(path, old, new) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (  # a trial's config edited after it ran
            lambda out: _edit(out / "fedavg/tune/trials/tfedavg_00001/config.yaml",
                              "momentum: 0.9", "momentum: 0.5"),
            "tfedavg_00001/config.yaml was edited after its run",
        ),
        (  # a re-run that did not reach the last round
            lambda out: _edit(out / "fedavg/seed_1/summary.json", '"rounds": 2', '"rounds": 1'),
            "seed_1 did not run 2 rounds",
        ),
        (  # a re-run that stopped before writing its summary
            lambda out: (out / "fedavg/seed_0/summary.json").unlink(),
            "seed_0 did not finish (no readable summary.json)",
        ),
        (  # a sweep with a trial that did not complete
            lambda out: _edit(out / "fedavg/tune/tune_results.csv", "completed", "stopped@1"),
            "did not complete (stopped@1)",
        ),
        (  # a sweep with a point missing
            lambda out: _edit(out / "fedavg/tune/tune_results.csv",
                              "\ntfedavg_00000,completed,2,0.01,0.5", ""),
            "its trials are not this spec's grid (2 trials, 3 expected",
        ),
    ],
)  # fmt: skip
def test_a_folder_that_is_not_this_spec_s_finished_run_is_not_reused(finished, damage, reason):
    comparison, out = finished
    damage(out)
    results, why_not = reusable_results(comparison, comparison.methods[0], out)
    assert results is None
    assert reason in why_not


def test_a_winner_re_run_from_another_winner_is_not_reused(finished):
    """If the sweep's winner changes (here its validation score is edited so another trial
    wins), the re-runs of the old winner are not this spec's."""
    comparison, out = finished
    _edit(
        out / "fedavg/tune/trials/tfedavg_00002/summary.json",
        '"accuracy": 0.7}',
        '"accuracy": 0.95}',
    )
    results, why_not = reusable_results(comparison, comparison.methods[0], out)
    assert results is None
    assert "seed_0/config.yaml is not the config this spec gives that run" in why_not


def test_a_random_search_is_not_reused_since_its_folder_cannot_show_its_seed(tmp_path):
    bounds = {name: {"clients.lr": [0.01, 0.3]} for name in GRIDS}
    comparison = load_comparison(_spec(tmp_path, grids=bounds, space_kind="loguniform"))
    results, why_not = reusable_results(comparison, comparison.methods[0], tmp_path / "out")
    assert results is None
    assert "only a grid sweep under the fifo scheduler" in why_not


def test_reuse_needs_the_comparison_s_folder(tmp_path, capsys):
    from raysim.cli import main

    assert main(["compare", _spec(tmp_path), "--reuse"]) != 0
    assert "raysim compare --reuse needs --out" in capsys.readouterr().err
