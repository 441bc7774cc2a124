"""A Ray that raysim starts on one machine listens on loopback only, and Ray's token file
readable by others is said in one line. Before, the Prometheus endpoints of a local run
answered anyone on 0.0.0.0 (run name, losses, the host's process list) and the gRPC servers
listened on every interface: Ray maps `_node_ip_address="127.0.0.1"` back to the routable
address, and only its local-only switch (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) keeps the node's
address on loopback. (`ss -ltnp` during a default run: every listener on 127.0.0.1; README.)"""

from __future__ import annotations

import os

import pytest

from raysim import config as config_module
from raysim.runtime import ray_cluster

ray = pytest.importorskip("ray")


def test_a_ray_raysim_starts_gets_a_loopback_node_address(monkeypatch):
    from ray._private import ray_constants, services

    if ray.is_initialized():
        pytest.skip("a Ray of this process already has its node address")
    monkeypatch.delenv(ray_cluster.LOCAL_ONLY_ENV, raising=False)
    runtime = config_module.from_dict({"data": {"name": "digits"}}).runtime
    before = ray_constants.ENABLE_RAY_CLUSTER
    try:
        assert ray_cluster.loopback_only(runtime)
        assert os.environ[ray_cluster.LOCAL_ONLY_ENV] == "0"  # Ray's processes read it
        assert services.get_node_ip_address() == "127.0.0.1"
        assert services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    finally:
        ray_cluster.end_loopback_only()
    assert ray_constants.ENABLE_RAY_CLUSTER == before
    assert ray_cluster.LOCAL_ONLY_ENV not in os.environ
    # asked for otherwise: left alone
    public = config_module.from_dict(
        {"data": {"name": "digits"}, "runtime": {"dashboard_host": "0.0.0.0"}}
    ).runtime
    assert not ray_cluster.loopback_only(public)
    monkeypatch.setenv(ray_cluster.LOCAL_ONLY_ENV, "1")
    assert not ray_cluster.loopback_only(runtime)


def test_a_token_file_readable_by_others_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("secret")
    token.chmod(0o644)
    ray_cluster.check_token_file()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert str(token) in line and "644" in line and "chmod 600" in line
    token.chmod(0o600)
    ray_cluster.check_token_file()
    assert capsys.readouterr().err == ""
