"""The server: global state, aggregation of one round's updates, server update, evaluation.

This class is backend-agnostic. The local backend calls it in-process; the Ray backend wraps it
in an actor (runtime/ray_backend.py). Updates must be added in client-id order (the backends
guarantee it), which is what makes every backend and packing give bit-identical results.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from raysim import registry
from raysim.core.algorithm import AlgorithmHooks, RunContext, check_algorithm, check_labels
from raysim.core.clients import single_class_of_clients
from raysim.core.payload import encoded_nbytes
from raysim.core.round_fold import Collusion, RoundFold
from raysim.core.state import (
    Contribution,
    ReducedUpdate,
    RoundInfo,
    RoundStats,
    ServerState,
    WireChunk,
    WireUpdate,
)
from raysim.core.validation import (
    decode_checked,
    describe_rejection,
    samples_problem,
    wire_format,
    wire_nbytes,
)
from raysim.core.wire_chunk import chunk_problem, rows_pass, stacks
from raysim.errors import ConfigError


def build_algorithm(ctx: RunContext, schedule: Any = None):
    """The configured algorithm; asynchronously (fedbuff | fedasync) wrapped to run on the
    event `schedule` (the server's; clients get the wrapper without it: they only train on the
    payload of their version)."""
    config = ctx.config.algorithm
    algorithm = registry.algorithms.build(config.name, **config.options)
    check_algorithm(algorithm, config.name)
    check_labels(algorithm, config.name, ctx)
    if ctx.config.devices.asynchronous:
        from raysim.core.async_aggregation import AsyncAggregation

        algorithm = AsyncAggregation(algorithm, schedule, ctx.config)
    return algorithm


def build_aggregator(ctx: RunContext, algorithm):
    """The configured aggregator; `auto` means the algorithm's natural one (a registered name,
    or an aggregator object the algorithm builds from its own options, e.g. FLAG's weighting).
    An algorithm may refuse an aggregator that would ignore what it needs
    (`check_aggregator(aggregator, ctx) -> reason | None`)."""
    config = ctx.config.aggregator
    if config.name == "auto":
        default = algorithm.default_aggregator
        if not isinstance(default, str):
            return default
        return registry.aggregators.build(default)
    aggregator = registry.aggregators.build(config.name, **config.options)
    check = AlgorithmHooks.of(algorithm).check_aggregator
    reason = check(aggregator, ctx) if check is not None else None
    if reason:
        raise ConfigError(
            f"aggregator '{config.name}' does not fit algorithm '{ctx.config.algorithm.name}': "
            f"{reason}"
        )
    return aggregator


def build_attack(ctx: RunContext):
    attack = ctx.config.attack
    if attack.name == "none" or attack.fraction == 0:
        return None
    return registry.attacks.build(attack.name, **attack.options)


@dataclass(frozen=True)
class ServerData:
    """What the server holds of the data: the splits it evaluates and two facts per client.

    `client_classes[c]`: the one class client c holds (-1 if several or none); needed only by
    algorithms with per-client payloads (FedAwS). `client_sizes[c]`: client c's training
    samples; an update claiming more is refused (its weight would be a lie). `val_x, val_y`:
    the validation split, evaluated beside the test split when given."""

    test_x: np.ndarray
    test_y: np.ndarray
    val_x: np.ndarray | None = None
    val_y: np.ndarray | None = None
    client_classes: np.ndarray | None = None
    client_sizes: np.ndarray | None = None
    # an asynchronous run's event schedule (raysim.assembly.plan.RunPlan.schedule): only the
    # server weighs updates and keeps the version window by it
    schedule: Any = None

    @classmethod
    def of(cls, dataset: Any, split: Any, schedule: Any = None) -> ServerData:
        """The server's part of `dataset` (raysim.data.datasets.Dataset) split as `split`."""
        return cls(
            dataset.test_x,
            dataset.test_y,
            dataset.val_x,
            dataset.val_y,
            single_class_of_clients(dataset.train_y, split.indices, split.offsets),
            np.diff(split.offsets),
            schedule,
        )


class Server:
    def __init__(self, ctx: RunContext, data: ServerData) -> None:
        self.ctx = ctx
        self.data = data
        self.client_sizes = data.client_sizes
        self.algorithm = build_algorithm(ctx, data.schedule)
        self.hooks = AlgorithmHooks.of(self.algorithm)
        self.reduces_in_task = self.hooks.reduces_in_task
        if self.hooks.uses_client_state and ctx.client_state is None:
            raise ConfigError(
                f"algorithm '{ctx.config.algorithm.name}' keeps per-client state, and the "
                f"'{ctx.config.runtime.backend}' backend brought no client-state store "
                "(RuntimeAttachments.client_state: raysim.runtime.client_state.store_for)"
            )
        if self.reduces_in_task:
            if ctx.config.aggregator.name != "auto":
                raise ConfigError(
                    f"algorithm '{ctx.config.algorithm.name}' aggregates its own updates "
                    f"(exactly, inside the client tasks); 'aggregator.name' must be 'auto', "
                    f"got {ctx.config.aggregator.name!r}"
                )
            if ctx.config.attack.name != "none":
                raise ConfigError(
                    f"algorithm '{ctx.config.algorithm.name}' does not support attacks "
                    f"('attack.name' must be 'none', got {ctx.config.attack.name!r})"
                )
        self.aggregator = build_aggregator(ctx, self.algorithm)
        self.attack = build_attack(ctx)
        self.client_classes = data.client_classes
        self.state = self.algorithm.init_server(ctx)
        self.test_x, self.test_y = data.test_x, data.test_y
        self.val_x, self.val_y = data.val_x, data.val_y
        self._payload_cache: tuple[int, object, int] | None = None
        # What a valid client update looks like, and its wire format (raysim.core.codecs).
        self.codec, self.layout = (
            (None, None) if self.reduces_in_task else wire_format(self.algorithm, ctx)
        )
        # Algorithms that keep something of each client (FLAG: its local model, for AmAP)
        # see the round's contributions after the aggregate (`observe_contributions`).
        self._observe = self.hooks.observe_contributions
        # Asynchronous aggregation weighs each update by its staleness before it is folded.
        self._weigh = self.hooks.weigh_update

    # --- payload -------------------------------------------------------------------------------
    def payload(self):
        """The round's broadcast payload (computed once per state)."""
        if self._payload_cache is None or self._payload_cache[0] != self.state.round:
            payload = self.algorithm.server_payload(self.state)
            self._payload_cache = (self.state.round, payload, encoded_nbytes(payload))
        return self._payload_cache[1]

    def payload_nbytes(self) -> int:
        self.payload()
        return self._payload_cache[2]  # type: ignore[index]

    def personal_payloads(self, client_ids: np.ndarray) -> list | None:
        """Each client's own payload (FedAwS: its class row), or None if the algorithm has
        none; in the order of `client_ids`."""
        make = self.hooks.client_payload
        if make is None:
            return None
        if self.client_classes is None:
            classes = np.full(len(client_ids), -1, dtype=np.int64)
        else:
            classes = self.client_classes[np.asarray(client_ids, dtype=np.int64)]
        return make(self.state, np.asarray(client_ids, dtype=np.int64), classes)

    # --- one round -----------------------------------------------------------------------------
    def start_round(self, info: RoundInfo) -> None:
        self._info = info
        self._stats = RoundStats(bytes_down=self.payload_nbytes() * info.num_clients)
        personal = self.personal_payloads(info.client_ids)
        if personal is not None:
            self._stats.bytes_down += encoded_nbytes(personal)
        self._fold = RoundFold(self.aggregator, keep_contributions=self._observe is not None)
        self._collusion = Collusion(info)
        self._sampled = {int(c) for c in info.client_ids}  # who may send an update this round
        self._heard_from: set[int] = set()
        self._bound = self._update_bound()

    def add(self, updates: Iterable[WireUpdate | WireChunk | ReducedUpdate]) -> None:
        """Fold in updates, in client-id order. Linear aggregators keep O(model) memory."""
        started = time.perf_counter()
        for update in updates:
            if isinstance(update, ReducedUpdate):
                self._add_reduced(update)
            elif isinstance(update, WireChunk):
                if not self._add_chunk_at_once(update):
                    for one in update.updates():
                        self._add_one(one)
            elif isinstance(update, WireUpdate):
                self._add_one(update)
            else:  # a backend's bug, not a client's
                raise TypeError(
                    f"Server.add got a {type(update).__name__}, expected a WireUpdate (a "
                    "ClientUpdate encoded by its task: `update.encoded(codec, layout)`), a "
                    "WireChunk or a ReducedUpdate"
                )
        self._fold.aggregate_s += time.perf_counter() - started

    def _add_one(self, update: WireUpdate) -> None:
        stats, info, fold, collusion = self._stats, self._info, self._fold, self._collusion
        if update.client_id in collusion.pool:  # the attacker's own training, not sent
            collusion.learn(update.client_id, self.codec.decode(update.message, self.layout))
            self._maybe_fold_crafted()
            return
        # Checked before anything of it is counted or folded (raysim.core.validation):
        # one update per sampled client, then its contents.
        problem = self._sender_problem(update.client_id) or self._samples_problem(update)
        vector, norm = None, math.nan
        if problem is None:
            vector, problem = decode_checked(self.codec, self.layout, update)
        if problem is None and np.issubdtype(vector.dtype, np.floating):
            with np.errstate(over="ignore"):  # a huge update's norm is inf: refused below
                norm = float(np.linalg.norm(vector))  # rank positions have no useful norm
            problem = self._magnitude_problem(norm)
        if problem is not None:
            stats.clients_rejected += 1
            stats.rejected.append(describe_rejection(update.client_id, info.round_index, problem))
            if self.attack is not None and update.client_id < info.malicious_below:
                collusion.malicious_rejected += 1
                self._maybe_fold_crafted()
            return
        stats.clients_done += 1
        # the encoded update, plus the declared statistics (8 bytes each)
        stats.bytes_up += wire_nbytes(self.codec, update.message) + encoded_nbytes(update.stats)
        fold.add_loss(update.metrics.get("loss", math.nan), update.num_samples)
        fold.add_norm(norm)
        if self._weigh is not None:
            vector = self._weigh(self.state, info.round_index, int(update.client_id), vector)
        contribution = Contribution(
            int(update.client_id), vector, int(update.num_samples), dict(update.stats)
        )
        if self.attack is not None and update.client_id < info.malicious_below:
            # Malicious clients (and the attacker's pool) have the lowest ids, so they all
            # arrive before any honest client; once the last one is in, they collude and
            # their crafted updates are folded in their place (still in client-id order).
            collusion.malicious.append(contribution)
            self._maybe_fold_crafted()
            return
        fold.fold(contribution)

    def _add_chunk_at_once(self, chunk: WireChunk) -> bool:
        """Fold in a chunk's rows with whole-array checks (raysim.core.wire_chunk); False,
        having changed nothing, when the run or a row needs them one by one (an attack, updates
        weighed by staleness, a codec that does not stack, any row the checks would refuse)."""
        problem = chunk_problem(chunk)
        if problem is not None:  # the task builds chunks: a backend's bug, not a client's
            raise TypeError(f"Server.add got a malformed WireChunk: {problem}")
        if self.attack is not None or self._weigh is not None or not stacks(self.codec):
            return False
        passed = rows_pass(
            chunk,
            self.codec,
            self.layout,
            self._sampled,
            self._heard_from,
            self.client_sizes,
            self._bound,
        )
        if passed is None:
            return False
        rows, norms = passed
        stats, fold = self._stats, self._fold
        ids = chunk.client_ids.tolist()
        self._heard_from.update(ids)
        stats.clients_done += len(ids)
        row_bytes = wire_nbytes(self.codec, chunk.first_message())
        stats.bytes_up += row_bytes * len(ids) + sum(encoded_nbytes(s) for s in chunk.stats)
        contributions = []
        for client_id, num_samples, row, metrics, declared, norm in zip(
            ids,
            chunk.num_samples.tolist(),
            rows,
            chunk.metrics,
            chunk.stats,
            norms,
            strict=True,
        ):
            fold.add_loss(metrics.get("loss", math.nan), num_samples)
            fold.add_norm(norm)
            contributions.append(Contribution(client_id, row, num_samples, dict(declared)))
        fold.fold_rows(contributions, rows)
        return True

    def record_failure(self, client_id: int) -> None:
        """One failed attempt at training `client_id` (any order; it is retried or dropped)."""
        if int(client_id) not in self._collusion.pool:  # the attacker's pool: not a client
            self._stats.clients_failed += 1

    def drop(self, client_id: int, late: bool = False) -> None:
        """`client_id` sends nothing this round (out of retries, or `late` for the round's
        deadline). Called in client-id order among the `add`s, like an update."""
        client_id = int(client_id)
        if client_id in self._collusion.pool:
            self._collusion.pool_dropped += 1
            if self.attack is not None:
                self._maybe_fold_crafted()
            return
        self._stats.clients_dropped += 1
        self._stats.clients_late += int(late)
        if self.attack is not None and client_id < self._info.malicious_below:
            self._collusion.malicious_rejected += 1  # like a rejected one: no crafted copy
            self._maybe_fold_crafted()

    def _sender_problem(self, client_id) -> str | None:
        """An update must come from a client sampled this round, and only once."""
        if isinstance(client_id, bool) or not isinstance(client_id, int | np.integer):
            return f"client id {client_id!r} is not an integer"
        if int(client_id) not in self._sampled:
            return "this client was not sampled in this round"
        if int(client_id) in self._heard_from:
            return "a second update from this client in this round"
        self._heard_from.add(int(client_id))
        return None

    def _update_bound(self) -> float | None:
        """The largest update norm accepted this round: server.max_update_ratio times the norm
        of the state array the updates are deltas of (at least 1); None: no bound."""
        name = self.hooks.update_delta_of
        ratio = self.ctx.config.server.max_update_ratio
        if name is None or not ratio or name not in self.state.arrays:
            return None
        reference = np.asarray(self.state.arrays[name], dtype=np.float64)
        return ratio * max(1.0, float(np.linalg.norm(reference)))

    def _magnitude_problem(self, norm: float) -> str | None:
        """A finite update can still wreck the model (a delta of 3e38, one coordinate of 1e20
        that makes Adam's second moment infinite): updates far larger than the model are
        refused."""
        bound = self._bound
        if bound is None or norm <= bound:
            return None
        ratio = self.ctx.config.server.max_update_ratio
        return (
            f"update norm {norm:.3g} is more than server.max_update_ratio={ratio:g} times the "
            f"model's (bound {bound:.3g})"
        )

    def _samples_problem(self, update: WireUpdate) -> str | None:
        """A client cannot have trained on more samples than it holds."""
        if self.client_sizes is None:
            return None
        return samples_problem(update.num_samples, int(self.client_sizes[int(update.client_id)]))

    def _add_reduced(self, update: ReducedUpdate) -> None:
        stats = self._stats
        for client_id, problem in update.rejected:  # refused in the task, before reducing
            stats.clients_rejected += 1
            stats.rejected.append(describe_rejection(client_id, self._info.round_index, problem))
        if update.message is None:  # every client of the task was refused
            return
        stats.clients_done += update.num_clients
        stats.bytes_up += update.bytes_up
        fold = self._fold
        for metrics, num_samples in zip(update.metrics, update.num_samples, strict=True):
            fold.add_loss(metrics.get("loss", math.nan), num_samples)
            fold.add_norm(metrics.get("update_norm", math.nan))
        fold.reduced = self.hooks.merge_reduced(fold.reduced, update.message, self.ctx)

    def _maybe_fold_crafted(self) -> None:
        info, collusion = self._info, self._collusion
        if not collusion.ready():
            return
        honest, benign_start = collusion.honest_updates()
        base, base_name = None, self.hooks.update_delta_of
        if base_name is not None:
            base = self.state.arrays[base_name].view()
            base.flags.writeable = False  # the attack reads the model, never changes it
        info = dataclasses.replace(info, benign_start=benign_start, delta_base=base)
        crafted = self.attack.craft(honest, info, self.aggregator, self.algorithm, self.ctx)
        if len(crafted) != info.num_malicious:
            raise RuntimeError(
                f"attack returned {len(crafted)} updates for {info.num_malicious} clients"
            )
        # Malicious clients whose own update was rejected send nothing (their crafted copies
        # are dropped from the end).
        kept = crafted[: len(collusion.malicious)]
        for vector, sent in zip(kept, collusion.malicious, strict=True):
            self._fold.fold(Contribution(sent.client_id, vector, sent.num_samples, sent.stats))
        collusion.clear()

    def finish_round(self, evaluate: bool) -> RoundStats:
        started = time.perf_counter()
        stats, fold = self._stats, self._fold
        nothing_arrived = (fold.reduced is None if self.reduces_in_task else not fold.folded) and (
            stats.clients_rejected or stats.clients_dropped
        )
        if nothing_arrived or fold.weighs_nothing():
            # Every update of the round was rejected or dropped (or weighs nothing): the model
            # stays, the round still ends.
            self.state = ServerState(self.state.round + 1, dict(self.state.arrays))
            stats.model_updated = False
            aggregate = None
        elif self.reduces_in_task:
            if fold.reduced is None:
                raise ValueError("no client update was aggregated this round")
            aggregate = self.hooks.finish_reduced(fold.reduced, self.ctx)
            fold.reduced = None
        elif fold.accumulator is not None:
            aggregate = fold.accumulator.result()
        else:
            aggregate = self.aggregator.aggregate(fold.contributions, self._info)
        if aggregate is not None:
            state = self.state
            result, times = self._checked_update(
                self.algorithm.server_update(state, aggregate, self.ctx)
            )
            stats.server_times = times
            if self._observe is not None and fold.contributions:
                result = self._observe(state, result, fold.contributions, self.ctx)
            broken = _non_finite_arrays(result)
            if broken:  # the model would be lost for every later round: keep it instead
                stats.rejected.append(
                    f"round {state.round + 1}: the server update made {', '.join(broken)} "
                    "non-finite; the round's aggregate was refused and the model kept"
                )
                result = ServerState(state.round + 1, dict(state.arrays))
                stats.model_updated = False
            self.state = result
        fold.contributions = []
        # The phases the algorithm timed itself (index, spreadout) are reported apart.
        stats.aggregate_s = (
            fold.aggregate_s + time.perf_counter() - started - sum(stats.server_times.values())
        )
        if fold.loss_weight:
            stats.train_loss = fold.loss_sum / fold.loss_weight
        if stats.clients_done:
            stats.update_norm_mean = fold.norm_sum / stats.clients_done
        if evaluate:
            self.add_evaluation(stats)
        return stats

    def add_evaluation(self, stats: RoundStats) -> None:
        """The state's evaluation on the test split (and the validation split, when there is
        one) into `stats`, with the seconds it took: a pure function of the state."""
        started = time.perf_counter()
        stats.eval = self.evaluate()
        if self.val_x is not None:  # per-client rows (if any) of the validation split
            ctx = self.ctx
            if ctx.client_validation is not None:
                ctx = dataclasses.replace(ctx, client_validation=ctx.client_validation_of_val)
            stats.val = self.algorithm.evaluate(self.state, self.val_x, self.val_y, ctx)
        stats.evaluate_s = time.perf_counter() - started

    def _checked_update(self, returned: Any) -> tuple[ServerState, dict[str, float]]:
        """server_update's `(state, diagnostics)`: the next state and the seconds of the server
        phases the algorithm timed itself (`*_s`, reported in the round's time split; empty
        when it times none). Anything else is refused in one line naming the algorithm."""
        if (
            isinstance(returned, tuple)
            and len(returned) == 2
            and isinstance(returned[0], ServerState)
            and isinstance(returned[1], Mapping)
        ):
            state, diagnostics = returned
            return state, {k: float(v) for k, v in diagnostics.items()}
        if isinstance(returned, tuple):
            got = f"({', '.join(type(item).__name__ for item in returned)})"
        else:
            got = type(returned).__name__
        raise ConfigError(
            f"algorithm '{self.ctx.config.algorithm.name}': server_update must return "
            f"(state, diagnostics), got {got}"
        )

    def evaluate(self) -> dict[str, float]:
        return self.algorithm.evaluate(self.state, self.test_x, self.test_y, self.ctx)

    # --- state ---------------------------------------------------------------------------------
    def get_state(self) -> ServerState:
        return self.state

    def set_state(self, state: ServerState) -> None:
        self.state = state
        self._payload_cache = None
        restored = self.hooks.state_restored
        if restored is not None:  # e.g. FedAwS rebuilds its nearest-class index from W
            restored(state, self.ctx)


def _non_finite_arrays(state: ServerState) -> list[str]:
    """Names of the state's float arrays holding NaN or Inf. A sum carries any of them (and
    overflows only where the values are already absurd), at a fraction of an elementwise
    check's cost on a large state (FedAwS's class matrix)."""
    return [
        name
        for name, values in state.arrays.items()
        if np.issubdtype(np.asarray(values).dtype, np.floating) and not np.isfinite(np.sum(values))
    ]
