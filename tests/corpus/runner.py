"""Run every corpus case in a forked child of one process that has imported what a run imports;
print one JSON line per case: its name, how it ended, its message, the child's peak RSS, the
bytes of input it wrote, and its seconds. tests/test_hostile_corpus.py judges the lines.

python -c "import sys; sys.path.insert(0, 'tests'); from corpus.runner import main; main()"
(main(["message/", "resume/"]) runs the cases whose names start so.)
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import resource
import shutil
import signal
import tempfile
import time
import traceback
from pathlib import Path

import corpus


def all_cases(warm: bool = False) -> list[corpus.Case]:
    """Every module's CASES; with `warm`, each module's `warm()` (if any) first makes what its
    cases share, in this process, so that each forked child starts with it."""
    cases = []
    for module in pkgutil.iter_modules(corpus.__path__):
        if module.name != "runner":
            loaded = importlib.import_module(f"corpus.{module.name}")
            if warm and hasattr(loaded, "warm"):
                loaded.warm()
            cases += loaded.CASES
    names = [case.name for case in cases]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise SystemExit(f"corpus: duplicate case names {duplicates}")
    return cases


def _folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def _in_child(case: corpus.Case, write_fd: int) -> None:
    """Run the case; report through `write_fd`; never return."""
    from raysim.errors import RaysimError

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the case's progress lines would mix with the report
    os.dup2(devnull, 2)
    folder = Path(tempfile.mkdtemp(prefix="corpus-"))
    started = time.perf_counter()
    try:
        message = case.run(folder)
        kind = "accepted" if message == "accepted" else "refused"
    except RaysimError as error:
        kind, message = "error", str(error)
    except BaseException:  # noqa: BLE001 - the defect being looked for
        kind, message = "crash", traceback.format_exc()[-3000:]
    seconds = time.perf_counter() - started
    # The input is what the case wrote; a run's own outputs (a subfolder 'run'/'whole'/'out'
    # the case made by running raysim) are not input.
    input_bytes = sum(
        path.stat().st_size for path in folder.iterdir() if path.is_file() and not path.is_symlink()
    )
    report = {
        "name": case.name,
        "kind": kind,
        "message": str(message)[:3000],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "input_bytes": input_bytes,
        "all_bytes": _folder_bytes(folder),
        "seconds": seconds,
    }
    shutil.rmtree(folder, ignore_errors=True)
    os.write(write_fd, json.dumps(report).encode())
    os._exit(0)


def run_case(case: corpus.Case) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _in_child(case, write_fd)
    os.close(write_fd)
    os.set_blocking(read_fd, False)
    chunks, deadline = [], time.monotonic() + case.timeout_s
    while True:
        try:
            chunk = os.read(read_fd, 65536)
            if chunk:
                chunks.append(chunk)
        except BlockingIOError:
            pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read_fd)
            return {"name": case.name, "kind": "hang", "message": f"> {case.timeout_s} s"}
        time.sleep(0.005)
    os.set_blocking(read_fd, True)
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    if not chunks:
        return {"name": case.name, "kind": "died", "message": f"wait status {status}"}
    return json.loads(b"".join(chunks))


def main(selected: list[str] | None = None) -> None:
    """Run every case (or those whose names start with one of `selected`)."""
    import numpy  # noqa: F401 - what a run has imported before it reads anything
    import torch  # noqa: F401

    import raysim.core.loop  # noqa: F401

    # torch's first computation in a process costs about a second (lazy initialisation); done
    # here once, every child starts warm. One thread: a child forked after OpenMP started a
    # thread team would hang in its first parallel region, and with one thread none starts.
    torch.set_num_threads(1)
    layer = torch.nn.Linear(4, 2)
    torch.optim.SGD(layer.parameters(), lr=0.1).zero_grad()
    layer(torch.ones(3, 4)).sum().backward()
    cases = all_cases(warm=True)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline_rss_bytes": baseline}), flush=True)
    for case in cases:
        if selected and not any(case.name.startswith(prefix) for prefix in selected):
            continue
        print(json.dumps(run_case(case)), flush=True)


if __name__ == "__main__":
    main()
