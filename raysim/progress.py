"""Progress output: a live bar on a terminal, plain periodic lines in a log.

Under `ray job submit`, with stdout redirected to a file or in CI, a carriage-return progress
bar turns into one endless line; there a line is printed every `every_s` seconds (and for the
last round) instead, each readable on its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping


class Progress:
    def __init__(self, total: int, initial: int = 0, every_s: float = 10.0, stream=None) -> None:
        self.total, self.done = total, initial
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self._bar = None
        self._started = time.perf_counter()
        self._last_line = self._started
        if _is_terminal(self.stream):
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc="rounds", unit="round", dynamic_ncols=True,
                file=self.stream,
            )  # fmt: skip

    def update(self, metrics: Mapping[str, float], trained_in: str = "") -> None:
        """One more round done; `metrics`: the latest evaluation and train loss; `trained_in`:
        where the round's clients trained (e.g. "2 tasks on 2 nodes", "the server actor")."""
        self.done += 1
        shown = {k: f"{v:.4f}" for k, v in metrics.items() if isinstance(v, int | float)}
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({**shown, "clients in": trained_in} if trained_in else shown)
            return
        now = time.perf_counter()
        if now - self._last_line >= self.every_s or self.done == self.total:
            self._last_line = now
            values = " ".join(f"{k}={v}" for k, v in shown.items())
            where = f", clients in {trained_in}" if trained_in else ""
            print(
                f"raysim: round {self.done}/{self.total} {values} "
                f"({now - self._started:.1f} s{where})",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
