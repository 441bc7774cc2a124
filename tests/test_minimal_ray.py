"""Ray installed without its dashboard packages (`pip install ray`, no `[default]`): a Ray that
raysim starts runs without the dashboard after one line, instead of Ray's
`Exception: Cannot include dashboard with missing packages` and its 20-line traceback."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.config import RuntimeConfig
from raysim.errors import RaysimError
from raysim.runtime import ray_cluster

REPO_ROOT = Path(__file__).resolve().parents[1]
NOTICE = "raysim: notice: Ray's dashboard packages are missing"
FIX = 'pip install "ray[default]"'


def _notice_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "dashboard" in line.lower()]


def test_missing_dashboard_packages_turn_the_dashboard_off_with_one_line(monkeypatch, capsys):
    # Ray's own check is an import of ray.dashboard.optional_deps: make it fail
    monkeypatch.setitem(sys.modules, "ray.dashboard.optional_deps", None)
    assert ray_cluster.dashboard_dependency_error() is not None
    assert ray_cluster.include_dashboard(RuntimeConfig()) is False
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith(NOTICE) and FIX in err, err
    # asked for no dashboard: nothing to say
    assert ray_cluster.include_dashboard(RuntimeConfig(dashboard=False)) is False
    assert capsys.readouterr().err == ""


def test_installed_dashboard_packages_keep_the_dashboard(capsys):
    if importlib.util.find_spec("aiohttp_cors") is None:
        pytest.skip("this environment has a minimal Ray")
    assert ray_cluster.dashboard_dependency_error() is None
    assert ray_cluster.include_dashboard(RuntimeConfig()) is True
    assert ray_cluster.include_dashboard(RuntimeConfig(dashboard=False)) is False
    assert capsys.readouterr().err == ""


def test_rays_own_refusal_becomes_one_line(monkeypatch):
    """A Ray whose check differs from the one include_dashboard reuses: its exception becomes
    one line naming both ways out."""

    def refuse(**kwargs):
        raise Exception("Cannot include dashboard with missing packages.")

    monkeypatch.setattr(ray_cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_cluster.ray, "init", refuse)
    monkeypatch.setattr(ray_cluster.ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_cluster, "include_dashboard", lambda runtime: True)
    monkeypatch.setattr(ray_cluster, "loopback_only", lambda runtime: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(RaysimError) as raised:
        ray_cluster.connect(RuntimeConfig())
    message = str(raised.value)
    assert "\n" not in message and FIX in message and "runtime.dashboard" in message


# A minimal Ray's environment for every process of the run (the driver, the raylet's agents,
# the workers): the site-packages copies of the modules Ray's dashboard check imports
# (ray.dashboard.optional_deps) are not found; pydantic stays (other packages use it), and so
# does the aiohttp that Ray vendors for its runtime-env agent (not in site-packages).
HIDDEN = ("aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry", "prometheus_client")
HOOK = """
import importlib.machinery, os, sys

HIDDEN = {hidden!r}


class HideDashboardPackages:
    def find_spec(self, name, path=None, target=None):
        if path is not None or name not in HIDDEN:
            return None
        entries = [p for p in sys.path if os.path.abspath(p or os.getcwd()) not in HIDDEN[name]]
        spec = importlib.machinery.PathFinder.find_spec(name, entries)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return spec


sys.meta_path.insert(0, HideDashboardPackages())
"""


def _where_installed(name: str) -> set[str]:
    """The sys.path entries that `name` is imported from here."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return set()
    places = list(spec.submodule_search_locations or []) or [spec.origin]
    return {os.path.dirname(os.path.abspath(place)) for place in places}


@pytest.mark.ray
def test_a_ray_run_without_dashboard_packages_completes_after_one_line(tmp_path):
    hidden = {name: _where_installed(name) for name in HIDDEN}
    hidden = {name: places for name, places in hidden.items() if places}
    hook_dir = tmp_path / "hook"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(HOOK.format(hidden=hidden))
    python_path = os.pathsep.join(filter(None, [str(hook_dir), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    check = "import ray._private.utils as u; print(u.get_dashboard_dependency_error())"
    probe = subprocess.run(
        [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60
    )
    assert "No module named" in probe.stdout, probe.stdout + probe.stderr  # Ray's check fails
    out = tmp_path / "run"
    command = [sys.executable, "-m", "raysim.cli", "run", "configs/fedavg_digits.yaml",
               "--out", str(out), "--set", "run.rounds=1", "--set", "runtime.backend=ray",
               "--set", "runtime.num_cpus=1"]  # fmt: skip
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done: 1 rounds" in result.stdout, result.stdout
    assert "Ray dashboard:" not in result.stdout, result.stdout
    lines = _notice_lines(result.stdout + result.stderr)
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(NOTICE) and FIX in lines[0], lines
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (out / "metrics.jsonl").is_file()
