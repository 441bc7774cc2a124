"""The prepared GPU check cannot rot: `--small` runs every part of it on the CPU."""

from __future__ import annotations

import importlib.util
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
    assert "clients.batched (" in out, out  # (a)'s batched row, with its packing
    assert "(f) FedAwS flagship (examples/fedaws_amazon670k.py --scale 0.002)" in out, out
    assert "| phase | round 1 s | round 2 s | round 3 s |" in out, out
    # the plan, then one budget line per part, in the order they run
    assert "gpu_check: parts d b a e c f, budgets on an H200" in out, out
    done = [line.split()[1] for line in out.splitlines() if " done in " in line]
    assert done == ["(d)", "(b)", "(a)", "(e)", "(c)", "(f)"], out
    report = json.loads(report_path.read_text())
    assert report["accelerator"] == "cpu" and report["small"] is True
    assert set(report["part_s"]) == set("abcdef") and report["skipped"] == []
    # every part measured something real
    lenet = report["fedavg_lenet"]
    assert lenet["cpu_rounds_per_s"] > 0 and lenet["accelerator_batched_rounds_per_s"] > 0
    assert lenet["batched_over_one_at_a_time"] > 0
    frl = report["frl_conv8"]
    assert frl["accelerator_client_s"] > 0 and frl["cpu_s_per_client"] > 0
    assert report["index"]["neighbour_agreement"] == 1.0  # the same device: identical results
    phases = report["fedaws"]["phases_s"]
    assert phases["clients_s"] > 0 and phases["index_s"] > 0 and phases["spreadout_s"] > 0
    assert report["fedaws"]["p@1"] is not None
    flagship = report["fedaws_flagship"]
    assert flagship["rounds"] == 3 and flagship["batched"] is True
    for phase in ("clients_s", "aggregate_s", "index_s", "spreadout_s", "evaluate_s"):
        assert len(flagship["phases_s"][phase]) == 3, flagship["phases_s"]
    assert min(flagship["phases_s"]["clients_s"]) > 0 and flagship["p@1"] is not None
    assert flagship["server_peak_rss_gib"] > 0 and flagship["peak_gpu_memory_gib"] is None
    methods = {row["method"] for row in report["batched"]["rows"]}
    assert methods == {"fedavg", "fedaws", "frl"}
    assert all(row["batched_clients_per_s"] > 0 for row in report["batched"]["rows"])
    assert "| fedaws | 10 |" in out
    # the vmapped bag pooling: the gather's operations do not grow with the chunk, the
    # per-client fallback's do; the two gradients agree to rounding
    pooling = report["batched"]["bag_pooling"]
    assert [row["clients"] for row in pooling] == [2, 8]
    assert pooling[0]["gather_ops"] == pooling[1]["gather_ops"]
    assert pooling[1]["embedding_bag_ops"] > pooling[0]["embedding_bag_ops"] + 6 * 50
    assert all(row["max_abs_gradient_difference"] < 1e-5 for row in pooling)
    assert "bag pooling under vmap on cpu" in out


def test_a_part_whose_budget_does_not_fit_is_skipped_with_a_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    report_path = tmp_path / "gpu_check.json"
    argv = ["--small", "--parts", "d", "--budget-s", "1", "--json", str(report_path)]
    assert gpu_check.main(argv) == 0
    out = capsys.readouterr().out
    assert "gpu_check: (d) index skipped: its budget 45 s does not fit" in out, out
    report = json.loads(report_path.read_text())
    assert report["skipped"] == ["d"] and "index" not in report and report["budget_s"] == 1
