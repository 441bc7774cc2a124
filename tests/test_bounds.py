"""Absurd values are refused in one line before any work starts.

Local epochs and the local step count a round asks of one client, a model's parameter count
(counted on the meta device, against the machine's memory), a client count no split can give,
run names with control or formatting characters, and duplicate keys in a YAML file.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from raysim import config as config_module
from raysim.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS = REPO_ROOT / "configs" / "fedavg_digits.yaml"


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


def test_absurd_local_epochs_are_refused_when_the_config_is_read():
    with pytest.raises(ConfigError, match=r"'clients\.local_epochs' must be at most") as caught:
        config_module.load(DIGITS, ["clients.local_epochs=1000000000000"])
    _one_line(caught)
    with pytest.raises(ConfigError, match=r"'clients\.local_epochs' expects int"):
        config_module.load(DIGITS, ["clients.local_epochs=1e12"])  # YAML reads a float
    with pytest.raises(ConfigError, match=r"clients\.local_epochs"):
        config_module.load(DIGITS, [f"clients.local_epochs={config_module.MAX_LOCAL_EPOCHS + 1}"])
    assert config_module.load(DIGITS, ["clients.local_epochs=100"]).clients.local_epochs == 100


def test_a_local_step_count_beyond_the_bound_is_refused_before_round_one(monkeypatch):
    import raysim
    from raysim.assembly import plan

    # digits' largest client of 8 holds ~170 rows: 11 steps an epoch at batch 16
    monkeypatch.setattr(plan, "MAX_LOCAL_STEPS", 1000)
    overrides = ["runtime.backend=local", "partition.num_clients=8", "clients.per_round=2",
                 "clients.local_epochs=100", "model.hidden=[16]"]  # fmt: skip
    with pytest.raises(raysim.RaysimError, match="local steps a round") as caught:
        raysim.run(DIGITS, out=None, overrides=overrides, progress=False, tensorboard=False)
    message = _one_line(caught)
    assert "clients.local_epochs=100" in message and "clients.batch_size=16" in message


def test_a_model_too_large_for_the_machine_is_refused_before_allocation():
    import resource

    from raysim.core.algorithm import RunContext
    from raysim.models.vector import build_model, max_model_parameters

    config = config_module.load(DIGITS, ["model.hidden=[60000, 60000]"])
    ctx = RunContext(config, (64,), 10, None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError, match="would have 3,604,560,010 parameters") as caught:
        build_model(ctx)
    assert f"more than {max_model_parameters():,}" in _one_line(caught)
    # nothing of its 14 GB was allocated
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200 * 1024


def test_a_million_client_dirichlet_split_of_digits_is_refused_at_once():
    from raysim.assembly.plan import partition_for_run
    from raysim.data.datasets import load_dataset

    config = config_module.load(DIGITS, ["runtime.backend=local", "partition.num_clients=1000000"])
    dataset = load_dataset(config)
    started = time.process_time()
    with pytest.raises(ConfigError, match="partition.num_clients") as caught:
        partition_for_run(config, dataset)
    assert time.process_time() - started < 1.0
    _one_line(caught)
    # as many clients as rows cannot give every client min_size >= 1 rows of a skewed split
    rows = len(dataset.train_y)
    config = config_module.load(DIGITS, ["runtime.backend=local", f"partition.num_clients={rows}"])
    started = time.process_time()
    with pytest.raises(ConfigError, match="min_size") as caught:
        partition_for_run(config, dataset)
    assert time.process_time() - started < 1.0
    _one_line(caught)


@pytest.mark.parametrize(
    "name", ["two\nlines", "tab\there", "right-to-left\u202egpj.exe", "zero\u200bwidth", "bell\a"]
)
def test_run_names_with_control_or_format_characters_are_refused(name):
    with pytest.raises(ConfigError, match=r"'run\.name' must be") as caught:
        config_module.from_dict({"run": {"name": name}})
    _one_line(caught)
    assert config_module.from_dict({"run": {"name": "café-run_2"}}).run.name == "café-run_2"


def test_duplicate_yaml_keys_are_refused_with_their_line(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("run:\n  rounds: 3\nclients:\n  lr: 0.1\n  lr: 10.0\n")
    with pytest.raises(ConfigError, match=r"line 5, column 3: invalid YAML: .*'lr'") as caught:
        config_module.load(path)
    assert "first at line 4" in _one_line(caught)
    path.write_text("run:\n  rounds: 3\nrun:\n  rounds: 300\n")
    with pytest.raises(ConfigError, match=r"line 3.*duplicate key 'run'"):
        config_module.load(path)
    # merge keys are YAML's own way to repeat a mapping; an explicit key overrides a merged one
    path.write_text("clients:\n  <<: {lr: 0.1, momentum: 0.5}\n  lr: 0.2\n")
    loaded = config_module.load(path)
    assert loaded.clients.lr == 0.2 and loaded.clients.momentum == 0.5
