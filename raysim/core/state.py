"""Plain data that moves between the round loop, the server and the clients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # annotations only: codecs sit above this module
    from raysim.core.codecs import Codec
    from raysim.models.layout import VectorLayout


@dataclass
class ServerState:
    """Everything the server needs to continue a run: named arrays (checkpointed as .npz).

    Algorithms choose the names (FedAvg: 'params' plus server-optimizer slots such as
    'optimizer.momentum'); keeping the state as flat named arrays makes checkpoints safe to load
    (no pickle) and lets tests compare runs exactly.
    """

    round: int
    arrays: dict[str, np.ndarray]

    def copy(self) -> ServerState:
        return ServerState(self.round, {k: v.copy() for k, v in self.arrays.items()})


@dataclass
class ClientUpdate:
    """What one client's local training produced (an algorithm's `client_update` returns it).

    `vector` is the update as the algorithm computed it: a flat vector (FedAvg: the float32
    delta `local - global`; FRL: rank positions), which the client task then encodes with the
    run's codec into a `WireUpdate` (`encoded`); or, for an algorithm that reduces its updates
    inside the task (`task_reducer`), whatever its reducer reads (FedAwS: its class row and
    theta's delta), which never leaves the task. `num_samples` is the number of training
    samples (the weight of weighted averaging). `stats` are statistics the client declares
    beside its update (FLAG: how many labels it holds); aggregators see them in the client's
    `Contribution`. Numbers only.
    """

    client_id: int
    num_samples: int
    vector: Any
    metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)

    def encoded(self, codec: Codec, layout: VectorLayout | None) -> WireUpdate:
        """This update as it crosses the wire: `vector` encoded by `codec` for `layout`."""
        return WireUpdate(
            self.client_id,
            self.num_samples,
            codec.encode(self.vector, layout),
            self.metrics,
            self.stats,
        )


@dataclass(frozen=True)
class WireUpdate:
    """One client's update as the server receives it: `message` is `ClientUpdate.vector`
    encoded by the run's codec (raysim.core.codecs: dense, packed signs, top-k, packed ranks),
    exactly what crossed the wire. The server counts its bytes, checks it (a client can send
    anything, so every field is checked before use) and decodes it into the dense vector the
    aggregator sees. A separate record from ClientUpdate so that no field changes meaning
    between the algorithm and the server: the algorithm's vector never travels, and the server
    never reads an unencoded one.
    """

    client_id: int
    num_samples: int
    message: Any
    metrics: dict[str, float] = field(default_factory=dict)
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class WireChunk:
    """Several clients' updates of one batched chunk as one message (raysim.core.wire_chunk):
    row i of `messages` is client `client_ids[i]`'s update encoded by the run's codec: an array
    of rows for a codec whose message is one array (dense: the vector itself), or a tuple of
    arrays of rows for one whose message is a list of arrays (ranks: one per layer), row i of
    each making client i's list. One object instead of one per client: a task returns (and Ray
    serialises) it whole, and the server checks and folds the rows with whole-array
    operations, with the same results as for the clients' `WireUpdate`s one by one
    (`updates()`), in client-id order. Built by the client task, never by an algorithm.
    """

    client_ids: np.ndarray  # int64, ascending as the task trained them
    num_samples: np.ndarray  # int64, one per client
    messages: np.ndarray | tuple[np.ndarray, ...]  # (clients, entries), or a tuple of them
    metrics: tuple[dict[str, float], ...]
    stats: tuple[dict[str, float], ...]

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    def updates(self) -> list[WireUpdate]:
        """The chunk as the clients' own updates (rows are views, nothing copied)."""
        messages = self.messages
        if isinstance(messages, tuple):  # row i of each array: client i's list of arrays
            messages = [list(parts) for parts in zip(*messages, strict=True)]
        return [
            WireUpdate(int(c), int(n), message, m, s)
            for c, n, message, m, s in zip(
                self.client_ids,
                self.num_samples,
                messages,
                self.metrics,
                self.stats,
                strict=True,
            )
        ]

    def first_message(self):
        """Client 0's message (its views), as `updates()` gives it."""
        messages = self.messages
        return [part[0] for part in messages] if isinstance(messages, tuple) else messages[0]


@dataclass(frozen=True)
class Contribution:
    """One client's part of a round, as an aggregator sees it: the decoded update vector,
    its number of training samples and the statistics it declared (checked: finite numbers)."""

    client_id: int
    update: np.ndarray
    num_samples: int
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class ReducedUpdate:
    """Several clients' updates already combined inside their task (algorithms that reduce).

    Algorithms whose updates are large (FedAwS at Amazon-670K scale: a model of 288 MB, 4,000
    clients a round) sum their clients' contributions in the task, exactly (integer
    fixed-point, so any packing of clients into tasks gives the same sum), and return one of
    these per task. `message` is the algorithm's partial aggregate; the per-client facts the
    server reports (sample counts, losses, bytes each client would have sent) travel beside it.
    """

    client_ids: list[int]
    num_samples: list[int]
    message: Any
    metrics: list[dict[str, float]]
    bytes_up: int  # sum over the clients of their encoded update size
    # Updates the task refused before reducing (NaN/Inf, wrong shapes): (client id, reason);
    # those clients are in none of the lists above.
    rejected: list[tuple[int, str]] = field(default_factory=list)

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)


def clients_in(updates) -> int:
    """How many clients a task's result speaks for: a WireUpdate one, a WireChunk its rows, a
    ReducedUpdate the clients it folded and those it refused."""
    count = 0
    for update in updates:
        if isinstance(update, ReducedUpdate):
            count += update.num_clients + len(update.rejected)
        elif isinstance(update, WireChunk):
            count += update.num_clients
        else:
            count += 1
    return count


@dataclass(frozen=True)
class RoundInfo:
    """Facts about one round that aggregators and attacks may use.

    Malicious clients are the lowest client ids (ids < `malicious_below`), so in the
    ascending round order they always come first; `num_malicious` of them were sampled.
    """

    round_index: int
    client_ids: np.ndarray
    malicious_below: int = 0
    # Malicious clients, not sampled this round, that the colluding attacker also trains to
    # learn what benign updates look like (FRL's code: 25 a round). Their updates reach only
    # the attack's `craft`: never the aggregate, the byte counts or the client counts.
    attacker_pool: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # `attack.benign_set: pool`: the clients whose honest updates alone make the attacker's
    # benign set (the pool's whole draw, its members sampled this round included; ascending).
    # None (`sampled_and_pool`): the sampled malicious clients and `attacker_pool`.
    attacker_benign: np.ndarray | None = None
    # Set only on the copy handed to `craft`: `honest[benign_start:]` is the attacker's benign
    # set (0: all of `honest`; with `attacker_benign`, the count of its own updates before it).
    benign_start: int = field(default=0, compare=False)
    # What an attack's `craft` sees beside the updates: the state array the round's updates
    # are deltas of (the global model the clients received; `update_delta_of`), read-only.
    # Set only on the copy handed to `craft` (None elsewhere, so it never travels to tasks).
    delta_base: np.ndarray | None = field(default=None, compare=False, repr=False)

    @property
    def num_clients(self) -> int:
        return len(self.client_ids)

    @property
    def trained_ids(self) -> np.ndarray:
        """Every client trained this round (sampled + attacker pool), ascending."""
        if not len(self.attacker_pool):
            return self.client_ids
        return np.union1d(self.client_ids, self.attacker_pool)

    @property
    def num_malicious(self) -> int:
        return int(np.searchsorted(self.client_ids, self.malicious_below))


@dataclass
class RoundStats:
    """Server-side summary of one round, merged into the round's metrics.jsonl record."""

    clients_done: int = 0
    # Failed attempts at training a sampled client (crashes, injected faults); each retried up
    # to clients.max_retries times, then the client is dropped for the round (clients_dropped,
    # which also counts clients cut off by run.round_deadline_s: clients_late).
    clients_failed: int = 0
    clients_dropped: int = 0
    clients_late: int = 0
    task_retries: int = 0  # client tasks submitted again after a failure (depends on packing)
    # Updates the server refused before aggregation (raysim.core.validation): not folded in,
    # not counted in clients_done; `rejected` holds one log line per refusal (with client id).
    clients_rejected: int = 0
    rejected: list[str] = field(default_factory=list)
    # False when the round left the model as it was: every update was dropped, late, rejected
    # or weighed 0, or the server refused the update (raysim.core.loop stops a run after
    # `run.max_idle_rounds` such rounds in a row).
    model_updated: bool = True
    bytes_up: int = 0
    bytes_down: int = 0
    train_loss: float = float("nan")
    update_norm_mean: float = float("nan")
    clients_s: float = 0.0  # wall time from dispatch until the last update was folded in
    client_compute_s: float = 0.0  # sum over tasks of their training time (CPU-side work)
    tasks: int = 0
    # Where the round's clients trained, for the progress line (not in metrics.jsonl): e.g.
    # "2 tasks on 2 nodes", "the server actor", "this process"; set by the backend.
    trained_in: str = ""
    # Set (to the client's error) when the clients failed inside the Ray server actor and the
    # round was trained again in tasks (raysim.runtime.ray_server); "" otherwise.
    server_place_failed: str = ""
    # How many rounds came back in the one backend call that brought this round (rounds the
    # Ray backend ran ahead in a block: the driver waited for them all at the block's first
    # round, so its wall time covers the block and the others' almost nothing); 1 otherwise.
    rounds_in_call: int = 1
    aggregate_s: float = 0.0
    evaluate_s: float = 0.0
    # Further server-side phases an algorithm reports (FedAwS: index_s, spreadout_s).
    server_times: dict[str, float] = field(default_factory=dict)
    eval: dict[str, float] = field(default_factory=dict)  # on the test split
    val: dict[str, float] = field(default_factory=dict)  # on the validation split, if any
