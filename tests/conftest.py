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


@pytest.fixture(autouse=True)
def _seed_global_generators():
    """Every test starts from the same global torch / numpy / random state, whichever tests
    its worker ran before it (pytest-xdist hands files out in no fixed order), so a test that
    draws without a seed of its own draws the same numbers in every run. RAYSIM_TEST_SEED
    picks another state: running the suite under a few of them finds a test whose check holds
    only for lucky draws."""
    import random

    import numpy as np
    import torch

    seed = int(os.environ.get("RAYSIM_TEST_SEED", "0"))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
    from raysim.runtime.ray_cluster import LOCAL_RAY_SYSTEM_CONFIG

    started = False
    if not ray.is_initialized():
        # the settings of a Ray that raysim starts itself (idle workers kept between rounds)
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            logging_level="ERROR",
            _system_config=LOCAL_RAY_SYSTEM_CONFIG,
        )
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


# The longest test files first (longest-processing-time-first, the classic rule for finishing
# parallel work together). pytest-xdist's `--dist loadfile` hands whole files to its two
# workers in queue order and by default queues the files with the most tests first, so one-test
# files as long as the two-node cluster's, the scaffold example's and the Tune resume's ran last
# while the other worker had nothing left. Only the order changes: every file still runs whole
# in one worker, its tests in their written order; a file not listed keeps its place after
# these. Rough CPU seconds of a serial run (2 cores, Dec 2026) in the comments.
LONGEST_FILES_FIRST = (
    "test_plugins.py",  # ~150
    "test_faults.py",  # ~140
    "test_cluster.py",  # ~100
    "test_first_hour.py",  # ~70
    "test_compare.py",  # ~60
    "test_deadlines.py",  # ~55
    "test_hostile_corpus.py",  # ~50
    "test_scaffold_example.py",  # ~45
    "test_tune_resume.py",  # ~45
    "test_ray_integration.py",  # ~45
    "test_resume.py",  # ~40
    "test_tune.py",  # ~35
    "test_device_paths.py",  # ~35
    "test_cli_forks.py",  # ~30
    "test_gpu_check.py",  # ~25
    "test_async_time.py",  # ~25
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's reorder by test count
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: position for position, name in enumerate(LONGEST_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-file order kept
