"""A researcher's own plug-ins, in files outside the repository, named by `module:attr`.

The six example plug-ins of examples/plugins/ (an algorithm: FedAvg with client-side clipping;
an aggregator: a norm-bounded mean; a codec: int8 deltas with a per-tensor scale; a model; a
dataset; a partitioner) are copied into a temporary folder and run from there: on the local
backend, on a Ray that raysim starts itself (their modules must reach the workers through the
run's runtime_env), and registered by name from a user's script. Ray equals local bit for bit.
So does a one-trial `raysim tune` of them (below); their two-node cluster run is in
tests/test_cluster.py.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import raysim_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = REPO_ROOT / "examples" / "plugins"
PLUGIN_CONFIGS = [
    "clipped_fedavg",
    "norm_bounded_mean",
    "int8_codec",
    "residual_mlp",
    "blobs",
    "sorted_blocks",
]  # everything.yaml runs on both backends below


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """A copy of examples/plugins in a temporary folder outside the repository."""
    folder = tmp_path_factory.mktemp("my_research") / "plugins"
    shutil.copytree(EXAMPLES, folder)
    return folder


def _raysim(folder: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`raysim ARGS` run in `folder`, as a user would from their own directory."""
    result = raysim_cli(args, cwd=folder, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_run(a: Path, b: Path) -> None:
    """The two runs evaluated and trained identically, round by round."""
    keys = ("round", "eval", "train_loss", "update_norm_mean", "bytes_up", "clients_done")
    first = [{k: r.get(k) for k in keys} for r in _records(a)]
    second = [{k: r.get(k) for k in keys} for r in _records(b)]
    assert first == second


@pytest.mark.parametrize("name", PLUGIN_CONFIGS)
def test_each_example_plugin_runs_from_a_copy_on_the_local_backend(plugin_dir, name, tmp_path):
    out = tmp_path / name
    result = _raysim(
        plugin_dir,
        "run",
        f"{name}.yaml",
        "--out",
        str(out),
        "--no-progress",
        "--set",
        "runtime.backend=local",
        "--set",
        "run.rounds=3",
    )
    assert "done: 3 rounds" in result.stdout
    records = _records(out)
    assert len(records) == 3 and all(r["clients_done"] > 0 for r in records)
    assert all(r["clients_rejected"] == 0 for r in records)
    assert 0.0 <= records[-1]["eval"]["accuracy"] <= 1.0


def test_int8_codec_learns_digits_with_a_quarter_of_the_bytes(plugin_dir, tmp_path):
    int8 = tmp_path / "int8"
    _raysim(plugin_dir, "run", "int8_codec.yaml", "--out", str(int8), "--no-progress",
            "--set", "runtime.backend=local")  # fmt: skip
    dense = tmp_path / "dense"  # the bytes of the same first rounds without the codec
    _raysim(plugin_dir, "run", "int8_codec.yaml", "--out", str(dense), "--no-progress",
            "--set", "runtime.backend=local", "--set", "codec.name=auto",
            "--set", "run.rounds=3")  # fmt: skip
    summary = json.loads((int8 / "summary.json").read_text())
    assert summary["rounds"] == 30 and summary["clients_rejected"] == 0
    assert summary["final"]["accuracy"] >= 0.85, summary["final"]
    int8_bytes = sum(r["bytes_up"] for r in _records(int8)[:3])
    dense_bytes = sum(r["bytes_up"] for r in _records(dense))
    assert len(_records(dense)) == 3 and dense_bytes > 0
    # 1 byte an entry + 4 bytes per tensor instead of 4 bytes an entry
    assert 0.24 < int8_bytes / dense_bytes < 0.26


def test_a_malformed_int8_message_is_refused_by_the_codecs_check(plugin_dir, monkeypatch):
    from raysim import registry
    from raysim.core.codecs import VectorLayout
    from raysim.core.state import WireUpdate
    from raysim.core.validation import decode_checked, describe_rejection

    monkeypatch.chdir(plugin_dir)
    codec = registry.codecs.build("int8_codec:Int8Delta")
    layout = VectorLayout(10, np.dtype(np.float32), (6, 4))
    vector = np.linspace(-1, 1, 10).astype(np.float32)
    good = codec.encode(vector, layout)
    decoded, problem = decode_checked(codec, layout, WireUpdate(0, 5, good))
    assert problem is None
    np.testing.assert_allclose(decoded, vector, atol=1 / 127)
    malformed = {
        "a float vector": vector,
        "q of int16": {"q": good["q"].astype(np.int16), "scales": good["scales"]},
        "one entry short": {"q": good["q"][:-1], "scales": good["scales"]},
        "a NaN scale": {"q": good["q"], "scales": np.float32([np.nan, 1.0])},
        "a scale missing": {"q": good["q"], "scales": good["scales"][:1]},
    }
    for what, message in malformed.items():
        decoded, problem = decode_checked(codec, layout, WireUpdate(7, 5, message))
        assert decoded is None and problem, what
        line = describe_rejection(7, 3, problem)
        assert line.startswith("round 4: rejected the update of client 7: ") and "\n" not in line


@pytest.mark.ray
def test_every_plugin_on_ray_equals_local_from_a_copy(plugin_dir, tmp_path):
    """raysim starts Ray in the plug-ins' folder: the modules reach the workers (announced),
    and the result equals the local backend's bit for bit."""
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    rounds = ("--set", "run.rounds=4")  # 4 of the config's 10 rounds, compared round by round
    _raysim(plugin_dir, "run", "everything.yaml", "--out", str(local), "--no-progress",
            "--set", "runtime.backend=local", *rounds)  # fmt: skip
    result = _raysim(plugin_dir, "run", "everything.yaml", "--out", str(on_ray), "--no-progress",
                     "--set", "runtime.backend=ray", "--set", "runtime.num_cpus=2",
                     "--set", "runtime.dashboard=false", *rounds)  # fmt: skip
    assert "sending plug-in code to the workers" in result.stdout
    assert "ray backend" in result.stdout
    _same_run(local, on_ray)
    records = _records(local)  # as each plug-in's own local run above
    assert len(records) == 4 and all(r["clients_done"] > 0 for r in records)
    assert all(r["clients_rejected"] == 0 for r in records)
    assert 0.0 <= records[-1]["eval"]["accuracy"] <= 1.0


USER_SCRIPT = '''
"""A user's own script: plug-ins registered by name from this file's module (the server actor
and the client workers never import this script, so the registrations travel with the run)."""
import json, sys
import raysim
from raysim import registry
import my_methods

registry.algorithms.register("fedavg_clientclip", my_methods.ClippedFedAvg)
registry.aggregators.register("bounded", "my_methods:NormBoundedMean")
config = {
    "run": {"name": "registered", "rounds": 3, "checkpoint_every": 0},
    "data": {"name": "digits"},
    "partition": {"name": "dirichlet", "num_clients": 20, "alpha": 0.5},
    "clients": {"per_round": 4, "local_epochs": 1},
    "model": {"name": "mlp", "hidden": [16]},
    "algorithm": {"name": "fedavg_clientclip", "max_norm": 1.0},
    "aggregator": {"name": "bounded", "bound": 0.5},
}
finals = {}
for backend in ("local", "ray"):
    result = raysim.run(config, out=f"out_{backend}", progress=False, tensorboard=False,
                        overrides=[f"runtime.backend={backend}", "runtime.num_cpus=2",
                                   "runtime.dashboard=false"])
    finals[backend] = result.summary["final"]
record = raysim.load_run("out_ray")
model = record.model()
print(json.dumps({"finals": finals, "round": record.round, "model": type(model).__name__,
                  "records": len(record.metrics)}))
'''


@pytest.mark.ray
def test_names_registered_in_a_users_script_work_on_ray_and_load_run_reads_it_back(
    plugin_dir, tmp_path
):
    folder = tmp_path / "project"
    folder.mkdir()
    # my_methods imports two sibling modules: they must reach the workers with it
    for name in ("clipped_fedavg.py", "norm_bounded_mean.py"):
        shutil.copy(plugin_dir / name, folder / name)
    (folder / "my_methods.py").write_text(
        "from clipped_fedavg import ClippedFedAvg\nfrom norm_bounded_mean import NormBoundedMean\n"
    )
    (folder / "script.py").write_text(USER_SCRIPT)
    result = subprocess.run(
        [sys.executable, "script.py"], cwd=folder, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["finals"]["ray"] == report["finals"]["local"]
    assert report["round"] == 3 and report["records"] == 3 and report["model"] == "Sequential"


def test_an_import_path_that_does_not_resolve_is_one_line(tmp_path, monkeypatch):
    from raysim import config as config_module
    from raysim.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.py").write_text("def oops(:\n")
    (tmp_path / "fine.py").write_text("VALUE = 3\n")
    cases = {
        "algorithm.name=nowhere:Thing": "no module named 'nowhere'",
        "algorithm.name=fine:Missing": "'fine' has no attribute 'Missing'",
        "algorithm.name=fine:VALUE": "expected a class or function",
        "algorithm.name=broken:oops": "broken.py:1",
        "codec.name=fine:Missing": "codec 'fine:Missing'",
    }
    for override, expected in cases.items():
        with pytest.raises(ConfigError, match=expected) as error:
            config_module.from_dict({}, [override])
        assert "\n" not in str(error.value)


def test_core_and_runtime_import_nothing_from_algorithms():
    """Statically (every import statement, also inside functions) and at run time."""
    offenders = []
    for package in ("core", "runtime"):
        for path in sorted((REPO_ROOT / "raysim" / package).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                for name in names:
                    if name.startswith("raysim.algorithms") or (
                        package == "core" and name.startswith("raysim.runtime")
                    ):
                        offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert offenders == []
    modules = [f"raysim.core.{p.stem}" for p in (REPO_ROOT / "raysim" / "core").glob("*.py")]
    modules += [f"raysim.runtime.{p.stem}" for p in (REPO_ROOT / "raysim" / "runtime").glob("*.py")]
    code = (
        "import importlib, sys\n"
        f"for name in {sorted(m for m in modules if not m.endswith('__init__'))!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.startswith('raysim.algorithms')))\n"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert loaded.stdout.strip() == "[]"


@pytest.mark.ray
def test_a_tune_sweep_of_the_plugins_equals_a_local_run(plugin_dir, tmp_path):
    import csv

    import yaml

    raw = yaml.safe_load((plugin_dir / "everything.yaml").read_text())
    raw["run"].update(rounds=3, checkpoint_every=0)
    # the trial process trains (local backend inside the trial): the plug-ins must reach it
    # through the job's runtime env, the path a trial's own client tasks take too
    raw["runtime"] = {"backend": "local", "num_cpus": 2, "dashboard": False}
    (plugin_dir / "base.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    raw["tune"] = {
        "metric": "eval/accuracy",
        "allow_test_metric": True,  # compared with local runs' test accuracy
        "mode": "max",
        "scheduler": "fifo",
        "max_concurrent_trials": 1,
        # one trial: what is checked is that the plug-ins reach Tune's trial processes and
        # their workers (test_tune checks a sweep of several trials)
        "space": {"algorithm.max_norm": {"grid": [0.25]}},
    }
    (plugin_dir / "sweep.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    out = tmp_path / "sweep"
    result = _raysim(plugin_dir, "tune", "sweep.yaml", "--out", str(out))
    assert "sending plug-in code to the workers" in result.stdout
    with open(out / "tune_results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [float(r["algorithm.max_norm"]) for r in rows] == [0.25]
    assert all(r["status"] == "completed" for r in rows), rows
    for row in rows:
        local = tmp_path / f"local_{row['algorithm.max_norm']}"
        _raysim(plugin_dir, "run", "base.yaml", "--out", str(local), "--no-progress",
                "--set", "runtime.backend=local",
                "--set", f"algorithm.max_norm={row['algorithm.max_norm']}")  # fmt: skip
        _same_run(Path(row["out"]), local)


def test_extending_doc_shows_the_example_files_as_they_are():
    """docs/EXTENDING.md quotes every example plug-in and config verbatim: it cannot rot."""
    doc = (REPO_ROOT / "docs" / "EXTENDING.md").read_text()
    shown = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".yaml"))
    missing = [name for name in shown if (EXAMPLES / name).read_text().strip() not in doc]
    assert missing == []
