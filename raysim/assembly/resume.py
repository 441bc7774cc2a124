"""Resuming a stopped run: which checkpoint to continue from (the newest usable one, its
metrics records checked against it), whether the config may continue it (only the round
count and the runtime may change), and whether the folder's plug-in code is trusted."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raysim import config as config_module
from raysim.config import Config
from raysim.core.state import ServerState
from raysim.errors import RaysimError
from raysim.outputs.checkpoints import (
    check_state,
    checkpoint_metadata,
    checkpoint_paths,
    load_checkpoint,
)
from raysim.outputs.identity import config_changes, config_fingerprint, written_fingerprint
from raysim.outputs.records import resume_records
from raysim.plugins import import_paths_in


def check_resume_config(out_dir: str | Path, config: Config) -> None:
    """Refuse to resume `out_dir` with a config that differs from the one its run was written
    with, except in `outputs.RESUMABLE_KEYS` (the round count, the runtime): an edited
    config.yaml would otherwise continue as a silent hybrid of two runs. Compared with the
    config stored in the newest readable checkpoint, else with the fingerprint in
    config.yaml's header (a run stopped before its first checkpoint)."""
    out_dir = Path(out_dir)
    allowed = "a resume may change only run.rounds (--set run.rounds=N) and runtime.*"
    for path in reversed(checkpoint_paths(out_dir / "checkpoints")):
        try:
            written = checkpoint_metadata(path).get("config")
        except RaysimError:
            continue  # damaged: find_resume_point reports it and falls back
        if isinstance(written, dict):
            changes = config_changes(written, config)
            if changes:
                raise RaysimError(
                    f"cannot resume {out_dir}: its config differs from the one checkpoint "
                    f"{path.name} was written with ({'; '.join(changes)}); {allowed}"
                )
            return
        break
    fingerprint = written_fingerprint(out_dir / "config.yaml")
    if fingerprint is not None and fingerprint != config_fingerprint(config):
        raise RaysimError(
            f"cannot resume {out_dir}: {out_dir / 'config.yaml'} was edited after the run "
            f"started (its config_fingerprint {fingerprint} no longer matches); {allowed}"
        )


def find_resume_point(
    out_dir: str | Path, template: ServerState | None = None
) -> tuple[ServerState | None, list[dict[str, Any]]]:
    """The newest usable checkpoint (`newest_usable_checkpoint`) and the metrics records of
    the rounds it covers, checked against it (raysim.outputs.records.resume_records: every
    round up to it once, whole and in order, else refused). With no usable checkpoint:
    (None, []), the run starts again from round 0, whose state is a function of the seed.
    """
    out_dir = Path(out_dir)
    state = newest_usable_checkpoint(out_dir, template)
    if state is not None:
        records = resume_records(out_dir / "metrics.jsonl", state.round)
        print(
            f"raysim: resuming {out_dir} from its checkpoint of round {state.round}: the next "
            f"round is {state.round + 1}",
            file=sys.stderr,
            flush=True,
        )
        return state, records
    if not (out_dir / "config.yaml").is_file():
        raise RaysimError(f"cannot resume {out_dir}: it holds no run (no config.yaml)")
    print(
        f"raysim: no usable checkpoint in {out_dir / 'checkpoints'}: starting again from "
        "round 0 (its state comes from the seed)",
        file=sys.stderr,
        flush=True,
    )
    return None, []


def newest_usable_checkpoint(
    out_dir: str | Path, template: ServerState | None = None
) -> ServerState | None:
    """The state of the newest usable checkpoint in `out_dir` (None: none is).

    A checkpoint that cannot be read (e.g. truncated, or renamed: its name and contents
    disagree on the round) or, given the run's initial state `template`, whose arrays are not
    the run's (missing, wrong shape or dtype, non-finite) is reported and the previous one
    used. None: a run stopped before its first checkpoint, or `checkpoint_every: 0`.
    """
    for path in reversed(checkpoint_paths(Path(out_dir) / "checkpoints")):
        try:
            state, _ = load_checkpoint(path)
            problem = None if template is None else check_state(state, template)
            if problem is not None:
                raise RaysimError(f"checkpoint {path} cannot continue this run: {problem}")
        except RaysimError as error:
            print(f"raysim: skipping checkpoint: {error}", file=sys.stderr, flush=True)
            continue
        return state
    return None


def resume_config(
    out_dir: str | Path, overrides: Sequence[str] = (), trust_plugins: bool = False
) -> Config:
    """The config a resume of `out_dir` continues with: its config.yaml plus `overrides`, which
    may set only what a resume may change: `run.rounds=N` (extends the run) and `runtime.*`. A
    folder whose config names plug-ins by import path (`module:attr`) resumes only with
    `trust_plugins=True` (`--trust-plugins`): the folder may be someone else's, and resuming
    imports and runs that code."""
    if not (Path(out_dir) / "config.yaml").is_file():
        raise RaysimError(f"cannot resume {out_dir}: it holds no run (no config.yaml)")
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key != "run.rounds" and not key.startswith("runtime."):
            raise RaysimError(
                f"--set {override}: a resume may change only run.rounds and runtime.* (the "
                "rest would make a hybrid of two runs); start a new run for other settings"
            )
    # Read unresolved first: nothing the folder names is imported before it is trusted.
    config_path = Path(out_dir) / "config.yaml"
    named = import_paths_in(config_module.load(config_path, overrides, resolve_plugins=False))
    if named and not trust_plugins:
        raise RaysimError(
            f"cannot resume {out_dir}: its config names plug-in code by import path "
            f"({', '.join(named)}), which resuming would import and run; if you trust that "
            "code, resume with --trust-plugins (Python: trust_plugins=True)"
        )
    return config_module.load(config_path, overrides)
