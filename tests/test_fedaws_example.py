"""The flagship example on real-format files: XC repository text in --data-dir."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from raysim.data.synthetic_xml import generate_synthetic_xml
from raysim.data.xc_data import write_xc_file

REPO_ROOT = Path(__file__).resolve().parents[1]


def _example():
    path = REPO_ROOT / "examples" / "fedaws_amazon670k.py"
    spec = importlib.util.spec_from_file_location("fedaws_amazon670k", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.ray
def test_example_runs_on_xc_files_and_writes_its_table(ray_session, tmp_path):
    train, test = generate_synthetic_xml(
        np.random.default_rng(0),
        num_labels=60,
        num_features=500,
        num_train=600,
        num_test=100,
        labels_per_point=3.0,
        zipf_exponent=0.6,
        num_clusters=None,
        features_per_point=20.0,
        signature_features=4,
        cluster_features=8,
        cross_cluster_probability=0.1,
    )
    data_dir = tmp_path / "xc"
    data_dir.mkdir()
    write_xc_file(data_dir / "train.txt", train)
    write_xc_file(data_dir / "test.txt", test)
    out = tmp_path / "out"
    status = _example().main(
        [
            "--data-dir",
            str(data_dir),
            "--rounds",
            "2",
            "--clients-per-round",
            "20",
            "--k",
            "5",
            "--methods",
            "fedaws",
            "baseline2",
            "--out",
            str(out),
        ]
    )
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    fedaws = results["C=60/FedAwS"]
    from raysim import config as config_module

    run_config = config_module.load(out / "C60_FedAwS" / "config.yaml")
    assert fedaws["visits_per_class"] == pytest.approx(2 * 20 / run_config.partition.num_clients)
    assert set(fedaws["final"]) >= {"p@1", "p@3", "p@5", "class_cosine_mean"}
    assert {"clients_s", "aggregate_s", "index_s", "spreadout_s"} <= set(fedaws["per_round_s"])
    assert "| C=60 | Baseline-2 |" in (out / "table.md").read_text()


def test_methods_take_keys_and_the_old_comma_form():
    """--methods takes space-separated keys; the old comma list of display names still parses
    to the same keys (kept for one release), and regimes sort by their number."""
    example = _example()
    new = example.parse_args(["--methods", "fedaws", "baseline2", "fedaws_ivf"]).methods
    assert new == ["fedaws", "baseline2", "fedaws_ivf"]
    assert example.parse_args(["--methods", "FedAwS,Baseline-2,FedAwS IVF"]).methods == new
    assert example.parse_args(["--methods=FedAwS,Baseline-2", "fedaws_ivf"]).methods == new
    with pytest.raises(SystemExit):
        example.parse_args(["--methods", "fedawz"])
    assert sorted(["C/d=32", "C/d=8"], key=example.regime_order) == ["C/d=8", "C/d=32"]
