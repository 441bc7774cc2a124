"""GPU requests without GPUs fall back to the CPU with one clear notice (never a hang), the
fallback gives exactly the CPU result, and FedAvg's mixed-precision option trains under
bfloat16 autocast (deterministic, still learns)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raysim.assembly import run
from raysim.models import devices

ROUNDS = 2
SMALL = (f"run.rounds={ROUNDS}", "partition.num_clients=20", "clients.per_round=4")


@pytest.fixture(autouse=True)
def _fresh_notices():
    devices._NOTICES.clear()
    yield
    devices._NOTICES.clear()


def test_task_gpus_fall_back_to_zero_with_a_notice_only_without_gpus(capsys):
    assert devices.task_num_gpus(0.25, cluster_gpus=1.0) == 0.25
    assert devices.task_num_gpus(0.0, cluster_gpus=0.0) == 0.0
    assert capsys.readouterr().err == ""
    assert devices.task_num_gpus(0.25, cluster_gpus=0.0) == 0.0
    assert devices.task_num_gpus(0.25, cluster_gpus=0.0) == 0.0  # the notice comes once
    err = capsys.readouterr().err
    assert err.count("raysim: notice:") == 1
    assert "clients.num_gpus=0.25 but the Ray cluster has no GPUs" in err


def test_client_device_is_the_gpu_only_when_requested_and_visible(
    digits_config, monkeypatch, capsys
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ctx = _ctx(digits_config("clients.num_gpus=0.25"))
    assert devices.client_device(ctx) == torch.device("cuda")
    assert devices.client_device(_ctx(digits_config())) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.client_device(ctx) == torch.device("cpu")
    assert "no GPU is visible here" in capsys.readouterr().err


def _ctx(config):
    from raysim.core.algorithm import RunContext

    return RunContext(config, (64,), 10)


def _params(result) -> np.ndarray:
    return result.state.arrays["params"]


@pytest.fixture(scope="module")
def cpu_reference(digits_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu")
    return run(digits_config(*SMALL), out, progress=False, tensorboard=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a GPU-less host")
def test_gpu_request_on_a_cpu_host_gives_the_cpu_result_locally(
    digits_config, cpu_reference, tmp_path, capsys
):
    result = run(
        digits_config(*SMALL, "clients.num_gpus=0.25"), tmp_path, progress=False, tensorboard=False
    )
    assert _params(result).tobytes() == _params(cpu_reference).tobytes()
    assert "clients train on the CPU" in capsys.readouterr().err


# The same fallback on a Ray cluster (where a GPU request would otherwise stay pending
# forever) is held by tests/test_cluster.py.


def test_mixed_precision_trains_deterministically_and_differs_from_float32(
    digits_config, cpu_reference, tmp_path
):
    config = digits_config(*SMALL, "algorithm.mixed_precision=true")
    first = run(config, tmp_path / "a", progress=False, tensorboard=False)
    second = run(config, tmp_path / "b", progress=False, tensorboard=False)
    assert _params(first).dtype == np.float32  # weights and deltas stay float32
    assert _params(first).tobytes() == _params(second).tobytes()
    assert _params(first).tobytes() != _params(cpu_reference).tobytes()  # autocast was on
    assert first.summary["final"]["accuracy"] > 0.5  # 10 classes: chance is 0.1
