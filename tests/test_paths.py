"""Relative paths of a config mean the same everywhere (raysim.config.paths): made absolute
against the directory raysim runs from when the config is loaded, kept relative inside a Ray
job's working directory (every node of the job has its own copy of it); a relative --out under
`ray job submit` goes to ~/raysim-runs, never into Ray's temporary copy; a run folder carries
a .rayignore so job uploads skip it. (On a two-node cluster: tests/test_cluster.py.)"""

from __future__ import annotations

from pathlib import Path

from raysim.config import paths
from raysim.outputs.run_folder import lock_out_dir


def test_relative_paths_resolve_against_the_working_directory(digits_config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = digits_config("data.root=data/digits", "partition.cache_dir=cache")
    assert config.data.root == str(tmp_path / "data" / "digits")
    assert config.partition.cache_dir == str(tmp_path / "cache")
    # absolute and unset paths are left as they are
    config = digits_config("data.root=/srv/data")
    assert config.data.root == "/srv/data" and config.partition.cache_dir is None


def test_relative_paths_stay_relative_in_a_job_working_dir(digits_config, tmp_path, monkeypatch):
    job_dir = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    job_dir.mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    assert paths.in_job_working_dir()
    assert digits_config("data.root=data").data.root == "data"


def test_a_relative_out_under_a_job_goes_home(tmp_path, monkeypatch, capsys):
    job_dir = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    job_dir.mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.job_out_dir("runs/a") == "runs/a"  # not a job: as given
    monkeypatch.chdir(job_dir)
    assert paths.job_out_dir("runs/a") == str(tmp_path / "home" / "raysim-runs" / "runs" / "a")
    assert "outputs go to" in capsys.readouterr().err
    assert paths.job_out_dir("/abs/out") == "/abs/out"


def test_a_run_folder_is_kept_out_of_job_uploads(tmp_path):
    lock = lock_out_dir(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text("")  # a run that wrote (an empty one's
    lock.release()  # folder is removed with its marker: test_out_dir_lock)
    ignore = tmp_path / "run" / ".rayignore"
    assert ignore.read_text().splitlines()[-1] == "*"
    # Ray's own upload walk skips the folder (and keeps the rest)
    from ray._private.runtime_env.packaging import _dir_travel

    (tmp_path / "keep.py").write_text("")
    seen: list[Path] = []
    _dir_travel(tmp_path, [], seen.append, include_gitignore=True)
    assert tmp_path / "keep.py" in seen and not any("run" in p.parts for p in seen)
