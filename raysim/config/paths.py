"""Relative paths of a config, resolved once when it is loaded, so that they mean the same
wherever they are used: the driver, a worker of raysim's own Ray, a worker of a cluster joined
with `--address auto` (whose working directory is wherever its node was started), or a job.

A relative path is relative to the directory raysim is run from (the shell's working
directory, like any command's path arguments), not to the config file's folder: a config in
configs/ naming `data/x` reads ./data/x. Under `ray job submit --working-dir DIR` the job runs
in Ray's copy of DIR, and every worker of the job in its own node's copy of it: there
relative paths stay relative, which is the one form that names the same file on every node
(an absolute path into one node's copy does not exist on the others)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

# The config's path fields: (section, key).
PATH_FIELDS = (("data", "root"), ("partition", "cache_dir"))


def in_job_working_dir(cwd: Path | None = None) -> bool:
    """Whether this process runs in Ray's unpacked copy of a job's working directory
    (`<ray temp dir>/session_*/runtime_resources/working_dir_files/_ray_pkg_*`)."""
    parts = (cwd or Path.cwd()).parts
    return "runtime_resources" in parts and "working_dir_files" in parts


def resolve_config_paths(config, base: Path | None = None):
    """`config` with its relative path fields made absolute against `base` (default: the
    working directory); unchanged in a job's working directory (see above)."""
    if base is None:
        if in_job_working_dir():
            return config
        base = Path.cwd()
    changes: dict[str, dict[str, str]] = {}
    for section_name, key in PATH_FIELDS:
        section = getattr(config, section_name, None)
        value = getattr(section, key, None)
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            changes.setdefault(section_name, {})[key] = str(base / value)
        elif isinstance(value, str) and value.startswith("~"):
            changes.setdefault(section_name, {})[key] = os.path.expanduser(value)
    if not changes:
        return config
    sections = {
        name: dataclasses.replace(getattr(config, name), **values)
        for name, values in changes.items()
    }
    return dataclasses.replace(config, **sections)


# Ray skips, when it uploads a job's working directory, whatever a `.rayignore` of a folder
# matches: `*` in a run folder keeps that run (checkpoints included) off every later
# `ray job submit --working-dir` of a folder holding it.
RAYIGNORE = ".rayignore"


def keep_out_of_uploads(out_dir: Path) -> None:
    """Mark a run folder as never uploaded with a job (best effort: a run is not refused for
    a folder it cannot mark; the folder's write check has already passed)."""
    path = Path(out_dir) / RAYIGNORE
    if not path.exists():
        try:
            path.write_text("# a raysim run folder: not uploaded by ray job submit\n*\n")
        except OSError:
            pass


def job_out_dir(out: str) -> str:
    """Where a run's outputs go: `out` itself, except for a relative `out` inside a Ray job's
    working directory (Ray's temporary copy, which Ray deletes with its cluster session):
    there, under ~/raysim-runs/ of the node the job's driver runs on, said in one line."""
    if os.path.isabs(os.path.expanduser(out)) or not in_job_working_dir():
        return os.path.expanduser(out)
    import socket
    import sys

    target = Path.home() / "raysim-runs" / out
    print(
        f"raysim: running as a Ray job in Ray's temporary copy of the working directory; "
        f"outputs go to {socket.gethostname()}:{target} (an absolute --out chooses another "
        f"folder)",
        file=sys.stderr,
        flush=True,
    )
    return str(target)
