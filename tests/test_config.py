"""Config: YAML load, `--set` overrides, plug-in options, round trip, validation messages."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from raysim import config
from raysim.config import Config
from raysim.errors import ConfigError

# --- loading and overrides -----------------------------------------------------------------------


def test_yaml_file_is_loaded_into_typed_sections(digits_config_path):
    cfg = config.load(digits_config_path)
    assert cfg.run.name == "fedavg_digits" and cfg.run.rounds == 30 and cfg.run.seed == 0
    assert cfg.run.checkpoint_every == 10
    assert cfg.data.name == "digits" and cfg.data.root is None and dict(cfg.data.options) == {}
    assert (cfg.partition.name, cfg.partition.num_clients) == ("dirichlet", 100)
    assert dict(cfg.partition.options) == {"alpha": 0.5}  # the partitioner's options
    assert cfg.clients.per_round == 10 and cfg.clients.local_epochs == 5
    assert cfg.clients.lr == 0.05 and cfg.clients.momentum == 0.9
    assert cfg.clients.per_task == "auto"  # default kept for keys the file does not set
    assert cfg.model.name == "mlp" and dict(cfg.model.options) == {"hidden": [128]}
    assert cfg.algorithm.name == "fedavg" and dict(cfg.algorithm.options) == {}
    assert cfg.aggregator.name == "weighted_mean"
    assert cfg.server.optimizer == "sgd" and cfg.server.lr == 1.0
    assert cfg.runtime.backend == "ray" and cfg.runtime.num_cpus is None


def test_overrides_are_parsed_as_yaml_scalars(digits_config_path):
    cfg = config.load(
        digits_config_path,
        [
            "run.rounds=7",  # int
            "clients.lr=0.125",  # float
            "clients.num_cpus=2",  # int given to a float field becomes a float
            "run.name=my run",  # str (with a space)
            "runtime.backend=local",  # str
            "runtime.num_cpus=null",  # null
            "data.root=~",  # YAML's other null
            "model.hidden=[32, 16]",  # list
            "clients.per_task=3",  # int for an 'int | str' field
        ],
    )
    assert cfg.run.rounds == 7 and type(cfg.run.rounds) is int
    assert cfg.clients.lr == 0.125 and type(cfg.clients.lr) is float
    assert cfg.clients.num_cpus == 2.0 and type(cfg.clients.num_cpus) is float
    assert cfg.run.name == "my run"
    assert cfg.runtime.backend == "local"
    assert cfg.runtime.num_cpus is None and cfg.data.root is None
    assert cfg.model.options["hidden"] == [32, 16]
    assert cfg.clients.per_task == 3
    assert config.load(digits_config_path, ["clients.per_task=auto"]).clients.per_task == "auto"
    assert config.load(digits_config_path, ["runtime.num_cpus=4"]).runtime.num_cpus == 4


def test_later_override_wins_and_file_is_not_changed(digits_config_path):
    before = digits_config_path.read_text()
    cfg = config.load(digits_config_path, ["run.rounds=2", "run.rounds=5"])
    assert cfg.run.rounds == 5
    assert digits_config_path.read_text() == before


def test_plugin_options_are_passed_through(digits_config_path):
    cfg = config.load(
        digits_config_path,
        [
            "algorithm.name=fedprox",
            "algorithm.mu=0.1",
            "model.hidden=[32,16]",
            "aggregator.name=mean",
        ],
    )
    assert cfg.algorithm.name == "fedprox" and dict(cfg.algorithm.options) == {"mu": 0.1}
    assert cfg.model.name == "mlp" and dict(cfg.model.options) == {"hidden": [32, 16]}
    assert cfg.aggregator.name == "mean" and dict(cfg.aggregator.options) == {}


def test_plugin_option_of_another_plugin_is_rejected(digits_config_path):
    # 'mu' belongs to fedprox; fedavg takes no options.
    with pytest.raises(ConfigError, match=r"unknown option 'algorithm\.mu' for algorithm 'fedavg'"):
        config.load(digits_config_path, ["algorithm.mu=0.1"])


def test_from_dict_with_overrides_and_defaults():
    cfg = config.from_dict(
        {"run": {"rounds": 4}, "model": {"name": "mlp", "hidden": [8]}},
        ["clients.per_round=3", "partition.num_clients=5"],
    )
    assert cfg.run.rounds == 4 and cfg.clients.per_round == 3
    assert cfg.partition.num_clients == 5 and cfg.partition.name == "iid"
    assert dict(cfg.model.options) == {"hidden": [8]}
    assert config.from_dict({}) == Config()


# --- round trip ----------------------------------------------------------------------------------


def test_to_yaml_round_trip_gives_an_equal_config(digits_config_path, tmp_path):
    cfg = config.load(
        digits_config_path,
        [
            "algorithm.name=fedprox",
            "algorithm.mu=0.25",
            "model.hidden=[32, 16]",
            "runtime.num_cpus=2",
            "clients.per_task=4",
            "partition.cache_dir=/tmp/cache",
            "server.optimizer=adam",
            "server.lr=0.01",
            "data.root=/data/here",
        ],
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    again = config.load(path)
    assert again == cfg
    assert again.to_yaml() == cfg.to_yaml()
    assert config.from_dict(cfg.to_dict()) == cfg


def test_round_trip_of_the_defaults(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text(Config().to_yaml())
    assert config.load(path) == Config()


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "clients.per_round=101",
            r"'clients\.per_round' must be <= partition\.num_clients \(100\), got 101",
        ),
        ("clients.lr=-0.1", r"'clients\.lr' must be > 0, got -0\.1"),
        ("clients.lr=0", r"'clients\.lr' must be > 0, got 0\.0"),
        ("run.rounds=0", r"'run\.rounds' must be >= 1 and <= 1e\+09, got 0"),
        ("clients.per_task=0", r"'clients\.per_task' must be 'auto' or an integer >= 1, got 0"),
        (
            "clients.per_task=autox",
            r"'clients\.per_task' must be 'auto' or an integer >= 1, got 'autox'",
        ),
        ("clients.per_task=1.5", r"'clients\.per_task' expects int \| str, got 1\.5"),
        (
            "runtime.backend=foo",
            r"'runtime\.backend' must be one of local, ray or package\.module:Class, got 'foo'",
        ),
        ("runtime.num_cpus=0", r"'runtime\.num_cpus' must be >= 1, got 0"),
        ("partition.alpha=0", r"'partition\.alpha' must be > 0, got 0\.0"),
        ("run.seed=-1", r"'run\.seed' must be >= 0, got -1"),
        ("server.momentum=1", r"'server\.momentum' must be in \[0, 1\), got 1\.0"),
        ("clients.num_cpus=0", r"'clients\.num_cpus' must be > 0, got 0\.0"),
    ],
)
def test_range_errors_name_the_key(digits_config_path, override, message):
    with pytest.raises(ConfigError, match=message) as caught:
        config.load(digits_config_path, [override])
    text = str(caught.value)
    # the bad value came from the command line: the error names that override, not the file
    assert text.startswith(f"--set {override}: ")
    assert "\n" not in text


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.rounds=true", r"'run\.rounds' expects int, got True"),
        ("clients.per_round=false", r"'clients\.per_round' expects int, got False"),
        ("clients.lr=true", r"'clients\.lr' expects float, got True"),
        ("run.rounds=1.0", r"'run\.rounds' expects int, got 1\.0"),
        ("run.rounds=many", r"'run\.rounds' expects int, got 'many'"),
        ("run.name=123", r"'run\.name' expects str, got 123"),
        ("runtime.num_cpus=1.5", r"'runtime\.num_cpus' expects int \| None, got 1\.5"),
        ("data.root=5", r"'data\.root' must be a path string, got 5"),
    ],
)
def test_wrong_types_are_rejected_bool_included(digits_config_path, override, message):
    with pytest.raises(ConfigError, match=message):
        config.load(digits_config_path, [override])


def test_a_section_set_to_a_scalar_says_how_to_replace_or_set_it(digits_config_path):
    # `section=value` replaces a whole section, so it takes a mapping only
    with pytest.raises(
        ConfigError, match=re.escape("--set run=3: a whole section is replaced by a mapping")
    ) as caught:
        config.load(digits_config_path, ["run=3"])
    assert "run.key=value" in str(caught.value) and "\n" not in str(caught.value)


def test_unknown_section_is_rejected_with_suggestion(digits_config_path):
    with pytest.raises(
        ConfigError,
        match=r"unknown section 'runn' \(did you mean 'run'\?\); "
        r"valid sections: run, data, partition",
    ):
        config.load(digits_config_path, ["runn.rounds=3"])
    with pytest.raises(ConfigError, match=r"unknown section 'optimizer'; valid sections:"):
        config.from_dict({"optimizer": {"lr": 1.0}})


def test_unknown_key_in_the_yaml_file_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  rounds: 3\nclients:\n  lrr: 0.1\n")
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"{path}: unknown key 'clients.lrr' (did you mean 'lr'?); valid keys: per_round"
        ),
    ):
        config.load(path)


@pytest.mark.parametrize("override", ["clients", "a.b.c=1", ".rounds=1"])
def test_malformed_override_is_rejected(digits_config_path, override):
    with pytest.raises(
        ConfigError,
        match=rf"override '{re.escape(override)}' must look like "
        r"section\.key=value",
    ):
        config.load(digits_config_path, [override])


def test_missing_or_invalid_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  rounds: [1, 2\n")
    with pytest.raises(
        ConfigError,
        match=rf"{re.escape(str(bad))}: line \d+, column \d+: "
        r"invalid YAML",
    ):
        config.load(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match=r"expected a mapping of sections at the top level"):
        config.load(listing)


def test_exponent_floats_without_a_dot_are_floats(digits_config_path, tmp_path):
    assert config.load(digits_config_path, ["clients.lr=1e-2"]).clients.lr == 0.01
    path = tmp_path / "exp.yaml"
    path.write_text("clients:\n  lr: 1e-3\n")
    assert config.load(path).clients.lr == 0.001


def test_bool_plugin_option_for_a_number_is_rejected(digits_config_path):
    from raysim.core.server import build_algorithm

    # Either the config check or the algorithm's own check may catch it.
    with pytest.raises(ConfigError, match=r"algorithm\.mu"):
        cfg = config.load(digits_config_path, ["algorithm.name=fedprox", "algorithm.mu=true"])
        build_algorithm(SimpleNamespace(config=cfg))


def test_public_api_is_pinned():
    import raysim

    assert sorted(raysim.__all__) == [
        "Config",
        "ConfigError",
        "DataError",
        "RaysimError",
        "RunRecord",
        "RunResult",
        "load_config",
        "load_run",
        "plugin",
        "resume",
        "run",
    ]
