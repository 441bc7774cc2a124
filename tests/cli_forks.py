"""`python -m raysim.cli ARGS` in a subprocess, without paying for its imports each time.

A CLI process spends ~2.5 s of CPU importing torch, numpy and raysim before it reads its
arguments, and the suite runs the CLI dozens of times (the first-hour checks, the one-line
errors, plug-ins run from a user's folder). Run as a script, this file is a fork server: it
imports `raysim.cli` once and forks one child per request. The child is a fresh CLI process in
everything a test observes (its own pid, working directory, environment, stdin from /dev/null,
stdout and stderr, exit code, atexit handlers), minus the import.

Fork is safe here because the server stays pristine: importing raysim.cli imports torch but not
Ray, runs no torch op and starts no thread (checked at start: the server refuses to run with
more than one thread), and the server does nothing but fork and wait.

A call whose environment changes what the interpreter reads only at start-up (PYTHONPATH,
PYTHONHASHSEED, any PYTHON* variable but PYTHONWARNINGS, which the child applies itself) runs
as a plain subprocess instead: a forked child could not honour it.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

# Interpreter start-up settings a forked child applies itself; any other PYTHON* variable
# that differs from the server's makes the call a plain subprocess. PYTHONBREAKPOINT is read
# by sys.breakpointhook at each breakpoint(), not at start-up, so the child's environment
# already governs it. ray.init sets it in the test process's environment; counted as a
# start-up setting, it would make every later CLI call of that process a plain subprocess
# (~3 s of imports each).
_APPLIED_IN_CHILD = {"PYTHONWARNINGS", "PYTHONBREAKPOINT"}

# Libraries a run imports lazily (the digits loader's scikit-learn, the curves' matplotlib,
# TensorBoard's writer): ~3 s of CPU per CLI run that reaches training, on two cores. Importing
# them starts no thread (checked below) and runs no OpenMP region, so forking stays safe. Not
# Ray: it reads its RAY_* variables when imported, and a child's own (the cluster tests' auth
# settings) must count.
_SHARED_LIBRARIES = (
    "sklearn.datasets",
    "sklearn.model_selection",
    "matplotlib.backends.backend_agg",
    "matplotlib.pyplot",
    "torch.utils.tensorboard",
)


def _serve() -> dict:
    """The server's loop: one JSON request a line on stdin; for each, fork, reply with the
    child's pid, wait for it, reply with its exit code. Returns the request in the child."""
    # The repository first, as for `python -m raysim.cli` run from its root: the raysim the
    # tests import is the one the children run.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    import raysim.cli  # noqa: F401 - the import every child shares

    for name in _SHARED_LIBRARIES:  # what most runs import later: paid once, not per child
        importlib.import_module(name)
    if threading.active_count() != 1:  # a thread would not survive fork; nothing may start one
        raise SystemExit("cli_forks: importing raysim.cli started a thread; cannot fork safely")
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)  # the server's own output goes nowhere: fd 1 is the children's
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            return request
        replies.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    raise SystemExit(0)


def _child(request: dict) -> None:
    """Become `python -m raysim.cli ARGS` as the request describes, and run it."""
    import warnings

    import raysim.cli

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if request["env"].get("PYTHONWARNINGS"):
        warnings.resetwarnings()
        for option in request["env"]["PYTHONWARNINGS"].split(","):
            warnings._setoption(option)  # how the interpreter applies -W / PYTHONWARNINGS
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [raysim.cli.__file__, *request["args"]]  # as under `python -m raysim.cli`
    sys.path[0] = os.getcwd()  # `-m` puts the working directory first
    sys.exit(raysim.cli.main(request["args"]))


class ForkedCli:
    """The client side: `run(args, cwd, env, timeout)` -> subprocess.CompletedProcess, as
    `subprocess.run([python, -m, raysim.cli, *args], capture_output=True, text=True)`."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._folder = Path(tempfile.mkdtemp(prefix="raysim-cli-forks-"))
        self._calls = 0
        self._startup_env = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}

    def _start(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        return self._server

    def _forkable(self, env: Mapping[str, str]) -> bool:
        python = {k: v for k, v in env.items() if k.startswith("PYTHON")}
        startup = {k: v for k, v in self._startup_env.items() if k not in _APPLIED_IN_CHILD}
        return {k: v for k, v in python.items() if k not in _APPLIED_IN_CHILD} == startup

    def run(
        self,
        args: Sequence[str],
        *,
        cwd: str | os.PathLike,
        env: Mapping[str, str],
        timeout: float,
    ) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "raysim.cli", *map(str, args)]
        if not self._forkable(env):
            return subprocess.run(
                command, cwd=cwd, env=dict(env), capture_output=True, text=True, timeout=timeout
            )
        self._calls += 1
        stdout = self._folder / f"{self._calls}.out"
        stderr = self._folder / f"{self._calls}.err"
        request = {
            "args": [str(a) for a in args],
            "cwd": str(cwd),
            "env": dict(env),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        server = self._start()
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        pid = json.loads(server.stdout.readline())["pid"]
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        timed_out = not ready
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        reply = server.stdout.readline()
        if not reply:
            raise RuntimeError("cli_forks: the fork server ended unexpectedly")
        returncode = json.loads(reply)["returncode"]
        out, err = _read_text(stdout), _read_text(stderr)
        stdout.unlink(missing_ok=True)
        stderr.unlink(missing_ok=True)
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(command, returncode, out, err)

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.stdin.close()
            self._server.wait(timeout=30)
        for leftover in self._folder.glob("*"):
            leftover.unlink()
        self._folder.rmdir()


def _read_text(path: Path) -> str:
    """A file's text as subprocess.run(text=True) gives a pipe's: universal newlines."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return ""
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    _child(_serve())
