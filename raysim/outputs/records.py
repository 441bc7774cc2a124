"""A run's round records: how one is written as a line of OUT/metrics.jsonl, how its nested
values are named when flattened (`eval/accuracy`: TensorBoard's tags, what a Tune trial
reports), and which records of a metrics.jsonl a resume may keep."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from raysim.errors import RaysimError


def json_safe(value: Any) -> Any:
    """`value` as strict JSON holds it: non-finite floats as null, numpy scalars as Python's."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return json_safe(value.item())
    return value


def record_line(record: dict[str, Any]) -> str:
    """One record as its line of metrics.jsonl."""
    return json.dumps(json_safe(record)) + "\n"


def flatten_record(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every value of a (nested) record under its `a/b` name, e.g. `eval/accuracy`."""
    flat: dict[str, Any] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_record(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def is_number(value: Any) -> bool:
    """An int or float that is not a bool (True is an int to Python, not a metric)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def resume_records(path: Path, checkpoint_round: int) -> list[dict[str, Any]]:
    """The metrics records a resume from the checkpoint of `checkpoint_round` keeps: those of
    rounds 1..checkpoint_round, each exactly once, whole, in order (they are fsynced before
    each checkpoint). What follows them (rounds computed again after the resume) may be
    damaged: a torn or unreadable line there is cut off with a line saying so. Anything wrong
    up to the checkpoint's round is refused in one line naming the file and the first missing
    or bad round: the run is never silently shortened."""
    last = checkpoint_round

    def refuse(problem: str) -> RaysimError:
        return RaysimError(
            f"cannot resume: {path} {problem}; a resume from the checkpoint of round {last} "
            f"needs the records of rounds 1-{last} exactly once and in order"
        )

    if not path.is_file():
        raise refuse("is missing")
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # after the final newline
    history: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        expected = len(history) + 1
        try:
            record = json.loads(line)
            round_index = record["round"]
            if isinstance(round_index, bool) or not isinstance(round_index, int):
                raise TypeError(f"round {round_index!r}")
        except (ValueError, KeyError, TypeError):
            if expected > last:  # past the checkpoint: recomputed, so cut off here
                print(
                    f"raysim: {path} line {number}, after the records of rounds 1-{last}, is "
                    f"cut or unreadable; dropping it and the {len(lines) - number} line(s) "
                    "after it (their rounds are computed again)",
                    file=sys.stderr,
                    flush=True,
                )
                break
            raise refuse(
                f"line {number} is not a whole record (round {expected} expected)"
            ) from None
        if round_index < expected:
            raise refuse(f"line {number} holds round {round_index} a second time")
        if round_index > last and expected > last:
            continue  # a round after the checkpoint: computed again
        if round_index != expected:
            raise refuse(f"lacks round {expected} (line {number} holds round {round_index})")
        history.append(record)
    if len(history) < last:
        raise refuse(f"ends after round {len(history)}: it lacks round {len(history) + 1}")
    return history
