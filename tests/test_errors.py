"""User mistakes give one clear line, through the Python API and through the CLI.

CLI contract: exit status 2, stderr is exactly one line starting with 'raysim: error:', no
traceback.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from raysim import config
from raysim.assembly import run
from raysim.errors import ConfigError, DataError, RaysimError


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("raysim: error: ")
    return lines[0]


def _cli_run(run_cli, config_path, out: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = ["run", config_path, "--out", out, "--no-progress", "--set", "runtime.backend=local"]
    for override in overrides:
        args += ["--set", override]
    return run_cli(args)


def _api_run(digits_config, out: Path, *overrides: str):
    cfg = digits_config(*overrides, "run.rounds=1")
    return run(cfg, out, progress=False, tensorboard=False)


# --- unknown config key --------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest_api(digits_config):
    with pytest.raises(ConfigError) as caught:
        digits_config("clients.lrr=0.1")
    message = str(caught.value)
    assert "unknown key 'clients.lrr' (did you mean 'lr'?)" in message
    assert "valid keys: per_round, local_epochs, batch_size, lr," in message
    with pytest.raises(ConfigError, match=r"unknown key 'run\.round' \(did you mean 'rounds'\?\)"):
        digits_config("run.round=3")


def test_unknown_key_suggests_the_closest_cli(run_cli, digits_config_path, tmp_path):
    line = _one_line_error(
        _cli_run(run_cli, digits_config_path, tmp_path / "out", "clients.lrr=0.1")
    )
    assert line.startswith(  # the typo is in the override, not in the file
        "raysim: error: --set clients.lrr=0.1: unknown key 'clients.lrr' (did you mean 'lr'?)"
    )
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


# --- unknown plug-in names -----------------------------------------------------------------------

UNKNOWN_NAMES = [
    (
        "algorithm.name=fedx",
        "unknown algorithm 'fedx' (did you mean 'fedprox'?); choices: fedavg, fedprox",
    ),
    (
        "model.name=mlpp",
        "unknown model 'mlpp' (did you mean 'mlp'?); choices: conv2, conv4, conv8, lenet, mlp",
    ),
    (
        "data.name=mnistt",
        "unknown dataset 'mnistt' (did you mean 'mnist'?); choices: cifar10, "
        "cifar100, digits, femnist, mnist, synthetic_classification",
    ),
    ("aggregator.name=bulyan", "unknown aggregator 'bulyan'; choices: mean, weighted_mean"),
    (
        "server.optimizer=adamw",
        "unknown server optimizer 'adamw' (did you mean 'adam'?); choices: adagrad, adam, sgd",
    ),
    (
        "partition.name=pathological",
        "unknown partitioner 'pathological'; choices: dirichlet, iid, natural, one_class, shards",
    ),
]


@pytest.mark.parametrize(("override", "expected"), UNKNOWN_NAMES)
def test_unknown_name_lists_the_choices_api(digits_config, override, expected):
    with pytest.raises(ConfigError) as caught:
        digits_config(override)
    _assert_names_choices(str(caught.value), expected)


def _assert_names_choices(message: str, expected: str) -> None:
    """Same message, except that the choices may have grown (new plug-ins), still sorted."""
    prefix, _, listed = expected.partition("; choices: ")
    assert message.startswith(prefix + "; choices: "), message
    # after the choices: the hint that a plug-in of your own is named by import path
    listing, _, hint = message.partition("; choices: ")[2].partition(" (or ")
    assert hint == "'package.module:attr' of your own)", message
    choices = listing.split(", ")
    assert set(listed.split(", ")) <= set(choices) and choices == sorted(choices), message


@pytest.mark.parametrize(("override", "expected"), UNKNOWN_NAMES[:3])
def test_unknown_name_lists_the_choices_cli(
    run_cli, digits_config_path, tmp_path, override, expected
):
    line = _one_line_error(_cli_run(run_cli, digits_config_path, tmp_path / "out", override))
    assert line.startswith("raysim: error: ")
    _assert_names_choices(line.removeprefix("raysim: error: "), expected)


# --- missing data root ---------------------------------------------------------------------------


def test_missing_data_root_names_the_path_api(digits_config, tmp_path):
    with pytest.raises(DataError) as caught:
        _api_run(digits_config, tmp_path / "out", "data.name=mnist", "data.root=/nonexistent")
    message = str(caught.value)
    assert "dataset 'mnist'" in message and "'/nonexistent'" in message
    assert "MNIST/raw" in message  # what the folder should contain


def test_missing_data_root_names_the_path_cli(run_cli, digits_config_path, tmp_path):
    line = _one_line_error(
        _cli_run(
            run_cli,
            digits_config_path,
            tmp_path / "out",
            "data.name=mnist",
            "data.root=/nonexistent",
        )
    )
    assert "dataset 'mnist'" in line and "'/nonexistent'" in line and "MNIST/raw" in line


def test_empty_data_root_names_the_file_and_how_to_obtain_it(digits_config, tmp_path):
    root = tmp_path / "empty"
    root.mkdir()
    with pytest.raises(DataError) as caught:
        _api_run(digits_config, tmp_path / "out", "data.name=mnist", f"data.root={root}")
    message = str(caught.value)
    assert f"file not found: {root}/MNIST/raw/train-images-idx3-ubyte (or .gz)" in message
    assert f"torchvision.datasets.MNIST('{root}', download=True)" in message


def test_missing_data_root_says_how_to_obtain_the_data(
    digits_config, run_cli, digits_config_path, tmp_path
):
    with pytest.raises(DataError) as caught:
        _api_run(digits_config, tmp_path / "out", "data.name=mnist", "data.root=/nonexistent")
    assert "download=True" in str(caught.value)
    line = _one_line_error(
        _cli_run(
            run_cli,
            digits_config_path,
            tmp_path / "out2",
            "data.name=mnist",
            "data.root=/nonexistent",
        )
    )
    assert "download=True" in line


# --- malformed LEAF json -------------------------------------------------------------------------


def _leaf_file(users: dict[str, tuple[int, int]]) -> dict:
    """LEAF json: every user gets `count` blank 784-pixel images of class `label`."""
    return {
        "users": list(users),
        "num_samples": [count for count, _ in users.values()],
        "user_data": {
            user: {"x": [[0.0] * 784] * count, "y": [label] * count}
            for user, (count, label) in users.items()
        },
    }


def _femnist_root(tmp_path: Path) -> Path:
    root = tmp_path / "femnist"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    (root / "test" / "all_data_0_test.json").write_text(json.dumps(_leaf_file({"w0": (2, 3)})))
    return root


FEMNIST = (
    "data.name=femnist",
    # the whole partition section replaced: the file's dirichlet alpha does not apply
    "partition={name: natural, num_clients: 2}",
    "clients.per_round=1",
)


def test_malformed_leaf_json_names_file_and_line_api(digits_config, tmp_path):
    root = _femnist_root(tmp_path)
    bad = root / "train" / "all_data_0_train.json"
    bad.write_text('{"users": ["w0"],\n "user_data": {\n')
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(bad))}: invalid JSON at line 3, "
        r"column 1: ",
    ):
        _api_run(digits_config, tmp_path / "out", *FEMNIST, f"data.root={root}")


def test_malformed_leaf_json_names_file_and_line_cli(run_cli, digits_config_path, tmp_path):
    root = _femnist_root(tmp_path)
    bad = root / "train" / "all_data_0_train.json"
    bad.write_text('{"users": ["w0"],\n "user_data": {\n')
    line = _one_line_error(
        _cli_run(run_cli, digits_config_path, tmp_path / "out", *FEMNIST, f"data.root={root}")
    )
    assert line.startswith(f"raysim: error: {bad}: invalid JSON at line 3, column 1: ")


def test_leaf_json_with_a_wrong_record_names_file_user_and_reason(
    digits_config, run_cli, digits_config_path, tmp_path
):
    root = _femnist_root(tmp_path)
    content = _leaf_file({"w0": (2, 1), "w1": (3, 4)})
    content["user_data"]["w1"]["x"][1] = [0.0] * 783
    bad = root / "train" / "all_data_0_train.json"
    bad.write_text(json.dumps(content))
    expected = (
        f"{bad}: user_data['w1']: x[1] has length 783, expected 784 (a flattened 28x28 image)"
    )
    with pytest.raises(DataError) as caught:
        _api_run(digits_config, tmp_path / "out", *FEMNIST, f"data.root={root}")
    assert str(caught.value) == expected
    line = _one_line_error(
        _cli_run(run_cli, digits_config_path, tmp_path / "out2", *FEMNIST, f"data.root={root}")
    )
    assert line == f"raysim: error: {expected}"


def test_valid_leaf_data_runs(digits_config, tmp_path):
    """The same tiny LEAF folder, well formed, trains: the errors above are about the files."""
    root = _femnist_root(tmp_path)
    (root / "train" / "all_data_0_train.json").write_text(
        json.dumps(_leaf_file({"w0": (4, 1), "w1": (4, 3)}))
    )
    result = _api_run(
        digits_config, tmp_path / "out", *FEMNIST, f"data.root={root}", "model.hidden=[8]"
    )
    assert result.summary["num_clients"] == 2 and result.summary["clients_done"] == 1
    assert result.summary["final"]["accuracy"] in (0.0, 1.0)  # 2 test samples of one class


# --- plug-in option of the wrong type ------------------------------------------------------------


def test_plugin_option_of_the_wrong_type_is_one_line(run_cli, digits_config_path, tmp_path):
    result = _cli_run(
        run_cli,
        digits_config_path,
        tmp_path / "out",
        "algorithm.name=fedprox",
        "algorithm.mu=abc",
        "run.rounds=1",
    )
    assert "algorithm.mu" in _one_line_error(result)


def test_errors_are_raysim_errors():
    assert issubclass(ConfigError, RaysimError) and issubclass(DataError, RaysimError)
    with pytest.raises(RaysimError):
        config.from_dict({"clients": {"lrr": 1}})
