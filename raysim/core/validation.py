"""Server-side checks of client updates, before anything is aggregated.

A client can send anything: a diverged local training gives NaNs, a buggy or hostile client a
vector of the wrong length or dtype, an FRL client positions that are not a permutation (which
the vote would happily sum, skewing the global ranking). The server checks every decoded update
against what its algorithm sends; a rejected update is skipped (not folded in, as if the client
had dropped out), counted in the round's stats and logged with the client id, and the run goes
on. Every check is one O(n) numpy pass over the update (no sort), so it costs less than folding
the update in.

What is expected comes from the algorithm and the server state (`update_spec`):
    dense   FedAvg/FedProx: float32 delta of exactly the model's size, finite
    signs   SignSGD: uint8 packed sign bits, ceil(d / 8) bytes
    sparse  TopK: {'values': float32, 'indices': int} of exactly k entries, indices strictly
            increasing in [0, d), values finite
    ranks   FRL: one bit-packed array per layer of exactly packed_nbytes(n_l) bytes, each
            decoding to a permutation of 0..n_l-1
    vector  any other algorithm: a 1-D numeric vector, finite; its size is checked when the
            algorithm declares one (attribute `update_kind`/method `update_spec`, see below)
An algorithm may define `update_spec(state, ctx) -> UpdateSpec` to describe its own messages.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim.core.rankcodec import packed_nbytes
from raysim.core.state import ClientUpdate, ServerState

DENSE, SIGNS, SPARSE, RANKS, VECTOR = "dense", "signs", "sparse", "ranks", "vector"


@dataclass(frozen=True)
class UpdateSpec:
    """What a well-formed update of one algorithm looks like (fixed for a run)."""

    kind: str
    size: int | None  # entries of the decoded vector (None: not known, not checked)
    dtype: np.dtype | None = None  # dtype of the decoded vector (None: any numeric dtype)
    layer_sizes: tuple[int, ...] = ()  # ranks: entries per layer (each a permutation)
    kept: int | None = None  # sparse: entries per message


def update_spec(algorithm: Any, state: ServerState, ctx: Any) -> UpdateSpec:
    """The spec of `algorithm`'s client messages, for the given server state and run."""
    custom = getattr(algorithm, "update_spec", None)
    if callable(custom):
        return custom(state, ctx)
    from raysim.algorithms.fedavg import _DeltaAveraging
    from raysim.algorithms.frl import FRL
    from raysim.algorithms.signsgd import SignSGD
    from raysim.algorithms.topk import TopK, num_kept

    if isinstance(algorithm, FRL):
        sizes = tuple(int(n) for n in algorithm.layer_sizes(ctx))
        return UpdateSpec(RANKS, sum(sizes), np.dtype(np.int64), layer_sizes=sizes)
    params = state.arrays.get("params")
    if isinstance(algorithm, _DeltaAveraging) and params is not None:
        size = int(params.size)
        if isinstance(algorithm, SignSGD):
            return UpdateSpec(SIGNS, size, np.dtype(np.int8))
        if isinstance(algorithm, TopK):
            return UpdateSpec(
                SPARSE, size, np.dtype(np.float32), kept=num_kept(size, algorithm.fraction)
            )
        return UpdateSpec(DENSE, size, params.dtype)
    return UpdateSpec(VECTOR, None)


# --- the checks -------------------------------------------------------------------------------


def _array_problem(name: str, value: Any, dtype_kinds: str, length: int | None) -> str | None:
    """Is `value` a 1-D ndarray with a dtype of one of `dtype_kinds` and `length` entries?"""
    if not isinstance(value, np.ndarray):
        return f"{name} is a {type(value).__name__}, expected a numpy array"
    if value.dtype.kind not in dtype_kinds:
        return f"{name} has dtype {value.dtype}"
    if value.ndim != 1:
        return f"{name} has shape {value.shape}, expected 1-D"
    if length is not None and len(value) != length:
        return f"{name} has {len(value)} entries, expected {length}"
    return None


def _non_finite(name: str, vector: np.ndarray) -> str | None:
    if vector.dtype.kind != "f":
        return None
    finite = np.isfinite(vector)
    if finite.all():
        return None
    bad = len(vector) - int(np.count_nonzero(finite))
    first = int(np.argmin(finite))
    return f"{name} has {bad} NaN/Inf entries (first at index {first}: {vector[first]})"


def not_a_permutation(values: np.ndarray, n: int) -> str | None:
    """None when `values` is a permutation of 0..n-1, else why not. O(n), no sort."""
    if len(values) != n:
        return f"has {len(values)} entries, expected {n}"
    if n == 0:
        return None
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= n:
        return f"has a value out of range [0, {n}) (min {low}, max {high})"
    seen = np.zeros(n, dtype=bool)
    seen[values] = True
    if not seen.all():  # n values in range, one missing => another repeated
        return f"repeats a position ({n - int(np.count_nonzero(seen))} of 0..{n - 1} missing)"
    return None


def check_message(spec: UpdateSpec, message: Any) -> str | None:
    """Cheap structural checks of a message before it is decoded (None: looks well formed)."""
    if spec.kind == DENSE:
        return _array_problem("update", message, "f", spec.size) or _dtype_problem(spec, message)
    if spec.kind == SIGNS:
        length = None if spec.size is None else (spec.size + 7) // 8
        return _array_problem("packed signs", message, "u", length) or (
            None if message.dtype == np.uint8 else f"packed signs have dtype {message.dtype}"
        )
    if spec.kind == SPARSE:
        if not isinstance(message, Mapping) or set(message) != {"values", "indices"}:
            keys = sorted(map(str, message)) if isinstance(message, Mapping) else None
            found = f"keys {keys}" if keys is not None else f"a {type(message).__name__}"
            return f"expected a mapping with keys 'values' and 'indices', got {found}"
        values, indices = message["values"], message["indices"]
        problem = _array_problem("values", values, "f", spec.kept) or _array_problem(
            "indices", indices, "iu", len(values) if isinstance(values, np.ndarray) else None
        )
        if problem:
            return problem
        if values.dtype != np.float32:
            return f"values have dtype {values.dtype}, expected float32"
        if len(indices) and spec.size is not None:
            low, high = int(indices.min()), int(indices.max())
            if low < 0 or high >= spec.size:
                return f"an index is out of range [0, {spec.size}) (min {low}, max {high})"
        if len(indices) > 1 and not (np.diff(indices.astype(np.int64)) > 0).all():
            return "indices are not strictly increasing (repeated or unsorted)"
        return _non_finite("values", values)
    if spec.kind == RANKS:
        if not isinstance(message, list | tuple):
            return f"expected one packed array per layer, got a {type(message).__name__}"
        if len(message) != len(spec.layer_sizes):
            return f"has {len(message)} layers, expected {len(spec.layer_sizes)}"
        for layer, (packed, n) in enumerate(zip(message, spec.layer_sizes, strict=True)):
            problem = _array_problem(f"layer {layer}", packed, "u", None)
            if problem:
                return problem
            if packed.dtype != np.uint8:
                return f"layer {layer} has dtype {packed.dtype}, expected uint8"
            if len(packed) != packed_nbytes(n):
                return (
                    f"layer {layer} has {len(packed)} bytes, expected {packed_nbytes(n)} "
                    f"({n} bit-packed positions)"
                )
        return None
    return None


def _dtype_problem(spec: UpdateSpec, vector: np.ndarray) -> str | None:
    if spec.dtype is not None and vector.dtype != spec.dtype:
        return f"update has dtype {vector.dtype}, expected {spec.dtype}"
    return None


def check_decoded(spec: UpdateSpec, vector: Any) -> str | None:
    """Checks of the decoded vector the aggregator would see (None: fine)."""
    problem = _array_problem("decoded update", vector, "fiub", spec.size)
    if problem:
        return problem
    if vector.dtype.kind == "b":
        return "decoded update has dtype bool"
    problem = _dtype_problem(spec, vector) or _non_finite("update", vector)
    if problem or spec.kind != RANKS:
        return problem
    start = 0
    for layer, n in enumerate(spec.layer_sizes):
        problem = not_a_permutation(vector[start : start + n], n)
        if problem:
            return f"layer {layer} positions are not a permutation: {problem}"
        start += n
    return None


def check_update(
    spec: UpdateSpec, update: ClientUpdate, decoded: np.ndarray | None = None
) -> str | None:
    """All checks of one client's update: sample count, message, and (if given) its decoding."""
    samples = update.num_samples
    if isinstance(samples, bool) or not isinstance(samples, int | np.integer) or samples < 0:
        return f"num_samples is {samples!r}, expected an integer >= 0"
    problem = check_message(spec, update.message)
    if problem is None and decoded is not None:
        problem = check_decoded(spec, decoded)
    return problem


def decode_checked(
    algorithm: Any, spec: UpdateSpec, update: ClientUpdate, ctx: Any
) -> tuple[np.ndarray | None, str | None]:
    """(decoded vector, None) for a valid update, else (None, one-line reason)."""
    problem = check_update(spec, update)
    if problem is not None:
        return None, problem
    try:
        vector = algorithm.decode_update(update.message, ctx)
    except Exception as error:  # a message the algorithm's own decoder cannot read
        return None, f"cannot be decoded: {type(error).__name__}: {error}"
    problem = check_decoded(spec, vector)
    return (None, problem) if problem is not None else (vector, None)


def describe_rejection(client_id: int, round_index: int, reason: str) -> str:
    """The log line of a rejected update (stderr and the round's record)."""
    return f"round {round_index}: rejected the update of client {client_id}: {reason}"
