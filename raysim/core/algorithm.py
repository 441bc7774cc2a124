"""The Algorithm protocol and the run context shared by the server and the client tasks.

An algorithm is a plug-in with five pure-ish methods (docs/ARCHITECTURE.md). The engine never looks
inside payloads or states; it only moves them, counts their bytes and reduces updates in
client-id order. How clients are executed (in-process or as Ray tasks) is the backend's job,
never the algorithm's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

import numpy as np
import torch

from raysim import registry
from raysim.config import Config
from raysim.core.state import ClientUpdate, ServerState


@dataclass(frozen=True)
class RunContext:
    """What every participant knows about the run: the resolved config and the data's shape."""

    config: Config
    input_shape: tuple[int, ...]
    num_classes: int
    # Vocabulary size of sparse bag-of-words inputs (Dataset.num_features); None: dense inputs.
    num_features: int | None = None
    # Multi-label data: each client's validation rows of the test set (a ClientSplit over
    # test_x; FLAG's AmAP/GmAP). None when the split has no per-client validation.
    client_validation: Any = field(default=None, compare=False)
    # The same for the validation split (`data.validation_fraction`): each client's rows of
    # val_x. The server evaluates the validation split with this as `client_validation`.
    client_validation_of_val: Any = field(default=None, compare=False)
    # The explicit client state store (raysim.runtime.client_state) when the algorithm
    # declares `uses_client_state = True`; None otherwise.
    client_state: Any = field(default=None, compare=False)
    # Plug-ins registered from the user's own code (raysim.registry.snapshot()): re-registered
    # wherever this context is unpickled (server actor, client workers, shards), so a name
    # registered in the driver resolves the same way everywhere.
    plugins: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # Multi-hot labels (n, L) rather than one class per sample.
    multilabel: bool = False
    # How the backend builds a nearest-class index (raysim.index.build_index's signature):
    # the Ray backend's puts several shards in actors. None: every shard in-process.
    index_builder: Any = field(default=None, compare=False)

    def __reduce__(self):
        return _restore_context, (tuple(getattr(self, f.name) for f in fields(self)),)

    @property
    def seed(self) -> int:
        return self.config.run.seed

    def data_shape(self) -> dict[str, Any]:
        """What rebuilding the model needs besides the config, kept in each checkpoint's
        metadata (raysim.load_run reads it back into a RunContext)."""
        return {
            "input_shape": list(self.input_shape),
            "num_classes": int(self.num_classes),
            "num_features": self.num_features,
        }

    @property
    def client_threads(self) -> int:
        """Torch threads inside a client task = the CPUs the task reserves (at least one)."""
        return max(1, int(self.config.clients.num_cpus))

    def model_key(self) -> str:
        # Asked for by every client (cached_model); the context is immutable, so the key is
        # built once per context object (json.dumps costs ~10 us, a client's step ~100 us).
        key = self.__dict__.get("_model_key")
        if key is None:
            model = self.config.model
            key = json.dumps(
                [
                    model.name,
                    dict(model.options),
                    list(self.input_shape),
                    self.num_classes,
                    self.num_features,
                ],
                sort_keys=True,
            )
            object.__setattr__(self, "_model_key", key)
        return key


def _restore_context(values: tuple) -> RunContext:
    context = RunContext(*values)
    registry.install(context.plugins)
    return context


class Algorithm(Protocol):
    """What every algorithm provides (checked when a run starts: `check_algorithm`)."""

    # Aggregator used when the config says `aggregator.name: auto`: a registered name (FedAvg:
    # 'weighted_mean'; FRL: 'sum', the vote over rank positions) or an aggregator object built
    # from the algorithm's own options (FLAG's label weighting).
    default_aggregator: Any

    def init_server(self, ctx: RunContext) -> ServerState: ...

    def server_payload(self, state: ServerState) -> Any:
        """What every sampled client receives this round (put in the object store once)."""

    def client_update(
        self,
        payload: Any,
        x: torch.Tensor,
        y: torch.Tensor,
        client_id: int,
        generator: torch.Generator,
        ctx: RunContext,
    ) -> ClientUpdate:
        """Local training of one client; pure given its inputs (runs inside a task). Returns
        the update as a flat vector in `vector` (the task encodes it with the run's codec)
        and any statistics the aggregator may weigh in `stats`."""

    def server_update(
        self, state: ServerState, aggregate: np.ndarray, ctx: RunContext
    ) -> tuple[ServerState, Mapping[str, float]]:
        """Apply the aggregated update; returns (state, diagnostics): the next round's state
        and the seconds of server phases it timed itself, e.g. {'index_s': 0.2}, reported in
        the round's time split ({} when it times none). Anything else is refused."""

    def evaluate(
        self, state: ServerState, x: np.ndarray, y: np.ndarray, ctx: RunContext
    ) -> dict[str, float]: ...


REQUIRED_METHODS = ("init_server", "server_payload", "client_update", "server_update", "evaluate")

# Optional hooks, each checked by `check_algorithm` when a run starts.
#
# Wire format (raysim.core.codecs):
#     def update_layout(self, ctx) -> VectorLayout   size / dtype / segments of the update
#         vector (without it the size is not checked); `default_codec` (a registered codec
#         name or a codec object, default 'dense'); `configurable_codec = False` refuses a
#         config's `codec:` (FRL's ranks); `shared_mask(ctx)` -> bool per entry: only those
#         are sent (personal layers stay on the client).
# Aggregation:
#     def check_aggregator(self, aggregator, ctx) -> str | None   why a configured aggregator
#         does not fit (FLAG needs its label weighting), or None.
#     def observe_contributions(self, previous, state, contributions, ctx) -> ServerState
#         called after server_update with the round's contributions (FLAG keeps each
#         client's local model for AmAP).
# Per-client payloads (FedAwS sends each client only its own class row):
#     def client_payload(self, state, client_ids, client_classes) -> Sequence:
#         one personal payload per client id, in the same order; `client_classes[i]` is the one
#         class client_ids[i] holds (-1 unless the split puts one class per client). The
#         client's `client_update` then receives `(broadcast_payload, personal_payload)`.
# In-task reduction (updates too large to send one per client):
#     def task_reducer(self, ctx) -> reducer with .add(update: ClientUpdate) -> reason | None
#         (with `client_payload`: .add(update, sent), `sent` = that client's personal payload)
#         and .result() -> message; the task returns one ReducedUpdate instead of its updates.
#     def merge_reduced(self, accumulated | None, message, ctx) -> accumulated;
#         folded on the server in task order, must be exact (integer) so packing cannot matter.
#     def finish_reduced(self, accumulated, ctx) -> aggregate handed to server_update.
#     Such algorithms own their aggregation: `aggregator.name` must stay `auto`.
# Update size: `update_delta_of = "params"` names the state array the updates are deltas of;
#     an update whose norm exceeds server.max_update_ratio x max(1, ||state[name]||) is refused.
# Server state restored from a checkpoint: def state_restored(self, state, ctx) -> None.
# Each accepted update before it is folded:
#     def weigh_update(self, state, round_index, client_id, vector) -> vector
#         (asynchronous aggregation weighs it by its staleness: raysim.core.schedule.async_events).
# Per-client state between rounds: `uses_client_state = True` (ctx.client_state).
# Asynchronous aggregation (devices.aggregation fedbuff | fedasync):
#     def asynchronous_problem(self, config) -> str | None   why this instance's server step is
#         not a function of the aggregate (one line), or None. Declared by a method with
#         observe_contributions (refused without it); raysim.core.async_aggregation checks
#         the rest.
# Batched clients (`clients.batched: true`; docs/BATCHED.md):
#     def batched_client_updates(self, payload, batch, ctx) -> list[ClientUpdate]
#         one update per client of `batch` (raysim.core.batched_training.ClientBatch), in its
#         order, each what `client_update` returns for that client up to float rounding and a
#         function of that client's inputs only (never of the chunk it shares).
#     def batching_problem(self, ctx) -> str | None   why this instance cannot batch (a
#         subclass overriding the local training, a model vmap cannot run), or None.

_HOOK_GROUPS = {
    "task_reducer": ("task_reducer", "merge_reduced", "finish_reduced"),
}
_CALLABLE_HOOKS = (
    "update_layout",
    "shared_mask",
    "check_aggregator",
    "observe_contributions",
    "client_payload",
    "task_reducer",
    "merge_reduced",
    "finish_reduced",
    "state_restored",
    "batched_client_updates",
    "batching_problem",
    "weigh_update",
    "asynchronous_problem",
)


@dataclass(frozen=True)
class AlgorithmHooks:
    """An algorithm's optional hooks and declarations, looked up once (`AlgorithmHooks.of`):
    the engine reads these fields instead of probing the algorithm object, and None means the
    algorithm does not have that hook (the protocol above says what each one does)."""

    labels: str = "any"  # "single", "multi" or "any": the label shapes it trains on
    update_layout: Any = None
    default_codec: Any = "dense"
    configurable_codec: bool = True
    shared_mask: Any = None
    check_aggregator: Any = None
    observe_contributions: Any = None
    client_payload: Any = None
    task_reducer: Any = None
    merge_reduced: Any = None
    finish_reduced: Any = None
    update_delta_of: str | None = None
    state_restored: Any = None
    uses_client_state: bool = False
    batched_client_updates: Any = None
    batching_problem: Any = None
    weigh_update: Any = None
    asynchronous_problem: Any = None

    @classmethod
    def of(cls, algorithm: Any) -> AlgorithmHooks:
        """The hooks `algorithm` (an instance, or its class) defines; the rest keep their
        defaults. The one place the engine looks for optional members of an algorithm."""
        found = {
            f.name: getattr(algorithm, f.name) for f in fields(cls) if hasattr(algorithm, f.name)
        }
        return cls(**found)

    @property
    def reduces_in_task(self) -> bool:
        return self.task_reducer is not None


def check_labels(algorithm: Any, name: str, ctx: Any) -> None:
    """An algorithm declaring `labels = "single"` (or "multi") refuses the other kind of data
    in one line, before any client trains (instead of an error deep inside a loss)."""
    wants = AlgorithmHooks.of(algorithm).labels
    multilabel = bool(ctx.multilabel)
    if wants == "single" and multilabel:
        raise_config(
            f"algorithm '{name}' trains on single-label data, but the dataset has multi-hot "
            f"labels; use a multi-label algorithm (multilabel_fedavg, flag, ...)"
        )
    if wants == "multi" and not multilabel:
        raise_config(
            f"algorithm '{name}' needs multi-hot labels, but the dataset has one class per "
            f"sample; use a multi-label dataset (e.g. data.name: synthetic_multilabel)"
        )


def raise_config(message: str) -> None:
    from raysim.errors import ConfigError

    raise ConfigError(message)


def check_algorithm(algorithm: Any, name: str) -> None:
    """One line naming what is missing when `algorithm` does not meet the protocol."""
    from raysim.errors import ConfigError

    kind = type(algorithm).__name__
    missing = [m for m in REQUIRED_METHODS if not callable(getattr(algorithm, m, None))]
    if not hasattr(algorithm, "default_aggregator"):
        missing.append("default_aggregator")
    if missing:
        raise ConfigError(
            f"algorithm '{name}' ({kind}) lacks {', '.join(missing)} (see docs/EXTENDING.md)"
        )
    for hook in _CALLABLE_HOOKS:
        if hasattr(algorithm, hook) and not callable(getattr(algorithm, hook)):
            raise ConfigError(f"algorithm '{name}' ({kind}): '{hook}' must be a method")
    for group in _HOOK_GROUPS.values():
        present = [h for h in group if hasattr(algorithm, h)]
        if present and len(present) != len(group):
            absent = [h for h in group if h not in present]
            raise ConfigError(
                f"algorithm '{name}' ({kind}) defines {', '.join(present)} but not "
                f"{', '.join(absent)}; in-task reduction needs all three"
            )
