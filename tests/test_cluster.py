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

import numpy as np
import pytest
from conftest import raysim_cli

from raysim import config as config_module
from raysim.assembly import run

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.ray

ROUNDS = 2
# local epochs of every run here (~0.6 s a task): tasks overlap, so Ray spreads them over both
# nodes (200 let the head finish each task before Ray spilled the next, once, on a loaded
# machine); the same in every run, whose final metrics are compared bit for bit
EPOCHS = 400


def _cluster_script():
    path = REPO_ROOT / "scripts" / "two_node_cluster.py"
    spec = importlib.util.spec_from_file_location("two_node_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("ray") is None, reason="the ray CLI is not installed")
def test_two_node_cluster_runs_clients_on_both_nodes(tmp_path, monkeypatch):
    cluster_script = _cluster_script()
    with cluster_script.two_node_cluster(dashboard=True) as cluster:
        root = cluster.root
        # a researcher's own plug-ins (examples/plugins copied outside the repo), run from
        # their folder: their modules must reach the other node's workers ...
        plugins = tmp_path / "my_plugins"
        shutil.copytree(REPO_ROOT / "examples" / "plugins", plugins)
        # ... reading their data from a relative data.root (data/points.npz in their folder):
        # it must mean that folder on every node, whatever a node's working directory
        _write_points_plugin(plugins)
        # through --address auto, the run folder in the plug-in folder, which the job below
        # uploads (without this run). Clients ask for a quarter GPU each: with no GPU in the
        # cluster they must fall back to the CPU (with a notice) instead of waiting forever.
        summary, output = cluster_script.run_on_cluster(
            cluster,
            "everything.yaml",
            plugins / "runs" / "auto",
            ROUNDS,
            # EPOCHS: tasks overlap, so Ray spreads them over both nodes
            extra=[
                *POINTS,
                "--set",
                "clients.num_gpus=0.25",
                "--set",
                f"clients.local_epochs={EPOCHS}",
            ],
            cwd=plugins,
        )
        metrics = _wait_for_metrics(cluster_script, cluster.metrics_ports)
        refusals = _refusals(cluster_script, cluster, plugins, root)
        # No --address: the driver joins through RAY_ADDRESS alone, as under `ray job submit`
        # (a cluster raysim did not start gets none of raysim's _system_config)
        plugin_summary, plugin_output = cluster_script.run_on_cluster(
            cluster,
            "everything.yaml",
            root / "plugins",
            ROUNDS,
            # tasks every round (automatic packing may train small rounds in the server actor):
            # 3 tasks of 2 clients a round under Ray's SPREAD scheduling, so both nodes train
            # (Ray's default could queue them all on the head's CPU: seen twice on a loaded
            # machine, with 2 tasks a round and with 3)
            extra=[
                *POINTS,
                "--set",
                "runtime.spread_tasks=true",
                "--set",
                "clients.per_task=2",
                "--set",
                f"clients.local_epochs={EPOCHS}",
            ],
            cwd=plugins,
            address=None,
        )
        # the same through `ray job submit --working-dir` (the job's own runtime env)
        job_output = cluster_script.submit_job(
            cluster,
            plugins,
            # this interpreter (a cluster node would run plain `python`): the job's driver
            # must match the cluster's Python
            [sys.executable, "-m", "raysim.cli", "run", "everything.yaml", *POINTS,
             "--out", str(root / "job"),
             "--set", f"run.rounds={ROUNDS}", "--set", "clients.per_task=5",
             "--set", f"clients.local_epochs={EPOCHS}"],
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
    assert sum(tasks.values()) == 2 * ROUNDS  # 6 clients, clients.per_task=5: 2 tasks a round

    # authentication on: a driver without the cluster's token, or with another one, is refused
    # in one line naming what is missing, at once (ray.init alone retries for 20 s, then a
    # 40-line traceback); an address nothing listens on has its own line
    for case, (code, stderr, seconds) in refusals.items():
        assert code == 2, (case, stderr)
        assert "Traceback" not in stderr, (case, stderr)
        assert seconds < 20, (case, seconds)
    assert (
        "requires token authentication and RAY_AUTH_MODE is 'disabled' here: set "
        "RAY_AUTH_MODE=token" in refusals["mode disabled"][1]
    )
    assert (
        "refused the token in RAY_AUTH_TOKEN (not the cluster's token)"
        in refusals["wrong token"][1]
    )
    assert "cannot reach a Ray cluster at" in refusals["unreachable"][1]

    # where clients trained: every node by address, the head marked
    placement = plugin_summary["placement"]
    assert [node["head"] for node in placement["nodes"]] == [True, False], placement
    assert sum(n["client_tasks"] for n in placement["nodes"]) == sum(
        plugin_summary["task_nodes"].values()
    )
    assert re.search(r"client tasks per node: \S+ \(head\) \d+, \S+ \d+;", plugin_output)

    assert summary["dataset"] == "points"  # the relative data.root, with --address auto
    assert (plugins / "runs" / "auto" / ".rayignore").is_file()
    # ... kept out of the job's upload by it (Ray's log of the upload says so)
    assert str(plugins / "runs" / "auto" / ".rayignore") in job_output

    assert "sending plug-in code to the workers" in plugin_output
    assert len(plugin_summary["task_nodes"]) == 2, plugin_summary["task_nodes"]
    monkeypatch.chdir(plugins)  # the plug-ins import from the folder raysim runs in
    plugin_local = run(
        config_module.load(
            plugins / "everything.yaml",
            [
                *POINTS[1::2],
                f"run.rounds={ROUNDS}",
                "clients.per_task=5",
                f"clients.local_epochs={EPOCHS}",
            ],
        ),
        tmp_path / "plugins_local",
        progress=False,
        tensorboard=False,
    )
    assert plugin_summary["final"] == plugin_local.summary["final"]  # bit for bit
    # on the CPU, having asked for GPUs: the same model, so the same metrics
    assert summary["final"] == plugin_local.summary["final"]
    assert "succeeded" in job_output and "2 node(s)" in job_output
    assert job_summary["final"] == plugin_local.summary["final"]
    # the job's log (no terminal: progress as plain lines, no carriage returns)
    assert "\r" not in job_output and re.search(rf"round +\d+/{ROUNDS}", job_output)

    # Ray custom metrics from the server actor, exported by its node's metrics agent
    assert _metric(metrics, "rounds_total") == ROUNDS
    assert _metric(metrics, "client_updates_total") == 6 * ROUNDS  # 6 clients a round
    assert _metric(metrics, "bytes_up_total") == summary["bytes_up"]


# The plug-in folder's own dataset, read from a relative data.root
POINTS = ["--set", "data.name=points:load_points", "--set", "data.root=data"]

POINTS_PLUGIN = '''"""Points read from data.root/points.npz (a test's own dataset plug-in)."""

from pathlib import Path

import numpy as np

import raysim
from raysim import DataError
from raysim.data.datasets import Dataset


@raysim.plugin("dataset")
def load_points(root, seed):
    path = Path(root or ".") / "points.npz"
    if not path.is_file():
        raise DataError(f"{path}: no such file (cwd {Path.cwd()})")
    arrays = np.load(path)
    return Dataset(
        name="points",
        train_x=arrays["train_x"], train_y=arrays["train_y"],
        test_x=arrays["test_x"], test_y=arrays["test_y"], num_classes=4,
    )
'''


def _write_points_plugin(folder: Path) -> None:
    sys.path.insert(0, str(folder))
    try:
        from blobs import load_blobs
    finally:
        sys.path.remove(str(folder))
    data = load_blobs(None, 0, num_samples=600, num_classes=4)
    (folder / "data").mkdir()
    np.savez(
        folder / "data" / "points.npz",
        train_x=data.train_x, train_y=data.train_y, test_x=data.test_x, test_y=data.test_y,
    )  # fmt: skip
    (folder / "points.py").write_text(POINTS_PLUGIN)


def _refusals(cluster_script, cluster, cwd: Path, root: Path) -> dict:
    """Exit status, stderr and seconds of a driver refused by the cluster, per case."""
    nobody = f"127.0.0.1:{cluster_script.free_ports(1)[0]}"
    cases = {
        "mode disabled": dict(cluster.env(), RAY_AUTH_MODE="disabled"),
        "wrong token": dict(cluster.env(), RAY_AUTH_TOKEN="not-the-cluster-token"),
        "unreachable": dict(cluster.env(), RAY_ADDRESS=nobody),
    }
    found = {}
    for case, env in cases.items():
        started = time.monotonic()
        result = raysim_cli(
            ["run", "everything.yaml", "--no-progress",
             "--out", str(root / case.replace(" ", "_"))],
            cwd=cwd, env=env, timeout=120,
        )  # fmt: skip
        found[case] = (result.returncode, result.stderr, time.monotonic() - started)
    return found


def _metric(page: str, name: str) -> float | None:
    found = re.search(rf'^ray_raysim_{name}{{[^}}]*run="everything"[^}}]*}} (\S+)$', page, re.M)
    return float(found.group(1)) if found else None


def _wait_for_metrics(cluster_script, ports: list[int], timeout: float = 15) -> str:
    """The nodes' metrics pages once the last round is exported (every second here)."""
    deadline = time.monotonic() + timeout
    while True:
        page = "".join(cluster_script.scrape_metrics(port) for port in ports)
        if _metric(page, "rounds_total") == ROUNDS or time.monotonic() > deadline:
            return page
        time.sleep(0.5)
