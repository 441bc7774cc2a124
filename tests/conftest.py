"""Shared test helpers: the example config, the CLI in a subprocess, one Ray session."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from cli_forks import ForkedCli

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS_CONFIG = REPO_ROOT / "configs" / "fedavg_digits.yaml"


@pytest.fixture(scope="session")
def digits_config_path() -> Path:
    """configs/fedavg_digits.yaml: FedAvg, MLP 64-128-10, 100 Dirichlet(0.5) clients, 10 a round."""
    return DIGITS_CONFIG


@pytest.fixture(scope="session")
def digits_config() -> Callable[..., object]:
    """Load the digits example with `--set` style overrides; local backend unless overridden."""
    from raysim import config

    def load(*overrides: str, backend: str = "local"):
        return config.load(DIGITS_CONFIG, [f"runtime.backend={backend}", *overrides])

    return load


_FORKED_CLI = ForkedCli()  # one fork server for the session (tests/cli_forks.py)


def raysim_cli(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike = REPO_ROOT,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """`python -m raysim.cli ARGS` in a child process (forked from one that has imported
    raysim: tests/cli_forks.py), run in `cwd`; like subprocess.run(capture_output=True,
    text=True). `env` defaults to this process's environment."""
    return _FORKED_CLI.run(args, cwd=cwd, env=dict(os.environ if env is None else env),
                           timeout=timeout)  # fmt: skip


def _run_cli(args: Sequence[str], timeout: float = 300) -> subprocess.CompletedProcess:
    # RAY_ADDRESS="": a subprocess must start its own Ray, never join the test session's.
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    return raysim_cli(args, env=env, timeout=timeout)


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """Run `python -m raysim.cli ARGS...` in a subprocess; returns the CompletedProcess."""
    return _run_cli


def pytest_sessionfinish(session, exitstatus):
    _FORKED_CLI.close()


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray (2 CPUs) shared by the integration tests of this process (each pytest-xdist
    worker has its own); shut down at the end."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
        started = True
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _default_ctrl_c():
    """Every test starts with Python's own SIGINT handler. A library may leave SIGINT ignored
    in this process (which child processes would inherit, so a CLI run under test could not
    be stopped): the Ctrl-C tests need the default."""
    import signal

    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
