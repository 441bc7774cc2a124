"""Server-side checks of client updates, before anything is aggregated.

A client can send anything: a diverged local training gives NaNs, a buggy or hostile client a
vector of the wrong length or dtype, an FRL client positions that are not a permutation (which
the vote would happily sum, skewing the global ranking). The server checks every update with
the run's codec (raysim.core.codecs) and generically after decoding; a rejected update is
skipped (not folded in, as if the client had dropped out), counted in the round's stats and
logged with the client id, and the run goes on. Every check is one O(n) numpy pass over the
update (no sort), so it costs less than folding the update in.

Which codec and what the update looks like come from the algorithm and the config
(`wire_format`): the algorithm's `update_layout(ctx)` (size, dtype, segments) and its
`default_codec`, or the config's `codec:` section. This module names no algorithm.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from raysim import registry
from raysim.core.algorithm import AlgorithmHooks
from raysim.core.codecs import (
    Codec,
    SharedEntries,
    VectorLayout,
    array_problem,
    as_codec,
    non_finite,
)
from raysim.core.state import WireUpdate
from raysim.errors import ConfigError

_WIRE_CACHE: dict[tuple, tuple[Codec, VectorLayout]] = {}


def wire_format(algorithm: Any, ctx: Any) -> tuple[Codec, VectorLayout]:
    """(codec, layout) of `algorithm`'s updates in this run; computed once per process.

    An algorithm without `update_layout` sends vectors whose size is not checked, with its
    `default_codec` (or 'dense')."""
    config = ctx.config
    # Per algorithm object (the server's, a worker's) and run: building the layout may build
    # the model, so it is done once, not per client.
    key = (
        id(algorithm),
        type(algorithm),
        ctx.model_key(),
        config.codec.name,
        repr(config.codec.options),
    )
    cached = _WIRE_CACHE.get(key)
    if cached is not None:
        return cached
    hooks = AlgorithmHooks.of(algorithm)
    layout = hooks.update_layout(ctx) if hooks.update_layout is not None else VectorLayout(None)
    default = hooks.default_codec
    if config.codec.name == "auto":
        codec = registry.codecs.build(default) if isinstance(default, str) else default
    else:
        if not hooks.configurable_codec:
            raise ConfigError(
                f"algorithm '{config.algorithm.name}' sends its own wire format "
                f"({default if isinstance(default, str) else type(default).__name__}); "
                f"'codec.name' must be auto, got {config.codec.name!r}"
            )
        codec = registry.codecs.build(config.codec.name, **config.codec.options)
    codec = as_codec(codec)  # a plug-in codec need not subclass Codec: wrapped once, here
    if hooks.shared_mask is not None:  # personal layers stay on the client: only the rest is sent
        codec = SharedEntries(codec, hooks.shared_mask(ctx))
    _WIRE_CACHE.clear()  # one run per process at a time: keep only the newest
    _WIRE_CACHE[key] = codec, layout
    return codec, layout


def stats_problem(stats: Any) -> str | None:
    """Declared statistics must be a mapping of names to finite numbers."""
    if not isinstance(stats, dict):
        return f"stats is a {type(stats).__name__}, expected a mapping of names to numbers"
    for name, value in stats.items():
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            return f"stat {name!r} is a {type(value).__name__}, expected a number"
        if not math.isfinite(float(value)):
            return f"stat {name!r} is {value}, expected a finite number"
    return None


def samples_problem(samples: Any, held: int | None = None) -> str | None:
    """num_samples must be an integer >= 0, and at most the samples the client holds (when
    `held` is known)."""
    if isinstance(samples, bool) or not isinstance(samples, int | np.integer) or samples < 0:
        return f"num_samples is {samples!r}, expected an integer >= 0"
    if held is not None and samples > held:
        return f"num_samples is {samples}, but this client holds {held} training samples"
    return None


def metrics_problem(metrics: Any) -> str | None:
    """Client metrics (e.g. the training loss) must be a mapping of names to real numbers
    (NaN allowed: a client without data has no loss)."""
    if not isinstance(metrics, dict):
        return f"metrics is a {type(metrics).__name__}, expected a mapping of names to numbers"
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
            return f"metric {name!r} is a {type(value).__name__}, expected a number"
    return None


def check_decoded(codec: Codec, layout: VectorLayout, vector: Any) -> str | None:
    """Checks of the decoded vector the aggregator would see (None: fine)."""
    problem = array_problem("decoded update", vector, "fiub", layout.size)
    if problem:
        return problem
    if vector.dtype.kind == "b":
        return "decoded update has dtype bool"
    expected = codec.decoded_dtype(layout)
    if expected is not None and vector.dtype != expected:
        return f"update has dtype {vector.dtype}, expected {expected}"
    return non_finite("update", vector) or codec.check_decoded(vector, layout)


def wire_nbytes(codec: Codec, message: Any) -> int:
    """Bytes of an encoded message on the wire: the codec's count (Codec's default: the
    message's arrays)."""
    return int(codec.nbytes(message))


def check_update(codec: Codec, layout: VectorLayout, update: WireUpdate) -> str | None:
    """Checks of one client's update before decoding: sample count, stats, the message."""
    problem = (
        samples_problem(update.num_samples)
        or stats_problem(update.stats)
        or metrics_problem(update.metrics)
    )
    return problem or codec.check(update.message, layout)


def decode_checked(
    codec: Codec, layout: VectorLayout, update: WireUpdate
) -> tuple[np.ndarray | None, str | None]:
    """(decoded vector, None) for a valid update, else (None, one-line reason)."""
    problem = check_update(codec, layout, update)
    if problem is not None:
        return None, problem
    try:
        vector = codec.decode(update.message, layout)
    except Exception as error:  # a message the codec cannot read
        return None, f"cannot be decoded: {type(error).__name__}: {error}"
    problem = check_decoded(codec, layout, vector)
    return (None, problem) if problem is not None else (vector, None)


def describe_rejection(client_id: int, round_index: int, reason: str) -> str:
    """The log line of a rejected update (stderr and the round's record). `round_index` counts
    from 0; the line counts rounds from 1, as the round records and progress lines do."""
    return f"round {round_index + 1}: rejected the update of client {client_id}: {reason}"
