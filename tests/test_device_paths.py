"""Every method's client and server code goes through the device path (`client_device` /
`server_device` in raysim.models.devices), so the same functions train and evaluate on a GPU
when one is reserved. On this GPU-less host, asking for GPUs must take that path, fall back to
the CPU with a notice, and give exactly the CPU result (every method, local backend); on the
Ray backend one method per module that asks for a device (RAY_METHODS) runs with
`clients.num_gpus: 0.25` and `server.num_gpus: 0.5` on a cluster without GPUs."""

from __future__ import annotations

import pytest
import torch

from raysim import config
from raysim.assembly import run
from raysim.models import devices

# One small run per method: (shipped config, overrides that make it a few seconds).
SMALL_XML = (
    "data.num_labels=64",
    "data.num_features=256",
    "data.num_train=1024",
    "data.num_test=128",
    "partition.num_clients=64",
    "clients.per_round=8",
)
METHODS = {
    "fedavg": ("fedavg_digits.yaml", ("partition.num_clients=20", "clients.per_round=4")),
    "fedprox": (
        "fedavg_digits.yaml",
        ("partition.num_clients=20", "clients.per_round=4", "algorithm={name: fedprox, mu: 0.1}"),
    ),
    "signsgd": ("signsgd_digits.yaml", ("partition.num_clients=20", "clients.per_round=4")),
    "topk": ("topk_digits.yaml", ("partition.num_clients=20", "clients.per_round=4")),
    "frl": (
        "frl_digits.yaml",
        ("partition.num_clients=20", "clients.per_round=4", "model.hidden=[32]"),
    ),
    "flag": ("flag_flag.yaml", ("clients.per_round=3",)),
    "personal_bn": ("flag_personal_bn.yaml", ("clients.per_round=3",)),
    "local_only": ("flag_local_only.yaml", ("clients.per_round=3",)),
    "per_fedavg": ("flag_per_fedavg.yaml", ("clients.per_round=3",)),
    "fedaws": ("fedaws_synthetic_xml.yaml", (*SMALL_XML, "algorithm.k=5")),
    "fedaws_softmax": ("fedaws_softmax_synthetic_xml.yaml", SMALL_XML),
}
GPU_REQUEST = ("clients.num_gpus=0.25", "server.num_gpus=0.5")
# One method per module that asks for a device (fedavg, frl, flag, personalized, and fedaws
# with class_embedding) for the Ray test: FedProx, signSGD and top-k take FedAvg's device
# calls, local_only and per_fedavg personal_bn's, FedAwS-softmax FedAwS's class_embedding; the
# local test runs each of them.
RAY_METHODS = ("fedavg", "frl", "flag", "personal_bn", "fedaws")


def _config(repo_root, method: str, *extra: str, backend: str = "local"):
    path, overrides = METHODS[method]
    return config.load(
        repo_root / "configs" / path,
        [
            *overrides,
            "run.rounds=2",
            "run.eval_every=1",
            "run.checkpoint_every=0",
            f"runtime.backend={backend}",
            *extra,
        ],
    )


@pytest.fixture
def repo_root(digits_config_path):
    return digits_config_path.parent.parent


@pytest.fixture
def device_requests(monkeypatch):
    """The config keys every device decision was made for (client or server), in order."""
    requested: list[str] = []
    original = devices._device

    def spy(amount: float, key: str, who: str) -> torch.device:
        requested.append(key)
        return original(amount, key, who)

    monkeypatch.setattr(devices, "_device", spy)
    devices._NOTICES.clear()
    yield requested
    devices._NOTICES.clear()


def _arrays(result) -> dict[str, bytes]:
    return {name: value.tobytes() for name, value in result.state.arrays.items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a GPU-less host")
@pytest.mark.parametrize("method", sorted(METHODS))
def test_each_method_takes_the_device_path_and_falls_back_to_the_cpu_result(
    method, repo_root, device_requests, tmp_path, capsys
):
    cpu = run(_config(repo_root, method), tmp_path / "cpu", progress=False, tensorboard=False)
    assert device_requests.count("server.num_gpus") >= 1  # evaluation asked for its device
    device_requests.clear()
    capsys.readouterr()
    gpu = run(
        _config(repo_root, method, *GPU_REQUEST),
        tmp_path / "gpu",
        progress=False,
        tensorboard=False,
    )
    # the clients (in this process on the local backend) and the server asked for a device
    assert "clients.num_gpus" in device_requests
    assert "server.num_gpus" in device_requests
    err = capsys.readouterr().err
    assert err.count("clients.num_gpus=0.25 but no GPU is visible here") == 1
    assert err.count("server.num_gpus=0.5 but no GPU is visible here") == 1
    # falling back to the CPU gives the CPU run exactly, state and metrics
    assert _arrays(gpu) == _arrays(cpu)
    assert gpu.summary["final"] == cpu.summary["final"]


@pytest.mark.ray
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a GPU-less cluster")
def test_each_method_family_runs_on_a_gpu_less_ray_cluster_with_one_notice_each(
    repo_root, ray_session, tmp_path, capsys
):
    for method in RAY_METHODS:
        devices._NOTICES.clear()
        capsys.readouterr()
        result = run(
            _config(repo_root, method, *GPU_REQUEST, backend="ray"),
            tmp_path / method,
            progress=False,
            tensorboard=False,
        )
        local = run(
            _config(repo_root, method), tmp_path / f"{method}-local", progress=False,
            tensorboard=False,
        )  # fmt: skip
        assert _arrays(result) == _arrays(local), method
        err = capsys.readouterr().err
        # the driver says once per kind that the cluster has no GPU for it
        assert err.count("clients.num_gpus=0.25 but the Ray cluster has no GPUs") == 1, err
        assert err.count("server.num_gpus=0.5 but the Ray cluster has no GPUs") == 1, err
