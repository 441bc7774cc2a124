"""Corpus cases for what a run reads besides datasets: config files and overrides, checkpoints
and run folders (resume), and client messages arriving at the server."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np

from raysim import config as config_module
from raysim.core.state import RoundInfo, WireUpdate

from . import Case

REPO_ROOT = Path(__file__).resolve().parents[2]
DIGITS = REPO_ROOT / "configs" / "fedavg_digits.yaml"
SMALL = (
    "runtime.backend=local",
    "partition.num_clients=8",
    "clients.per_round=4",
    "run.rounds=1",
    "model.hidden=[16]",
)

# --- config files and overrides -------------------------------------------------------------


def _config_text(text: str | bytes, name: str) -> Case:
    def run(folder: Path) -> str:
        path = folder / "config.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        config_module.load(path)
        return "accepted"  # the runner reports an accepted hostile config as a defect

    return Case(f"config/{name}", run)


def _override(overrides: list[str], name: str) -> Case:
    def run(folder: Path) -> str:
        config_module.load(DIGITS, overrides)
        return "accepted"

    return Case(f"override/{name}", run)


ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
    f"*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)}]\n"
    for i in range(8)
)

CONFIG_CASES = [
    _config_text(ALIAS_BOMB, "yaml-alias-bomb"),
    _config_text("run: " + "[" * 5000 + "]" * 5000 + "\n", "deeply-nested-lists"),
    _config_text("- run\n- data\n", "a-list-not-a-mapping"),
    _config_text("runn:\n  rounds: 3\n", "unknown-section"),
    _config_text("run:\n  roundz: 3\n", "unknown-key"),
    _config_text(bytes(range(256)) * 8, "binary-garbage"),
    _config_text(b"run:\n  name: \xff\xfe\n", "not-utf8"),
    _config_text("run:\n  rounds: " + "9" * 400 + "\n", "integer-of-400-digits"),
    _config_text("clients:\n  lr: .nan\n", "nan-learning-rate"),
    _config_text("run:\n  rounds: -4\n", "negative-rounds"),
    _config_text("run:\n  rounds: many\n", "rounds-not-a-number"),
    _config_text("algorithm:\n  name: fedavgg\n", "unknown-algorithm"),
    _config_text("algorithm:\n  name: no_such_module_xyz:Thing\n", "plugin-module-missing"),
    _config_text("algorithm:\n  name: os:sep\n", "plugin-not-callable"),
    # Callables that are not plug-ins: a config names only declared plug-ins (raysim.plugins).
    _config_text("algorithm:\n  name: subprocess:call\n", "plugin-name-runs-a-program"),
    _config_text("algorithm:\n  name: builtins:exit\n", "plugin-name-exits"),
    _config_text(
        "data:\n  name: doctest:debug_script\n  root: \"open('PWNED', 'w')\"\n",
        "plugin-name-runs-code",
    ),
    _config_text("model:\n  name: raysim.cli:main\n", "plugin-name-not-declared"),
    _config_text("run:\n\trounds: 3\n", "tab-indentation"),
    _config_text("run:\n  seed: 2026-12-01\n", "a-date-for-the-seed"),
    _config_text("partition:\n  num_clients: 4\nclients:\n  per_round: 10\n", "per-round-over"),
    _config_text("run:\n  name: ../../etc\n", "run-name-with-slash"),
    _config_text("{1: 2}\n", "non-string-key"),
    _config_text("run: !!python/object/apply:os.system ['true']\n", "python-object-tag"),
    _config_text("x" * (5 * 2**20), "5-MB-scalar"),
    _override(["clients.lr"], "no-equals-sign"),
    _override(["clients.lrr=0.1"], "unknown-key"),
    _override(["clients.lr=[1, 2"], "unclosed-bracket"),
    _override(["run.rounds=1e400"], "overflowing-float"),
]


def _model(overrides: list[str], name: str) -> Case:
    """A model option that only the model's build can judge (as a run's start does)."""

    def run(folder: Path) -> str:
        from raysim.assembly import plan_run
        from raysim.models.vector import build_model

        cfg = config_module.load(DIGITS, [*SMALL, *overrides])
        build_model(plan_run(cfg, _digits()).ctx)
        return "accepted"

    return Case(f"model/{name}", run)


def _dataset(config_name: str, overrides: list[str], name: str) -> Case:
    """Options a data generator judges when the run loads its data."""

    def run(folder: Path) -> str:
        from raysim.data.datasets import load_dataset

        load_dataset(config_module.load(REPO_ROOT / "configs" / config_name, overrides))
        return "accepted"

    return Case(f"data/{name}", run)


CONFIG_CASES += [
    _dataset(
        "fedavg_digits.yaml",
        ["data.name=synthetic_classification", "data.num_samples=1000000000000"],
        "a-trillion-synthetic-samples",
    ),
    _dataset(
        "fedavg_digits.yaml",
        ["data.name=synthetic_classification", "data.sample_shape=[100000, 100000]"],
        "a-ten-billion-value-sample",
    ),
    _dataset("flag_flag.yaml", ["data.num_samples=1000000000"], "a-billion-multilabel-samples"),
    _dataset("fedaws_synthetic_xml.yaml", ["data.num_labels=1000000000000"], "1e12-xml-labels"),
    _dataset("fedaws_synthetic_xml.yaml", ["data.num_train=10000000000"], "1e10-xml-points"),
    _dataset(
        "fedaws_synthetic_xml.yaml", ["data.features_per_point=1e9"], "1e9-features-per-xml-point"
    ),
    _model(["model.hidden=[-3]"], "negative-hidden-size"),
    _model(["model.hidden=[0]"], "zero-hidden-size"),
    _model(["model.hidden=[16, 2.5]"], "fractional-hidden-size"),
    _model(["model.hidden=[1000000000000]"], "a-trillion-hidden-units"),
    _model(["model.hidden=[100000, 100000]"], "ten-billion-parameters"),
    _model(["model.name=lenet"], "lenet-on-flat-digits"),
]


def _config_is(kind: str) -> Case:
    def run(folder: Path) -> str:
        target = folder / "config.yaml"
        if kind == "directory":
            target.mkdir()
        else:
            os.mkfifo(target)
        config_module.load(target)
        return "accepted"

    return Case(f"config/file-is-a-{kind}", run, timeout_s=10)


CONFIG_CASES += [_config_is("directory"), _config_is("fifo")]

# --- checkpoints and run folders -------------------------------------------------------------


def _checkpoint_bytes(arrays: dict, meta: dict | bytes | None, compressed: bool = False) -> bytes:
    members = dict(arrays)
    if meta is not None:
        raw = meta if isinstance(meta, bytes) else json.dumps(meta).encode()
        members["__raysim_meta__"] = np.frombuffer(raw, dtype=np.uint8)
    buffer = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buffer, **members)
    return buffer.getvalue()


def _npy_member(header_shape: tuple[int, ...], payload: bytes) -> bytes:
    """A .npy member whose header claims `header_shape` but which holds only `payload`."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": "<f4", "fortran_order": False, "shape": header_shape}
    )
    return buffer.getvalue() + payload


def _zip(members: dict[str, bytes], compression=zipfile.ZIP_STORED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


GOOD_META = {"round": 1}
PARAMS = {"params": np.zeros(8, dtype=np.float32)}


def _checkpoint(data: bytes | None, name: str, file_name: str = "round_000001.npz") -> Case:
    """`load_checkpoint` of a hostile file (as resume reads it)."""

    def run(folder: Path) -> str:
        from raysim.outputs.checkpoints import load_checkpoint

        path = folder / file_name
        if data is None:
            os.mkfifo(path)
        else:
            path.write_bytes(data)
        load_checkpoint(path)
        return "accepted"

    return Case(f"checkpoint/{name}", run, timeout_s=10)


def _bomb_zip() -> bytes:
    """A 10 KB deflated member that inflates to 200 MB."""
    return _zip(
        {"params.npy": _npy_member((50_000_000,), bytes(200_000_000)), "__raysim_meta__.npy": b""},
        zipfile.ZIP_DEFLATED,
    )


CHECKPOINT_CASES = [
    _checkpoint(b"", "empty-file"),
    _checkpoint(os.urandom(4096), "random-bytes"),
    _checkpoint(_checkpoint_bytes(PARAMS, GOOD_META)[:-100], "truncated"),
    _checkpoint(_checkpoint_bytes(PARAMS, None), "no-metadata"),
    _checkpoint(_checkpoint_bytes(PARAMS, b"\xff{not json"), "metadata-not-json"),
    _checkpoint(_checkpoint_bytes(PARAMS, [1, 2]), "metadata-a-list"),
    _checkpoint(_checkpoint_bytes(PARAMS, {"rnd": 1}), "metadata-without-round"),
    _checkpoint(_checkpoint_bytes(PARAMS, {"round": "x"}), "round-not-a-number"),
    _checkpoint(_checkpoint_bytes(PARAMS, {"round": 7}), "round-disagrees-with-name"),
    _checkpoint(
        _zip({"params.npy": _npy_member((10**12,), b"\0" * 64), "__raysim_meta__.npy": b""}),
        "header-claims-4-TB",
    ),
    _checkpoint(_bomb_zip(), "deflate-bomb"),
    _checkpoint(_checkpoint_bytes(PARAMS, GOOD_META, compressed=True), "compressed-members"),
    _checkpoint(_zip({"params.pkl": b"\x80\x04K\x01.", "x.npy": b""}), "non-npy-member"),
    _checkpoint(
        _checkpoint_bytes({"params": np.array([{"a": 1}], dtype=object)}, GOOD_META),
        "pickled-object-array",
    ),
    _checkpoint(None, "a-fifo"),
]


def _resume_folder(name: str, prepare, expect_line: str | None = None) -> Case:
    """A run folder prepared by `prepare(folder, out)`; then `raysim run --resume` of it: it
    must raise, or skip the bad checkpoint with a line containing `expect_line`."""

    def run(folder: Path) -> str:
        import contextlib

        from raysim.assembly import resume

        out = folder / "run"
        shutil.copytree(_template_run(), out)
        prepare(folder, out)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            resume(out, progress=False, tensorboard=False)
        lines = [line for line in stderr.getvalue().splitlines() if line.startswith("raysim:")]
        if expect_line is None or not any(expect_line in line for line in lines):
            return "accepted"
        return next(line for line in lines if expect_line in line)

    return Case(f"resume/{name}", run)


def _resume_past_a_fifo() -> Case:
    """A FIFO named like the newest checkpoint hung the resume: it is not a checkpoint, so the
    resume continues from the newest real one (round 1) and ends like an uninterrupted run."""

    def run(folder: Path) -> str:
        from raysim.assembly import resume
        from raysim.outputs.checkpoints import load_checkpoint

        whole, _ = load_checkpoint(_template_run() / "checkpoints" / "round_000002.npz")
        out = folder / "run"
        shutil.copytree(_template_run(), out)
        _fifo_checkpoint(folder, out)
        result = resume(out, progress=False, tensorboard=False)
        same = np.array_equal(result.state.arrays["params"], whole.arrays["params"])
        return "the FIFO was passed over; resumed from round 1" if same else "accepted"

    return Case("resume/fifo-named-as-checkpoint", run)


def _edit_config(key: str, value) -> callable:
    def prepare(folder: Path, out: Path) -> None:
        import yaml

        raw = yaml.safe_load((out / "config.yaml").read_text())
        section, name = key.split(".")
        raw[section][name] = value
        (out / "config.yaml").write_text(yaml.safe_dump(raw))

    return prepare


def _replace_newest(data_of) -> callable:
    def prepare(folder: Path, out: Path) -> None:
        from raysim.outputs.checkpoints import load_checkpoint

        newest = out / "checkpoints" / "round_000002.npz"
        state, meta = load_checkpoint(newest)
        newest.write_bytes(data_of(state, meta))

    return prepare


def _nan_state(state, meta):
    return _checkpoint_bytes({k: np.full_like(v, np.nan) for k, v in state.arrays.items()}, meta)


def _short_state(state, meta):
    return _checkpoint_bytes({k: v[:-1] for k, v in state.arrays.items()}, meta)


def _fifo_checkpoint(folder: Path, out: Path) -> None:
    (out / "checkpoints" / "round_000002.npz").unlink()
    os.mkfifo(out / "checkpoints" / "round_000003.npz")


def _remove(name: str) -> callable:
    return lambda folder, out: (out / name).unlink()


RESUME_CASES = [
    _resume_folder("edited-learning-rate", _edit_config("clients.lr", 0.5)),
    _resume_folder("edited-seed", _edit_config("run.seed", 9)),
    _resume_folder("edited-client-count", _edit_config("partition.num_clients", 6)),
    _resume_folder("nan-checkpoint", _replace_newest(_nan_state), "cannot continue this run"),
    _resume_folder("short-checkpoint", _replace_newest(_short_state), "cannot continue this run"),
    _resume_folder(
        "renamed-checkpoint",
        _replace_newest(lambda state, meta: _checkpoint_bytes(state.arrays, {**meta, "round": 1})),
        "but its name says round 2",
    ),
    _resume_past_a_fifo(),
    _resume_folder("no-config-yaml", _remove("config.yaml")),
]


def _out_dir(name: str, prepare) -> Case:
    def run(folder: Path) -> str:
        from raysim.assembly import run as run_simulation

        out = prepare(folder)
        cfg = config_module.load(DIGITS, list(SMALL))
        run_simulation(cfg, out, progress=False, tensorboard=False)
        return "accepted"

    return Case(f"out/{name}", run)


def _out_is_a_file(folder: Path) -> Path:
    (folder / "out").write_text("")
    return folder / "out"


def _out_holds_a_run(folder: Path) -> Path:
    from raysim.assembly import run as run_simulation

    run_simulation(
        config_module.load(DIGITS, list(SMALL)), folder / "out", progress=False, tensorboard=False
    )
    return folder / "out"


OUT_CASES = [
    _out_dir("out-is-a-file", _out_is_a_file),
    _out_dir("parent-is-a-file", lambda folder: _out_is_a_file(folder) / "run"),
    _out_dir("holds-another-run", _out_holds_a_run),
]

# --- client messages ---------------------------------------------------------------------------


_MADE: dict[str, object] = {}  # made once, in the runner's process, by `warm`


def _template_run() -> Path:
    """A finished 2-round digits run (checkpoints after rounds 1 and 2) to copy and spoil.
    Made in a subprocess: the runner forks its cases from a process that must not have run
    torch (a forked child of a process whose OpenMP threads started hangs in its first
    parallel region)."""
    if "run" not in _MADE:
        import subprocess
        import sys
        import tempfile

        out = Path(tempfile.mkdtemp(prefix="corpus-template-")) / "run"
        overrides = [*SMALL, "run.rounds=2", "run.checkpoint_every=1"]
        script = (
            "import sys; from raysim import config; from raysim.assembly import run; "
            f"run(config.load({str(DIGITS)!r}, {overrides!r}), sys.argv[1], progress=False, "
            "tensorboard=False)"
        )
        subprocess.run(
            [sys.executable, "-c", script, str(out)], check=True, capture_output=True, timeout=300
        )
        _MADE["run"] = out
    return _MADE["run"]


def _digits():
    """The digits dataset of SMALL's config (numpy only: safe to make before forking)."""
    if "dataset" not in _MADE:
        from raysim.data.datasets import load_dataset

        _MADE["dataset"] = load_dataset(config_module.load(DIGITS, list(SMALL)))
    return _MADE["dataset"]


def _first_round():
    """A local backend and one valid update per sampled client (a zero delta: the checks
    look at the message's form, not at what training would have made of it)."""
    from raysim.assembly import plan_run
    from raysim.runtime.local import LocalBackend
    from raysim.seeds import sample_clients

    cfg = config_module.load(DIGITS, list(SMALL))
    dataset = _digits()
    plan = plan_run(cfg, dataset)
    split = plan.split
    backend = LocalBackend(plan.ctx, dataset, split)
    ids = sample_clients(cfg.run.seed, 0, split.num_clients, cfg.clients.per_round)
    size = backend.server.layout.size
    updates = [
        WireUpdate(
            client_id=int(client),
            num_samples=int(split.offsets[client + 1] - split.offsets[client]),
            message=np.zeros(size, dtype=np.float32),
            metrics={"loss": 1.0},
        )
        for client in ids
    ]
    return backend, ids, updates


def warm() -> None:
    """Called by the runner before it forks: what every case shares is made once (without
    running torch in the runner's process)."""
    _template_run()
    _digits()


def _message_case(name: str, spoil) -> Case:
    """One round of the digits run where client updates[0] is replaced by `spoil(update)` (a
    list of updates: several may be sent). The server must refuse it with a rejection line."""

    def run(folder: Path) -> str:
        backend, ids, updates = _first_round()
        server = backend.server
        server.start_round(RoundInfo(0, ids))
        server.add([*spoil(updates[0], ids), *updates[1:]])
        stats = server.finish_round(evaluate=False)
        if not stats.rejected:
            return "accepted"
        return stats.rejected[0]

    return Case(f"message/{name}", run)


def _with(**changes):
    return lambda update, ids: [dataclasses.replace(update, **changes)]


def _vector(edit):
    def spoil(update, ids):
        message = np.array(update.message, copy=True)
        return [dataclasses.replace(update, message=edit(message))]

    return spoil


def _set(index, value):
    def edit(message):
        message[index] = value
        return message

    return edit


MESSAGE_CASES = [
    _message_case("nan-entry", _vector(_set(3, np.nan))),
    _message_case("inf-entry", _vector(_set(3, np.inf))),
    _message_case("3e38-entry", _vector(_set(0, 3e38))),
    _message_case("one-entry-short", _vector(lambda m: m[:-1])),
    _message_case("float64", _vector(lambda m: m.astype(np.float64))),
    _message_case("int32", _vector(lambda m: m.astype(np.int32))),
    _message_case("2-d", _vector(lambda m: m.reshape(1, -1))),
    _message_case("a-list", _with(message=[0.0] * 8)),
    _message_case("none", _with(message=None)),
    _message_case("a-dict", _with(message={"values": np.zeros(3, np.float32)})),
    _message_case("negative-samples", _with(num_samples=-5)),
    _message_case("1e30-samples", _with(num_samples=10**30)),
    _message_case("fractional-samples", _with(num_samples=2.5)),
    _message_case("bool-samples", _with(num_samples=True)),
    _message_case("loss-a-string", _with(metrics={"loss": "low"})),
    _message_case("loss-a-list", _with(metrics={"loss": [1.0]})),
    _message_case("stats-nan", _with(stats={"label_counts": float("nan")})),
    _message_case("unsampled-client", lambda u, ids: [dataclasses.replace(u, client_id=7919)]),
    _message_case("duplicate-client", lambda u, ids: [u, u]),
    _message_case("client-id-a-string", _with(client_id="0")),
]

CASES: list[Case] = CONFIG_CASES + CHECKPOINT_CASES + RESUME_CASES + OUT_CASES + MESSAGE_CASES
