"""Server optimizers applied to the aggregated client delta (FedOpt: Reddi et al., ICLR 2021).

The aggregated delta Delta (mean of client `local - global`) is treated as a pseudo-gradient
step direction: x <- x + lr * direction. With SGD, lr = 1 and momentum = 0 this is FedAvg.
Each optimizer is a pure `step(params, delta, slots) -> (params, slots)` over named numpy
arrays, so its state is checkpointed with the server like everything else.

For large models (FedAwS at Amazon-670K: 72M parameters) the built-in optimizers also step in
place: `step_in_place(params, delta, slots)` writes exactly what `step` returns (the same
float32 operations on every element, in the same order) into params and the slots, in
cache-sized chunks on several threads and without full-size temporaries. The pure `step`
leaves the previous state intact, which the server needs when it refuses a step that made the
state non-finite; `peaks_after` bounds every value a step can produce, so a caller steps in
place only when the result is certainly finite (`in_place_peaks`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Slots = dict[str, np.ndarray]
Peaks = dict[str, float]  # upper bounds of |params| ("params") and of |slot| for each slot

# Values in place stay below this (float32's largest is 3.4e38): far from overflow even after
# the rounding of the few operations a step makes.
FINITE_LIMIT = 1e37
# Each bound is widened by this factor per step: covers the float32 rounding of the scalars and
# of each operation (a few units of 2^-24).
_ROUNDING = 1.0 + 1e-5
_CHUNK = 1 << 16  # elements per chunk of an in-place step (fits the L2 cache with temporaries)


def _in_chunks(size: int, body: Callable[[slice, np.ndarray], None], threads: int) -> None:
    """body(elements, scratch) over [0, size) in chunks, on `threads` threads. Every element's
    arithmetic is the same whatever the chunks or threads (element-wise operations only)."""
    chunks = [slice(lo, min(size, lo + _CHUNK)) for lo in range(0, size, _CHUNK)]
    if threads <= 1 or len(chunks) < 2:
        scratch = np.empty((2, _CHUNK), dtype=np.float32)
        for chunk in chunks:
            body(chunk, scratch)
        return
    from concurrent.futures import ThreadPoolExecutor  # numpy releases the GIL in ufuncs

    per_thread = [chunks[t::threads] for t in range(threads)]

    def run(mine: list[slice]) -> None:
        scratch = np.empty((2, _CHUNK), dtype=np.float32)
        for chunk in mine:
            body(chunk, scratch)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(run, per_thread))


def _bounded(peaks: Peaks) -> Peaks | None:
    widened = {name: value * _ROUNDING for name, value in peaks.items()}
    # `not <`: NaN fails too
    return None if any(not value < FINITE_LIMIT for value in widened.values()) else widened


def _ratio(numerator: float, eps: float) -> float:
    return math.inf if eps <= 0 else numerator / eps


class InPlaceStep:
    """What the built-in optimizers add to `step` (a user's optimizer need not): stepping in
    place (`step_in_place`) and the bounds of what a step can produce (`peaks_after`)."""

    def peaks_after(self, peaks: Peaks, delta_peak: float) -> Peaks | None:
        raise NotImplementedError

    def step_in_place(self, params, delta, slots, threads: int = 1) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class ServerSGD(InPlaceStep):
    lr: float = 1.0
    momentum: float = 0.0

    def init(self, params: np.ndarray) -> Slots:
        return {"momentum": np.zeros_like(params)} if self.momentum else {}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        if self.momentum:
            velocity = self.momentum * slots["momentum"] + delta
            return (params + self.lr * velocity).astype(np.float32), {"momentum": velocity}
        return (params + self.lr * delta).astype(np.float32), slots

    def peaks_after(self, peaks: Peaks, delta_peak: float) -> Peaks | None:
        if self.momentum:
            velocity = abs(self.momentum) * peaks["momentum"] + delta_peak
            return _bounded(
                {"params": peaks["params"] + abs(self.lr) * velocity, "momentum": velocity}
            )
        return _bounded({"params": peaks["params"] + abs(self.lr) * delta_peak})

    def step_in_place(self, params, delta, slots, threads: int = 1) -> None:
        velocity = slots["momentum"] if self.momentum else None

        def body(part: slice, scratch: np.ndarray) -> None:
            step = scratch[0, : part.stop - part.start]
            if velocity is None:
                np.multiply(delta[part], self.lr, out=step)
            else:  # velocity = momentum * velocity + delta
                moment = velocity[part]
                np.multiply(moment, self.momentum, out=moment)
                np.add(moment, delta[part], out=moment)
                np.multiply(moment, self.lr, out=step)
            np.add(params[part], step, out=params[part])

        _in_chunks(params.size, body, threads)


@dataclass(frozen=True)
class ServerAdagrad(InPlaceStep):
    lr: float = 0.1
    eps: float = 1e-3

    def init(self, params: np.ndarray) -> Slots:
        return {"sum_squares": np.zeros_like(params)}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        sum_squares = slots["sum_squares"] + delta * delta
        new = params + self.lr * delta / (np.sqrt(sum_squares) + self.eps)
        return new.astype(np.float32), {"sum_squares": sum_squares}

    def peaks_after(self, peaks: Peaks, delta_peak: float) -> Peaks | None:
        squares = peaks["sum_squares"] + delta_peak * delta_peak
        step = abs(self.lr) * _ratio(delta_peak, self.eps)  # sqrt(sum_squares) >= 0
        return _bounded({"params": peaks["params"] + step, "sum_squares": squares})

    def step_in_place(self, params, delta, slots, threads: int = 1) -> None:
        squares = slots["sum_squares"]

        def body(part: slice, scratch: np.ndarray) -> None:
            size = part.stop - part.start
            step, root = scratch[0, :size], scratch[1, :size]
            change, total = delta[part], squares[part]
            np.multiply(change, change, out=step)  # sum_squares + delta * delta
            np.add(total, step, out=total)
            np.multiply(change, self.lr, out=step)  # lr * delta / (sqrt(sum_squares) + eps)
            np.sqrt(total, out=root)
            np.add(root, self.eps, out=root)
            np.divide(step, root, out=step)
            np.add(params[part], step, out=params[part])

        _in_chunks(params.size, body, threads)


@dataclass(frozen=True)
class ServerAdam(InPlaceStep):
    """FedAdam as in Reddi et al. (no bias correction; eps = tau controls adaptivity)."""

    lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    def init(self, params: np.ndarray) -> Slots:
        return {"first_moment": np.zeros_like(params), "second_moment": np.zeros_like(params)}

    def step(self, params: np.ndarray, delta: np.ndarray, slots: Slots) -> tuple[np.ndarray, Slots]:
        first = self.beta1 * slots["first_moment"] + (1 - self.beta1) * delta
        second = self.beta2 * slots["second_moment"] + (1 - self.beta2) * delta * delta
        new = params + self.lr * first / (np.sqrt(second) + self.eps)
        return new.astype(np.float32), {"first_moment": first, "second_moment": second}

    def peaks_after(self, peaks: Peaks, delta_peak: float) -> Peaks | None:
        # convex combinations (beta in [0, 1)): never above the larger of the two
        first = max(peaks["first_moment"], delta_peak)
        second = max(peaks["second_moment"], delta_peak * delta_peak)
        step = abs(self.lr) * _ratio(first, self.eps)  # sqrt(second) >= 0
        return _bounded(
            {"params": peaks["params"] + step, "first_moment": first, "second_moment": second}
        )

    def step_in_place(self, params, delta, slots, threads: int = 1) -> None:
        firsts, seconds = slots["first_moment"], slots["second_moment"]

        def body(part: slice, scratch: np.ndarray) -> None:
            size = part.stop - part.start
            step, root = scratch[0, :size], scratch[1, :size]
            change, first, second = delta[part], firsts[part], seconds[part]
            # first = beta1 * first + (1 - beta1) * delta
            np.multiply(first, self.beta1, out=first)
            np.multiply(change, 1 - self.beta1, out=step)
            np.add(first, step, out=first)
            # second = beta2 * second + (1 - beta2) * delta * delta  (left to right)
            np.multiply(second, self.beta2, out=second)
            np.multiply(change, 1 - self.beta2, out=step)
            np.multiply(step, change, out=step)
            np.add(second, step, out=second)
            # params + lr * first / (sqrt(second) + eps)
            np.multiply(first, self.lr, out=step)
            np.sqrt(second, out=root)
            np.add(root, self.eps, out=root)
            np.divide(step, root, out=step)
            np.add(params[part], step, out=params[part])

        _in_chunks(params.size, body, threads)


def sgd(config) -> ServerSGD:  # config: raysim.config.ServerConfig
    return ServerSGD(lr=config.lr, momentum=config.momentum)


def adagrad(config) -> ServerAdagrad:
    return ServerAdagrad(lr=config.lr, eps=config.eps)


def adam(config) -> ServerAdam:
    return ServerAdam(lr=config.lr, beta1=config.beta1, beta2=config.beta2, eps=config.eps)


# --- how every algorithm keeps its server-optimizer state ------------------------------------
SLOT_PREFIX = "optimizer."


def from_config(config) -> ServerSGD | ServerAdagrad | ServerAdam:  # config: raysim Config
    """The server optimizer the config's `server:` section names."""
    from raysim import registry

    return registry.server_optimizers.build(config.server.optimizer, config.server)


def slot_arrays(slots: Slots) -> dict[str, np.ndarray]:
    """Optimizer slots as named server-state arrays ('optimizer.<slot>'), checkpointed with it."""
    return {SLOT_PREFIX + name: value for name, value in slots.items()}


def peaks_of(params: np.ndarray, slots: Slots) -> Peaks:
    """max |value| of params and of each slot (NaN if any holds NaN)."""

    def peak(values: np.ndarray) -> float:
        if not values.size:
            return 0.0
        return float(max(abs(float(values.max())), abs(float(values.min()))))

    return {"params": peak(params), **{name: peak(value) for name, value in slots.items()}}


def in_place_peaks(
    optimizer, params: np.ndarray, delta: np.ndarray, slots: Slots, peaks: Peaks, delta_peak
) -> Peaks | None:
    """Bounds of |params| and |slots| after `optimizer.step_in_place(params, delta, slots)`,
    or None when that step must not run in place: the optimizer has none (a user's), an array
    is not a writable C-contiguous float32 array of params' size, or the step could overflow
    (then the pure `step` runs and the server may refuse its result, keeping the old state).

    `peaks` bounds the values before the step (`peaks_of`, or the previous call's result for
    the same arrays); `delta_peak` bounds |delta|."""
    if not isinstance(optimizer, InPlaceStep):
        return None
    arrays = [params, delta, *slots.values()]
    for values in arrays:
        if not (
            isinstance(values, np.ndarray)
            and values.dtype == np.float32
            and values.shape == params.shape
            and values.flags.c_contiguous
            and (values is delta or values.flags.writeable)
        ):
            return None
    if any(np.may_share_memory(a, b) for i, a in enumerate(arrays) for b in arrays[i + 1 :]):
        return None
    if set(peaks) != {"params", *slots}:
        return None
    return optimizer.peaks_after(peaks, float(delta_peak))


def slots_of(arrays: dict[str, np.ndarray]) -> Slots:
    """The optimizer slots held in a server state's arrays (inverse of `slot_arrays`)."""
    return {
        name.removeprefix(SLOT_PREFIX): value
        for name, value in arrays.items()
        if name.startswith(SLOT_PREFIX)
    }
