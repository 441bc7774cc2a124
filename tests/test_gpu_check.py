"""The prepared GPU check cannot rot: `--small` runs every part of it on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_gpu_check_small_prints_its_table_and_writes_json(tmp_path):
    report_path = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--repeats", "1", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for row in ("(a) FedAvg/LeNet", "(b) FRL conv2", "(d) exact index", "(c) FedAwS", "index_s"):
        assert row in out, out
    report = json.loads(report_path.read_text())
    assert report["accelerator"] == "cpu" and report["small"] is True
    # every part measured something real
    assert report["fedavg_lenet"]["cpu_rounds_per_s"] > 0
    assert report["frl_conv8"]["accelerator_client_s"] > 0
    assert report["index"]["neighbour_agreement"] == 1.0  # the same device: identical results
    phases = report["fedaws"]["phases_s"]
    assert phases["clients_s"] > 0 and phases["index_s"] > 0 and phases["spreadout_s"] > 0
    assert report["fedaws"]["p@1"] is not None
    methods = {row["method"] for row in report["batched"]["rows"]}
    assert methods == {"fedavg", "fedaws", "frl"}
    assert all(row["batched_clients_per_s"] > 0 for row in report["batched"]["rows"])
    assert "| fedaws | 10 |" in out
