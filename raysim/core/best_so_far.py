"""The best value each evaluated metric reached so far, and the round it was reached in.

The FRL reference code prints the best test accuracy so far after every round, and its paper's
tables report that number; a run's final metric is what the last round's model scores. raysim
keeps both (summary.json `final` and `best`), so a table can say which one it shows.

A metric whose name contains "loss" is best when lowest; every other metric (accuracy, mAP,
precision@k, ...) when highest. Non-finite values never become a best.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def lower_is_better(metric: str) -> bool:
    return "loss" in metric


class BestSoFar:
    """Per metric: the best value over the evaluations fed so far and its (1-based) round."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}
        self.rounds: dict[str, int] = {}

    def add(self, round_number: int, metrics: Mapping[str, object]) -> None:
        for name, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            value = float(value)
            if not math.isfinite(value):
                continue
            best = self.values.get(name)
            better = best is None or (value < best if lower_is_better(name) else value > best)
            if better:  # ties keep the earlier round
                self.values[name] = value
                self.rounds[name] = int(round_number)

    def summary(self) -> dict[str, dict[str, float | int]] | None:
        """{metric: {"value": best, "round": round}}; None when nothing was evaluated."""
        if not self.values:
            return None
        return {
            name: {"value": self.values[name], "round": self.rounds[name]}
            for name in sorted(self.values)
        }


def best_of_records(records: Iterable[Mapping], split: str = "eval") -> BestSoFar:
    """The best-so-far of the `split` ("eval": test, "val": validation) metrics of a run's
    metrics.jsonl records."""
    best = BestSoFar()
    for record in records:
        metrics = record.get(split)
        if isinstance(metrics, Mapping):
            best.add(int(record.get("round", 0)), metrics)
    return best
