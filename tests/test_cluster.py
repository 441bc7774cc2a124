"""A two-node Ray cluster on this machine (`ray start --head`, then a second `ray start
--address`, 1 CPU each, own temp dirs and ports): `raysim run --address auto` places client
tasks on both nodes, falls back to the CPU when clients ask for GPUs the cluster lacks, gives
exactly the local backend's result, exports the Ray custom metrics, and the teardown leaves no
process of either node behind (and touches no other Ray)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from raysim import config as config_module
from raysim.assembly import run

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.ray

ROUNDS = 3


def _cluster_script():
    path = REPO_ROOT / "scripts" / "two_node_cluster.py"
    spec = importlib.util.spec_from_file_location("two_node_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not installed")
def test_two_node_cluster_runs_clients_on_both_nodes(
    digits_config, digits_config_path, tmp_path, monkeypatch
):
    cluster_script = _cluster_script()
    with cluster_script.two_node_cluster(dashboard=True) as cluster:
        root = cluster.root
        # clients ask for a quarter GPU each: with no GPU in the cluster they must fall back
        # to the CPU (with a notice) instead of waiting forever for one
        summary, output = cluster_script.run_on_cluster(
            cluster,
            str(digits_config_path),
            root / "run",
            ROUNDS,
            # 200 epochs (~0.3 s a task): tasks overlap, so Ray spreads them over both nodes
            extra=["--set", "clients.num_gpus=0.25", "--set", "clients.local_epochs=200"],
        )
        metrics = _wait_for_metrics(cluster_script, cluster.metrics_ports)
        # a researcher's own plug-ins (examples/plugins copied outside the repo), run from
        # their folder: their modules must reach the other node's workers. No --address:
        # the driver joins through RAY_ADDRESS alone, as under `ray job submit` (a cluster
        # raysim did not start gets none of raysim's _system_config)
        plugins = tmp_path / "my_plugins"
        shutil.copytree(REPO_ROOT / "examples" / "plugins", plugins)
        plugin_summary, plugin_output = cluster_script.run_on_cluster(
            cluster,
            "everything.yaml",
            root / "plugins",
            ROUNDS,
            # tasks every round (automatic packing may train small rounds in the server actor),
            # long enough to overlap so that Ray spreads them over both nodes
            extra=["--set", "clients.per_task=5", "--set", "clients.local_epochs=200"],
            cwd=plugins,
            address=None,
        )
        # the same through `ray job submit --working-dir` (the job's own runtime env)
        job_output = cluster_script.submit_job(
            cluster,
            plugins,
            # this interpreter (a cluster node would run plain `python`): the job's driver
            # must match the cluster's Python
            [sys.executable, "-m", "raysim.cli", "run", "everything.yaml",
             "--out", str(root / "job"),
             "--set", f"run.rounds={ROUNDS}", "--set", "clients.per_task=5",
             "--set", "clients.local_epochs=200"],
        )  # fmt: skip
        job_summary = json.loads((root / "job" / "summary.json").read_text())
        assert cluster_script.leftover_processes(str(root))  # sanity: the marker finds them
    # teardown: nothing of either node is left, and its files are gone
    assert cluster_script.leftover_processes(str(root)) == []
    assert not root.exists()

    assert "2 node(s)" in output
    assert "clients.num_gpus=0.25 but the Ray cluster has no GPUs" in output
    tasks = summary["task_nodes"]
    assert len(tasks) == 2, tasks  # two distinct node ids: one raylet each
    assert all(count >= 1 for count in tasks.values())
    assert sum(tasks.values()) == 2 * ROUNDS  # clients.per_task=5: 2 tasks a round

    # the same config on the local backend, on the CPU: the same model, so the same accuracy
    local = run(
        digits_config(f"run.rounds={ROUNDS}", "clients.per_task=5", "clients.local_epochs=200"),
        tmp_path / "local",
        progress=False,
        tensorboard=False,
    )
    assert summary["final"]["accuracy"] == local.summary["final"]["accuracy"]
    assert summary["final"]["train_loss"] == local.summary["final"]["train_loss"]

    assert "sending plug-in code to the workers" in plugin_output
    assert len(plugin_summary["task_nodes"]) == 2, plugin_summary["task_nodes"]
    monkeypatch.chdir(plugins)  # the plug-ins import from the folder raysim runs in
    plugin_local = run(
        config_module.load(
            plugins / "everything.yaml",
            [f"run.rounds={ROUNDS}", "clients.per_task=5", "clients.local_epochs=200"],
        ),
        tmp_path / "plugins_local",
        progress=False,
        tensorboard=False,
    )
    assert plugin_summary["final"] == plugin_local.summary["final"]  # bit for bit
    assert "succeeded" in job_output and "2 node(s)" in job_output
    assert job_summary["final"] == plugin_local.summary["final"]
    # the job's log (no terminal: progress as plain lines, no carriage returns)
    assert "\r" not in job_output and re.search(rf"round +\d+/{ROUNDS}", job_output)

    # Ray custom metrics from the server actor, exported by its node's metrics agent
    assert _metric(metrics, "rounds_total") == ROUNDS
    assert _metric(metrics, "client_updates_total") == 10 * ROUNDS
    assert _metric(metrics, "bytes_up_total") == summary["bytes_up"]


def _metric(page: str, name: str) -> float | None:
    found = re.search(rf'^ray_raysim_{name}{{[^}}]*run="fedavg_digits"[^}}]*}} (\S+)$', page, re.M)
    return float(found.group(1)) if found else None


def _wait_for_metrics(cluster_script, ports: list[int], timeout: float = 15) -> str:
    """The nodes' metrics pages once the last round is exported (every second here)."""
    deadline = time.monotonic() + timeout
    while True:
        page = "".join(cluster_script.scrape_metrics(port) for port in ports)
        if _metric(page, "rounds_total") == ROUNDS or time.monotonic() > deadline:
            return page
        time.sleep(0.5)
