"""Out-of-range config values: one ConfigError that names the key, whatever the section.

Every case is an override of an otherwise valid config; the error must be a ConfigError (not a
ValueError from deep inside numpy or torch at run time), name the key, and fit on one line.
"""

from __future__ import annotations

import pytest
import yaml

from raysim import config
from raysim.errors import ConfigError

FRL = ("algorithm.name=frl", "model.name=mlp")
DIRICHLET = "partition.name=dirichlet"
ATTACK = ("attack.name=sign_flip", "partition.num_clients=10", "clients.per_round=4")

# (overrides, key the message must name, fragment of the expectation)
OUT_OF_RANGE = [
    # run
    (("run.rounds=0",), "run.rounds", ">= 1"),
    (("run.rounds=-3",), "run.rounds", ">= 1"),
    (("run.eval_every=0",), "run.eval_every", ">= 1"),
    (("run.checkpoint_every=-1",), "run.checkpoint_every", ">= 0"),
    (("run.keep_checkpoints=0",), "run.keep_checkpoints", ">= 1"),
    (("run.seed=-1",), "run.seed", ">= 0"),
    (("run.name=''",), "run.name", "non-empty"),
    (("run.name=a/b",), "run.name", "without '/'"),
    # data / partition
    (("data.root=''",), "data.root", "a path"),
    (("partition.num_clients=0",), "partition.num_clients", ">= 1"),
    ((DIRICHLET, "partition.alpha=-0.5"), "partition.alpha", "> 0"),
    ((DIRICHLET, "partition.alpha=.inf"), "partition.alpha", "finite"),
    # nan: refused by the option type check, like every plug-in option (algorithm.k=.nan)
    ((DIRICHLET, "partition.alpha=.nan"), "partition.alpha", "finite"),
    ((DIRICHLET, "partition.min_size=-1"), "partition.min_size", ">= 0"),
    (
        ("partition.name=shards", "partition.shards_per_client=0"),
        "partition.shards_per_client",
        ">= 1",
    ),
    (
        ("partition.name=iid", "partition.shards_per_client=2"),
        "partition.shards_per_client",
        "valid options",
    ),
    (("partition.cache_dir=''",), "partition.cache_dir", "a path"),
    # clients
    (("clients.per_round=0",), "clients.per_round", ">= 1"),
    (("partition.num_clients=5", "clients.per_round=6"), "clients.per_round", "<= partition"),
    (("clients.local_epochs=0",), "clients.local_epochs", ">= 1"),
    (("clients.batch_size=0",), "clients.batch_size", ">= 1"),
    (("clients.batch_size=-8",), "clients.batch_size", ">= 1"),
    (("clients.lr=-0.1",), "clients.lr", "> 0"),
    (("clients.lr=.inf",), "clients.lr", "finite"),
    (("clients.lr=.nan",), "clients.lr", "> 0"),
    # finite but absurd: torch takes lr / weight decay as float32; larger steps only diverge
    (("clients.lr=1e308",), "clients.lr", "in (0, 1e4]"),
    (("clients.lr=10001",), "clients.lr", "in (0, 1e4]"),
    (("clients.weight_decay=1e300",), "clients.weight_decay", "in [0, 1e4]"),
    (("clients.num_cpus=1e300",), "clients.num_cpus", "at most 1024"),
    (("clients.num_gpus=2000",), "clients.num_gpus", "at most 1024"),
    (("clients.momentum=-0.9",), "clients.momentum", "in [0, 1)"),
    (("clients.momentum=1.5",), "clients.momentum", "in [0, 1)"),
    (("clients.weight_decay=-1e-4",), "clients.weight_decay", ">= 0"),
    (("clients.weight_decay=.inf",), "clients.weight_decay", "finite"),
    (("clients.per_task=0",), "clients.per_task", "'auto' or an integer >= 1"),
    (("clients.num_cpus=0",), "clients.num_cpus", "> 0"),
    (("clients.num_cpus=-1",), "clients.num_cpus", "> 0"),
    (("clients.num_gpus=-0.5",), "clients.num_gpus", ">= 0"),
    (("clients.num_gpus=.inf",), "clients.num_gpus", "finite"),
    # attack
    (("attack.fraction=-0.1",), "attack.fraction", "in [0, 1)"),
    (("attack.fraction=1.5",), "attack.fraction", "in [0, 1)"),
    (("attack.fraction=1",), "attack.fraction", "in [0, 1)"),
    ((*ATTACK, "attack.fraction=0.9"), "attack.fraction", "honest majority"),
    (("attack.pool_size=-1",), "attack.pool_size", ">= 0"),
    (("attack.name=agr_tailored", "attack.gamma_init=0"), "attack.gamma_init", "> 0"),
    (("attack.name=naive_scaling", "attack.scale=.nan"), "attack.scale", "finite"),
    # server
    (("server.lr=0",), "server.lr", "> 0"),
    (("server.lr=.inf",), "server.lr", "finite"),
    (("server.momentum=-0.1",), "server.momentum", "in [0, 1)"),
    (("server.beta1=1",), "server.beta1", "in [0, 1)"),
    (("server.beta2=-0.5",), "server.beta2", "in [0, 1)"),
    (("server.eps=0",), "server.eps", "> 0"),
    (("server.eps=-1e-3",), "server.eps", "> 0"),
    (("server.lr=1e300",), "server.lr", "in (0, 1e4]"),
    (("server.eps=1e-320",), "server.eps", ">= 1e-30"),
    (("server.eps=1e-31",), "server.eps", ">= 1e-30"),
    (("server.num_gpus=1e9",), "server.num_gpus", "at most 1024"),
    (("faults.straggler_delay_s=1e300",), "faults.straggler_delay_s", "at most 86400"),
    (("faults.straggler_delay_s=86401",), "faults.straggler_delay_s", "at most 86400"),
    (("run.round_deadline_s=1e300",), "run.round_deadline_s", "at most 86400"),
    (("index.num_cpus=.inf",), "index.num_cpus", "finite"),
    (("index.num_gpus=1e300",), "index.num_gpus", "at most 1024"),
    # runtime
    (("runtime.num_cpus=0",), "runtime.num_cpus", ">= 1"),
    (("runtime.num_cpus=-2",), "runtime.num_cpus", ">= 1"),
    (("runtime.dashboard_host=''",), "runtime.dashboard_host", "a host address"),
    # plug-in options, checked by the plug-in when the config is read
    ((*FRL, "algorithm.k=0"), "algorithm.k", "(0, 1]"),
    ((*FRL, "algorithm.k=1.5"), "algorithm.k", "(0, 1]"),
    ((*FRL, "algorithm.k=-0.2"), "algorithm.k", "(0, 1]"),
    ((*FRL, "algorithm.k=.nan"), "algorithm.k", "finite"),
    ((*FRL, "algorithm.lr_decay=0"), "algorithm.lr_decay", "(0, 1]"),
    ((*FRL, "algorithm.weight_init=zeros"), "algorithm.weight_init", "choices"),
    (("algorithm.name=fedprox", "algorithm.mu=-0.01"), "algorithm.mu", ">= 0"),
    (("algorithm.name=fedprox", "algorithm.mu=.nan"), "algorithm.mu", "finite"),
    (("algorithm.name=topk", "algorithm.fraction=0"), "algorithm.fraction", "(0, 1]"),
    (("algorithm.name=topk", "algorithm.fraction=1.01"), "algorithm.fraction", "(0, 1]"),
    (("algorithm.name=signsgd", "algorithm.server_lr=-1"), "algorithm.server_lr", "> 0"),
    (("algorithm.name=signsgd", "algorithm.server_lr=.inf"), "algorithm.server_lr", "finite"),
    (("aggregator.name=trimmed_mean", "aggregator.beta=-1"), "aggregator.beta", ">= 0"),
    (
        ("aggregator.name=multi_krum", "aggregator.num_selected=0"),
        "aggregator.num_selected",
        ">= 1",
    ),
    (("model.hidden=[8, x]",), "model.hidden", "Sequence[int]"),
    (("algorithm.name=fedaws", "algorithm.class_lr=1e308"), "algorithm.class_lr", "(0, 1e4]"),
    (
        ("algorithm.name=fedaws", "algorithm.spreadout_lr=1e5"),
        "algorithm.spreadout_lr",
        "(0, 1e4]",
    ),
    (("algorithm.name=fedaws", "algorithm.lambda=1e300"), "algorithm.lambda", "[0, 1e6]"),
    (("algorithm.name=fedaws", "algorithm.nu=1e300"), "algorithm.nu", "(0, 1e3]"),
    (("algorithm.name=fedaws_softmax", "algorithm.scale=1e300"), "algorithm.scale", "(0, 1e4]"),
]


@pytest.mark.parametrize(
    ("overrides", "key", "expected"),
    OUT_OF_RANGE,
    ids=[" ".join(overrides) for overrides, _, _ in OUT_OF_RANGE],
)
def test_out_of_range_value_is_one_config_error_naming_the_key(overrides, key, expected):
    with pytest.raises(ConfigError) as caught:
        config.from_dict({}, list(overrides))
    message = str(caught.value)
    assert f"'{key}'" in message, message
    assert expected in message, message
    assert "\n" not in message


def test_through_a_file_the_message_names_the_file(digits_config_path, tmp_path):
    raw = yaml.safe_load(digits_config_path.read_text())
    raw["clients"]["momentum"] = -0.5
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as caught:
        config.load(path)
    assert str(caught.value) == f"{path}: 'clients.momentum' must be in [0, 1), got -0.5"


def test_through_an_override_the_message_names_the_override(digits_config_path):
    with pytest.raises(ConfigError) as caught:
        config.load(digits_config_path, ["clients.momentum=-0.5"])
    assert str(caught.value) == (
        "--set clients.momentum=-0.5: 'clients.momentum' must be in [0, 1), got -0.5"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ("clients.momentum=0", "clients.weight_decay=0", "clients.num_gpus=0"),
        ("clients.momentum=0.99", "clients.num_cpus=0.5", "clients.num_gpus=0.25"),
        ("partition.num_clients=7", "clients.per_round=7"),
        ("attack.fraction=0", "server.momentum=0", "server.beta1=0", "server.beta2=0"),
        (*ATTACK, "attack.fraction=0.5"),  # 5 honest of 10: a 4-client draw can be honest
        (*ATTACK, "attack.fraction=0.9", "attack.redraw_majority=false"),
        (*FRL, "algorithm.k=1"),
        (*FRL, "algorithm.k=0.01", "algorithm.lr_decay=1"),
        ("algorithm.name=topk", "algorithm.fraction=1"),
        ("run.checkpoint_every=0", "run.eval_every=1000", "run.rounds=1"),
        # the largest values the bounds on absurd numbers still accept
        ("clients.lr=1e4", "server.lr=1e4", "clients.weight_decay=1e4", "server.eps=1e-30"),
        ("faults.straggler_delay_s=86400", "run.round_deadline_s=86400"),
        ("clients.num_cpus=1024", "clients.num_gpus=1024", "server.num_gpus=1024"),
        ("index.num_cpus=1024", "index.num_gpus=1024"),
        ("algorithm.name=fedaws", "algorithm.class_lr=1e4", "algorithm.lambda=1e6"),
        ("algorithm.name=fedaws", "algorithm.spreadout_lr=1e4", "algorithm.nu=1e3"),
        ("algorithm.name=fedaws_softmax", "algorithm.scale=1e4"),
    ],
)
def test_boundary_values_are_accepted(overrides):
    config.from_dict({}, list(overrides))


def test_plugin_options_are_checked_when_the_config_is_read(tmp_path):
    """FRL's k is checked by FRL itself, but already by `config.load`, not at run start."""
    path = tmp_path / "frl.yaml"
    path.write_text("algorithm:\n  name: frl\n  k: 2\n")
    with pytest.raises(ConfigError, match=r"'algorithm\.k' must be in \(0, 1\]"):
        config.load(path)


def test_non_string_keys_and_dates_are_config_errors(tmp_path):
    cases = {
        "1: {}\n": "section names must be strings, got 1",
        "clients:\n  3: 4\n": "keys of 'clients' must be strings, got 3",
        "model:\n  null: 4\n": "keys of 'model' must be strings, got None",
        "clients:\n  lr: 2001-13-01\n": "'clients.lr' expects float, got '2001-13-01'",
        "run:\n  name: 2024-01-01\n": None,  # a date-like name stays a string
        "clients:\n  lr: !!timestamp 2001-13-01\n": "invalid YAML value",
    }
    for text, expected in cases.items():
        path = tmp_path / "c.yaml"
        path.write_text(text)
        if expected is None:
            assert config.load(path).run.name == "2024-01-01"
            continue
        with pytest.raises(ConfigError) as caught:
            config.load(path)
        assert expected in str(caught.value), (text, str(caught.value))


def test_unreadable_bytes_are_a_config_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\xff\xfe\x00clients: 1")
    with pytest.raises(ConfigError, match="cannot read the config file"):
        config.load(path)


def test_override_into_an_empty_section(tmp_path):
    """`clients:` with no keys in the file, then --set clients.lr=...: a plain override."""
    path = tmp_path / "c.yaml"
    path.write_text("clients:\nrun:\n  rounds: 2\n")
    assert config.load(path, ["clients.lr=0.2"]).clients.lr == 0.2
