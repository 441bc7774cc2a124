"""The hostile-input corpus (tests/corpus/): loaders, configs, checkpoints, run folders and
client messages. Every case runs in a forked child with a time limit; each must end with one
clear line (a RaysimError) or a clean refusal, and no input under 10 MB may lift the process's
peak RSS above 1.5 GB (the process has already imported numpy, torch and raysim, as a run has)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
RSS_LIMIT_BYTES = int(1.5 * 2**30)
INPUT_LIMIT_BYTES = 10 * 2**20


def test_every_hostile_input_ends_in_one_line_bounded_and_in_time():
    script = "import sys; sys.path.insert(0, sys.argv[1]); from corpus.runner import main; main()"
    env = dict(os.environ, RAY_ADDRESS="", PYTHONWARNINGS="ignore")
    finished = subprocess.run(
        [sys.executable, "-c", script, str(TESTS)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    reports = [json.loads(line) for line in finished.stdout.splitlines() if line.startswith("{")]
    baseline = reports.pop(0)["baseline_rss_bytes"]
    assert len(reports) >= 100, f"only {len(reports)} corpus cases"
    defects = []
    for report in reports:
        name, kind, message = report["name"], report["kind"], report["message"]
        if kind not in ("error", "refused"):
            defects.append(f"{name}: {kind}: {message}")
        elif not message.strip() or "\n" in message:
            defects.append(f"{name}: not one line: {message!r}")
        elif report["input_bytes"] >= INPUT_LIMIT_BYTES:
            defects.append(f"{name}: its input is {report['input_bytes']} bytes, not under 10 MB")
        elif report["peak_rss_bytes"] > RSS_LIMIT_BYTES:
            defects.append(f"{name}: peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MB")
    largest = max(reports, key=lambda report: report.get("peak_rss_bytes", 0))
    slowest = max(reports, key=lambda report: report.get("seconds", 0))
    print(
        f"{len(reports)} cases; runner baseline {baseline / 2**20:.0f} MB; largest peak RSS "
        f"{largest['peak_rss_bytes'] / 2**20:.0f} MB ({largest['name']}); slowest "
        f"{slowest['seconds']:.2f} s ({slowest['name']})"
    )
    assert not defects, "\n".join(defects)
