"""`raysim compare`: equal tuning budgets on validation, winners re-run per seed, a report whose
every number is traceable to a run folder; and specs that would compare unfairly are refused."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from conftest import DIGITS_CONFIG
from PIL import Image

from raysim.compare import report_from_folders, run_comparison
from raysim.compare_spec import load_comparison
from raysim.errors import ConfigError

SHARED = [
    "data.validation_fraction=0.1",
    "run.rounds=2",
    "run.checkpoint_every=0",
    "partition.num_clients=10",
    "clients.per_round=3",
    "runtime.backend=local",
]


def _spec(tmp_path, **changes) -> str:
    spec = {
        "base": str(DIGITS_CONFIG),
        "set": SHARED,
        "compare": {
            "metric": "val/accuracy",
            "trials": 2,
            "seeds": [0, 1],
            "report": ["accuracy", "loss"],
            "reference": "fedavg",
        },  # fmt: skip
        "methods": {
            "fedavg": {"space": {"clients.lr": {"loguniform": [0.01, 0.3]}}},
            "fedprox": {
                "set": ["algorithm.name=fedprox"],
                "space": {"clients.lr": {"loguniform": [0.01, 0.3]}},
            },
        },
    }
    for key, value in changes.items():
        section, _, name = key.partition("__")
        if name:
            spec[section][name] = value
        else:
            spec[section] = value
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"compare__metric": "eval/accuracy"}, "measured on the test split"),
        ({"compare__seeds": [0]}, "at least 2 distinct seeds"),
        ({"compare__reference": "fedsgd"}, "'compare.reference' 'fedsgd' is not one"),
        ({"compare__trials": 0}, "'compare.trials' must be >= 1"),
        (
            {"methods__fedprox": {"set": ["algorithm.name=fedprox"], "space": {}}},
            "an untuned one would be compared unfairly",
        ),
        (
            {"methods__fedprox": {"space": {"clients.lr": [0.01, 0.1, 0.3]}}},
            "grids have different numbers of points (fedavg 1, fedprox 3",
        ),
        (
            {"methods__fedprox": {"space": {"clients.lr": {"grid": []}}}},
            "a grid must list at least one value",
        ),
        (
            {
                "methods__fedprox": {
                    "set": ["run.rounds=5"],
                    "space": {"clients.lr": {"choice": [0.1]}},
                }
            },
            "every method must run the same rounds",
        ),
        ({"compare__trails": 3}, "unknown key 'compare.trails'"),
    ],
)
def test_an_unfair_or_leaky_comparison_is_refused(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_comparison(_spec(tmp_path, **changes))


def test_grids_of_the_same_size_are_an_equal_budget_of_trials_times_points(tmp_path):
    spec = load_comparison(
        _spec(
            tmp_path,
            methods={
                "fedavg": {"space": {"clients.lr": [0.01, 0.1, 0.3],
                                     "clients.momentum": {"choice": [0.0, 0.9]}}},
                "fedprox": {"set": ["algorithm.name=fedprox"],
                            "space": {"clients.lr": {"grid": [0.03, 0.1, 0.3]},
                                      "algorithm.mu": {"loguniform": [0.001, 0.1]}}},
            },
        )
    )  # fmt: skip
    assert spec.trials == 2 * 3  # compare.trials samples of each of the 3 grid points
    assert [m.spec.num_samples for m in spec.methods] == [2, 2]


@pytest.mark.ray
def test_every_method_gets_the_same_budget_and_the_report_traces_to_the_runs(ray_session, tmp_path):
    out = tmp_path / "out"
    report = run_comparison(load_comparison(_spec(tmp_path)), out)
    reference = []
    for name in ("fedavg", "fedprox"):
        with open(out / name / "tune" / "tune_results.csv") as handle:
            trials = list(csv.DictReader(handle))
        assert len(trials) == 2  # the equal budget
        entry = report["methods"][name]
        finals = [
            json.loads((out / name / f"seed_{seed}" / "summary.json").read_text())["final"]
            for seed in (0, 1)
        ]
        for metric in ("accuracy", "loss"):
            values = [final[metric] for final in finals]
            assert entry["metrics"][metric]["per_seed"] == values
            assert entry["metrics"][metric]["mean"] == pytest.approx(np.mean(values))
            assert entry["metrics"][metric]["std"] == pytest.approx(np.std(values, ddof=1))
        if name == "fedavg":
            reference = [final["accuracy"] for final in finals]
        ratios = [f["accuracy"] / r for f, r in zip(finals, reference, strict=True)]
        assert entry["ratio"]["per_seed"] == pytest.approx(ratios)
        # the winner was tuned on validation, and its re-runs kept the validation split
        assert 0 < entry["best_validation"] <= 1
        assert all("final_val" in json.loads((out / name / f"seed_{s}" / "summary.json")
                                             .read_text()) for s in (0, 1))  # fmt: skip
    assert "| fedavg |" in (out / "comparison.md").read_text()
    with Image.open(out / "comparison.png") as image:
        image.verify()
    # the report again from the folders alone (raysim compare --report-only): the same table
    table = (out / "comparison.md").read_text()
    (out / "comparison.md").unlink()
    again = report_from_folders(load_comparison(_spec(tmp_path)), out)
    assert again["table"] == report["table"]
    assert (out / "comparison.md").read_text() == table


@pytest.mark.parametrize(
    ("scenarios", "message"),
    [
        ({"lr_shift": ["clients.lr=0.5"]}, "sets ['clients.lr'], which method 'fedavg' tunes"),
        ({"a b": []}, "scenario name 'a b' must be"),
        ({"bad": ["attack.fraction=2"]}, "scenario 'bad'"),
        ({"bad": "attack.fraction=0.1"}, "scenario 'bad' must be a list"),
    ],
)
def test_a_scenario_that_would_replace_a_tuned_value_or_is_malformed_is_refused(
    tmp_path, scenarios, message
):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_comparison(_spec(tmp_path, scenarios=scenarios))


@pytest.mark.ray
def test_winners_are_re_run_under_each_scenario_untuned_for_it(ray_session, tmp_path):
    """The winner tuned on the method's own config is re-run under every scenario; each
    scenario's table is paired with the reference's runs under the same scenario."""
    out = tmp_path / "out"
    scenarios = {"clean": [], "noisy": ["faults.client_failure_rate=0.3"]}
    spec = _spec(
        tmp_path,
        compare__trials=1,  # what is re-run per scenario is checked here, not the tuning
        scenarios=scenarios,
        methods={
            "fedavg": {"space": {"clients.lr": {"loguniform": [0.01, 0.3]}}},
            "fedprox": {  # a method may start from its own experiment config
                "base": str(DIGITS_CONFIG),
                "set": ["algorithm.name=fedprox"],
                "space": {"clients.lr": {"loguniform": [0.01, 0.3]}},
            },
        },
    )
    report = run_comparison(load_comparison(spec), out)
    assert report["scenarios"] == scenarios
    for name in ("fedavg", "fedprox"):
        best = report["methods"][name]["best_params"]["clients.lr"]
        for scenario in scenarios:
            entry = report["methods"][name]["scenarios"][scenario]
            finals = []
            for seed in (0, 1):
                folder = out / name / scenario / f"seed_{seed}"
                config = yaml.safe_load((folder / "config.yaml").read_text())
                assert config["clients"]["lr"] == pytest.approx(best)  # the tuned winner
                failure_rate = config["faults"]["client_failure_rate"]
                assert failure_rate == (0.3 if scenario == "noisy" else 0)
                finals.append(json.loads((folder / "summary.json").read_text())["final"])
            assert entry["metrics"]["accuracy"]["per_seed"] == [f["accuracy"] for f in finals]
            reference = report["methods"]["fedavg"]["scenarios"][scenario]["metrics"]
            ratios = [
                f["accuracy"] / r
                for f, r in zip(finals, reference["accuracy"]["per_seed"], strict=True)
            ]
            assert entry["ratio"]["per_seed"] == pytest.approx(ratios)
    table = (out / "comparison.md").read_text()
    assert "Scenario clean" in table and "Scenario noisy" in table
    with Image.open(out / "comparison.png") as image:
        image.verify()
        assert image.size[1] > image.size[0] / 2  # a row of panels per scenario
