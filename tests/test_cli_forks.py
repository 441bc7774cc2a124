"""The suite's CLI runner (tests/cli_forks.py: children forked from a process that imported
raysim once) behaves as `python -m raysim.cli` run as a fresh process: same exit codes, same
stdout and stderr, its own working directory and environment."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO_ROOT, raysim_cli


def _fresh(args, cwd, env):
    return subprocess.run(
        [sys.executable, "-m", "raysim.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_forked_cli_prints_and_exits_as_a_fresh_process(tmp_path):
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    (tmp_path / "broken.yaml").write_text("run: {rounds: -1}\ndata: {name: digits}\n")
    cases = [
        (["--version"], REPO_ROOT),
        (["run", "broken.yaml", "--out", str(tmp_path / "out")], tmp_path),  # a relative path
        (["frobnicate"], REPO_ROOT),  # argparse's usage error names the program as -m does
    ]
    for args, cwd in cases:
        forked, fresh = raysim_cli(args, cwd=cwd, env=env), _fresh(args, cwd, env)
        assert (forked.returncode, forked.stdout, forked.stderr) == (
            fresh.returncode, fresh.stdout, fresh.stderr
        ), args  # fmt: skip
    assert {raysim_cli(["--version"], env=env).returncode for _ in range(3)} == {0}


def test_a_forked_cli_sees_its_own_environment(tmp_path):
    """A variable set for one call reaches that child only; a start-up variable the child
    could not honour (PYTHONPATH) makes the call a plain subprocess, which does."""
    (tmp_path / "probe_dataset.py").write_text("import os\nVALUE = os.environ['PROBE']\n")
    env = dict(os.environ, RAY_ADDRESS="", PROBE="one")
    config = tmp_path / "c.yaml"
    config.write_text("data: {name: 'probe_dataset:VALUE'}\n")
    # the plug-in's import reads PROBE: with it set, the import succeeds (and the str it
    # names is refused); without it, the import fails on the missing variable
    result = raysim_cli(["run", str(config), "--out", str(tmp_path / "o")], cwd=tmp_path, env=env)
    assert "'probe_dataset:VALUE' is a str" in result.stderr, result.stderr
    missing = raysim_cli(
        ["run", str(config), "--out", str(tmp_path / "p")],
        cwd=tmp_path,
        env={k: v for k, v in env.items() if k != "PROBE"},
    )
    assert "importing 'probe_dataset' failed: KeyError: 'PROBE'" in missing.stderr, missing.stderr
    path_env = dict(env, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))
    via_path = raysim_cli(["--version"], env=path_env)
    assert via_path.returncode == 0 and via_path.stdout.startswith("raysim ")


def test_a_driver_that_ran_ray_init_still_forks():
    """ray.init sets PYTHONBREAKPOINT in the test process's environment; a CLI call made after
    it is still forked (a plain subprocess costs ~3 s of imports), while a start-up variable
    that the child could not honour still is not."""
    from cli_forks import ForkedCli

    forks = ForkedCli()
    try:
        assert forks._forkable(dict(os.environ, PYTHONBREAKPOINT="ray.util.rpdb._driver_set_trace"))
        assert not forks._forkable(dict(os.environ, PYTHONHASHSEED="7"))
    finally:
        forks.close()
