"""What makes a run the run it is: the config keys a resume must not change, their short
fingerprint (written in the header of OUT/config.yaml, so a resume spots an edited config),
and the list of changes that refuses a resume. Computed once per run (`run_identity`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from raysim.config import Config

# What may differ between the config a run was written with and the one it resumes with: the
# round count (`--resume DIR --set run.rounds=N` extends a run) and where it runs (`runtime`:
# backend, Ray address, CPUs; results do not depend on them). Any other change would make a
# silent hybrid of two runs.
RESUMABLE_KEYS = ("run.rounds", "runtime.")

_FINGERPRINT_LINE = "# config_fingerprint: "


@dataclasses.dataclass(frozen=True)
class RunIdentity:
    """A run's config in the forms its outputs write, each computed once."""

    config: dict[str, Any]  # Config.to_dict(): what every checkpoint carries
    keys: dict[str, Any]  # resume_identity(config): TensorBoard's hparams
    fingerprint: str  # of `keys`: config.yaml's header


def run_identity(config: Config) -> RunIdentity:
    raw = config.to_dict()
    keys = resume_identity(raw)
    return RunIdentity(raw, keys, _fingerprint(keys))


def resume_identity(config: Config | dict[str, Any]) -> dict[str, Any]:
    """The config's keys (flattened, `section.key`) that a resume must not change."""
    raw = config.to_dict() if isinstance(config, Config) else config
    raw = json.loads(json.dumps(raw, default=str))  # as stored in checkpoint metadata
    flat = {
        f"{section}.{key}": value
        for section, values in raw.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }
    return {
        key: value
        for key, value in flat.items()
        if not any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS)
    }


def _fingerprint(identity: dict[str, Any]) -> str:
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def config_fingerprint(config: Config | dict[str, Any]) -> str:
    """A short hash of `resume_identity(config)`."""
    return _fingerprint(resume_identity(config))


def config_changes(old: dict[str, Any], new: Config) -> list[str]:
    """`key: old -> new` for every key a resume must not change that differs."""
    before, after = resume_identity(old), resume_identity(new)
    return [
        f"{key}: {before.get(key, '(unset)')!r} -> {after.get(key, '(unset)')!r}"
        for key in sorted(set(before) | set(after))
        if before.get(key) != after.get(key)
    ]


def config_header(environment: dict[str, Any], fingerprint: str) -> str:
    """What produced the run and its fingerprint as comment lines heading config.yaml (which
    stays a plain, loadable config)."""
    lines = {**environment, "config_fingerprint": fingerprint}
    return "".join(f"# {key}: {value}\n" for key, value in lines.items())


def written_fingerprint(config_path: Path) -> str | None:
    """The config fingerprint in the header of a run's config.yaml (None: not there)."""
    for line in config_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith(_FINGERPRINT_LINE):
            return line.removeprefix(_FINGERPRINT_LINE).strip()
    return None
