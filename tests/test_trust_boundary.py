"""What a config can run: a plug-in name resolves only to a declared plug-in of its kind.

A config (or a run folder received from someone else) naming `subprocess:call`, `builtins:exit`,
`os:fork`, `pdb:set_trace` or `doctest:debug_script` in any slot that takes a plug-in is refused
in one line, by the CLI and the Python API, with nothing run. The attack cases run in one child
process: were a name resolved and called there (as before this boundary), it would exit, fork
or open a debugger in the child, never in pytest's own process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DIGITS = REPO_ROOT / "configs" / "fedavg_digits.yaml"
ATTACKS = ["doctest:debug_script", "subprocess:call", "builtins:exit", "os:fork", "pdb:set_trace"]
# Every config key whose value names a plug-in.
SLOTS = [
    "data.name",
    "partition.name",
    "model.name",
    "algorithm.name",
    "aggregator.name",
    "codec.name",
    "attack.name",
    "server.optimizer",
    "index.backend",
    "runtime.backend",
]
SMALL = [
    "runtime.backend=local",
    "run.rounds=2",
    "run.checkpoint_every=1",
    "partition.num_clients=8",
    "clients.per_round=4",
    "clients.local_epochs=1",
    "model.hidden=[16]",
]

ATTACK_SCRIPT = """
import contextlib, io, json, os, sys
import raysim
from raysim.cli import main

digits, slots, attacks = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
# debug_script would run this as Python (the dataset loader's first argument is data.root)
root = "data.root=open('PWNED', 'w').close()"
results = []
for slot in slots:
    for name in attacks:
        # the attack's override last: it wins over runtime.backend=local in that slot
        overrides = ["runtime.backend=local", root, f"{slot}={name}"]
        sets = [part for override in overrides for part in ("--set", override)]
        for command in ("run", "partition"):
            args = [command, digits, *sets]
            if command == "run":
                args += ["--out", f"out-{slot}", "--no-progress"]
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
                code = main(args)
            results.append({"how": f"raysim {command}", "slot": slot, "name": name,
                            "code": code, "message": stderr.getvalue()})
        try:
            raysim.run(digits, out=f"api-{slot}", overrides=overrides, progress=False,
                       tensorboard=False)
            message, code = "", 0
        except raysim.ConfigError as error:
            message, code = str(error), 2
        results.append({"how": "raysim.run", "slot": slot, "name": name, "code": code,
                        "message": message})
print(json.dumps({"pid": os.getpid(), "results": results}))
"""


def test_stdlib_callables_named_in_any_slot_are_refused_in_one_line_and_run_nothing(tmp_path):
    script = tmp_path / "attack.py"
    script.write_text(ATTACK_SCRIPT)
    finished = subprocess.run(
        [sys.executable, str(script), str(DIGITS), json.dumps(SLOTS), json.dumps(ATTACKS)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,  # pdb:set_trace, were it called, would read this and go on
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    lines = finished.stdout.strip().splitlines()
    # one report from one process: nothing exited early (builtins:exit), nothing forked (os:fork)
    assert len([line for line in lines if line.startswith('{"pid"')]) == 1, lines[-5:]
    results = json.loads(lines[-1])["results"]
    assert len(results) == len(SLOTS) * len(ATTACKS) * 3
    for result in results:
        where = f"{result['how']} {result['slot']}={result['name']}"
        assert result["code"] == 2, where
        message = result["message"].strip()
        assert "\n" not in message, where
        assert f"'{result['name']}' is not a raysim plug-in" in message, (where, message)
        assert "standard-library module" in message and "@raysim.plugin(" in message, message
    assert not (tmp_path / "PWNED").exists()  # doctest:debug_script ran nothing
    assert not list(tmp_path.glob("out-*")) and not list(tmp_path.glob("api-*"))


PLUGINS = '''
import raysim
from raysim.algorithms.fedavg import FedAvg


@raysim.plugin("algorithm")
class Declared(FedAvg):
    pass


class SubclassOfDeclared(Declared):
    pass


@raysim.plugin("aggregator")
class DeclaredAggregator(Declared):
    """Declared for another kind: its base class's algorithm declaration is replaced."""


class Undeclared(FedAvg):
    pass


@raysim.plugin("model")
def a_model(input_shape, num_classes):
    raise AssertionError("never built here")


class Answers:
    """An object that answers every attribute (as a mock does) declares nothing."""

    def __getattr__(self, name):
        return frozenset({"algorithm"})

    def __call__(self, *args, **kwargs):
        raise AssertionError("never called")


anything = Answers()
'''


@pytest.fixture
def user_plugins(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "trust_plugins_mod.py").write_text(PLUGINS)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    _forget("trust_plugins_mod")


def _forget(module: str) -> None:
    """Drop a test module and the registries' resolutions of it (each test imports its own)."""
    from raysim import registry

    sys.modules.pop(module, None)
    for reg in registry._ALL:
        for name in [n for n in reg._imported if n.startswith(f"{module}:")]:
            del reg._imported[name]


def test_only_objects_declared_for_the_slots_kind_resolve(user_plugins):
    from raysim import config as config_module
    from raysim.errors import ConfigError

    config = config_module.from_dict({}, ["algorithm.name=trust_plugins_mod:Declared"])
    assert config.algorithm.name == "trust_plugins_mod:Declared"
    # a subclass of a declared algorithm is an algorithm too
    config_module.from_dict({}, ["algorithm.name=trust_plugins_mod:SubclassOfDeclared"])
    refused = {
        "algorithm.name=trust_plugins_mod:Undeclared": "(declare it with",
        "algorithm.name=trust_plugins_mod:DeclaredAggregator": "declared for aggregator",
        "algorithm.name=trust_plugins_mod:a_model": "declared for model, not for algorithm",
        "algorithm.name=trust_plugins_mod:anything": "(declare it with",
        "aggregator.name=trust_plugins_mod:Declared": "declared for algorithm",
        "model.name=raysim.cli:main": "'raysim.cli:main' is not a raysim plug-in",
    }
    for override, expected in refused.items():
        with pytest.raises(ConfigError, match="is not a raysim plug-in") as caught:
            config_module.from_dict({}, [override])
        assert expected in str(caught.value) and "\n" not in str(caught.value), override


def test_objects_registered_from_python_are_trusted_without_a_declaration(user_plugins):
    import trust_plugins_mod

    from raysim import config as config_module
    from raysim import registry

    registry.algorithms.register("undeclared_by_object", trust_plugins_mod.Undeclared)
    registry.algorithms.register("undeclared_by_path", "trust_plugins_mod:Undeclared")
    try:
        for name in ("undeclared_by_object", "undeclared_by_path"):
            config = config_module.from_dict({}, [f"algorithm.name={name}"])
            assert registry.algorithms.get(config.algorithm.name) is trust_plugins_mod.Undeclared
    finally:
        registry.algorithms.unregister("undeclared_by_object")
        registry.algorithms.unregister("undeclared_by_path")


def test_the_declaration_names_a_known_kind():
    import raysim

    with pytest.raises(ValueError, match="unknown kind 'algorithms'"):
        raysim.plugin("algorithms")
    with pytest.raises(TypeError):
        raysim.plugin()
    assert raysim.plugin("server_optimizer")(lambda: None).__raysim_plugin__ == frozenset(
        {"server optimizer"}
    )


@pytest.fixture
def received_run(tmp_path, monkeypatch):
    """A run folder whose config names a declared plug-in by path (a folder someone sent)."""
    folder = tmp_path / "project"
    folder.mkdir()
    shutil.copy(REPO_ROOT / "examples" / "plugins" / "clipped_fedavg.py", folder)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    import raysim

    out = tmp_path / "received"
    overrides = [*SMALL, "algorithm={name: 'clipped_fedavg:ClippedFedAvg', max_norm: 1.0}"]
    raysim.run(DIGITS, out=out, overrides=overrides, progress=False, tensorboard=False)
    yield out
    _forget("clipped_fedavg")


def test_resuming_a_received_folder_with_import_path_plugins_needs_trust_plugins(
    received_run, capsys
):
    import raysim
    from raysim.cli import main
    from raysim.errors import RaysimError

    before = (received_run / "metrics.jsonl").read_text()
    with pytest.raises(RaysimError) as caught:
        raysim.resume(received_run, overrides=["run.rounds=3"], progress=False, tensorboard=False)
    message = str(caught.value)
    assert "\n" not in message
    assert "algorithm 'clipped_fedavg:ClippedFedAvg'" in message and "--trust-plugins" in message
    assert main(["run", "--resume", str(received_run), "--set", "run.rounds=3"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("raysim: error: cannot resume") and "--trust-plugins" in line
    assert "\n" not in line
    assert (received_run / "metrics.jsonl").read_text() == before  # untouched when refused
    assert main(["run", "--resume", str(received_run), "--set", "run.rounds=3",
                 "--no-progress", "--trust-plugins"]) == 0  # fmt: skip
    records = raysim.load_run(received_run).metrics
    assert [r["round"] for r in records] == [1, 2, 3]


def test_trust_plugins_belongs_to_resume(capsys):
    from raysim.cli import main

    assert main(["run", str(DIGITS), "--trust-plugins"]) == 2
    assert "--trust-plugins applies to --resume DIR" in capsys.readouterr().err


def test_load_run_reads_a_folder_naming_builtins_exit_without_running_it(tmp_path):
    import raysim

    out = tmp_path / "run"
    raysim.run(DIGITS, out=out, overrides=SMALL, progress=False, tensorboard=False)
    config_yaml = out / "config.yaml"
    text = config_yaml.read_text()
    assert "  name: fedavg\n" in text
    # someone edits the folder before sending it: their config names builtins:exit
    config_yaml.write_text(
        text.replace("  name: fedavg\n", "  name: builtins:exit\n  status: 0\n").replace(
            "  name: digits\n", "  name: doctest:debug_script\n"
        )
    )
    record = raysim.load_run(out)  # were exit called, pytest's own process would end here
    assert record.config.algorithm.name == "builtins:exit"
    assert record.config.algorithm.options == {"status": 0}
    assert [r["round"] for r in record.metrics] == [1, 2]
    assert record.summary["rounds"] == 2 and record.round == 2
    with pytest.raises(raysim.ConfigError, match="'builtins:exit' is not a raysim plug-in"):
        record.algorithm()  # building it resolves the name: refused, as in a config


def test_a_plugin_declaration_reaches_the_workers_through_the_snapshot(user_plugins):
    """The driver's resolution travels to workers (`registry.snapshot` / `install`): a worker
    never resolves a config's path itself."""
    import trust_plugins_mod

    from raysim import registry

    registry.algorithms.get("trust_plugins_mod:Declared")
    shipped = registry.snapshot()["algorithm"]
    assert shipped["trust_plugins_mod:Declared"] is trust_plugins_mod.Declared
    saved = dict(registry.algorithms._imported)
    registry.algorithms._imported.clear()
    try:
        registry.install({"algorithm": shipped})
        assert registry.algorithms.get("trust_plugins_mod:Declared") is trust_plugins_mod.Declared
    finally:
        registry.algorithms._imported.clear()
        registry.algorithms._imported.update(saved)


def test_docs_state_the_trust_model():
    readme = (REPO_ROOT / "README.md").read_text()
    assert "What a config can do" in readme
    extending = (REPO_ROOT / "docs" / "EXTENDING.md").read_text()
    assert '@raysim.plugin("algorithm")' in extending and "--trust-plugins" in extending
