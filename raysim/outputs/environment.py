"""What produced a run and what it took: the versions, git commit, host and start time that
summary.json and config.yaml's header record, and the process's peak memory."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def run_environment() -> dict[str, Any]:
    """What produced a run: versions, the git commit of a raysim checkout, the host, the time."""
    from raysim import _version

    versions = {"raysim": _version.__version__, "python": platform.python_version()}
    for name in ("torch", "ray", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - an environment record never fails a run
            versions[name] = None
    commit = None
    source = Path(_version.__file__).resolve().parent  # the raysim package's folder
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
        commit = head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass  # not a checkout (an installed wheel) or no git
    gpus = 0
    try:
        import torch

        gpus = torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        pass
    return {
        **versions,
        "git_commit": commit,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
