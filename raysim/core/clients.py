"""Training a batch of clients: the body of a client task, shared by every backend.

Client data arrives as the whole training array plus CSR (indices, offsets): client c owns rows
indices[offsets[c]:offsets[c+1]]. Slicing copies only that client's rows, so a task touches
nothing but its own clients' data.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from raysim.core.algorithm import AlgorithmHooks, RunContext
from raysim.core.batched_training import batched_update_chunks
from raysim.core.faults import FaultPlan
from raysim.core.payload import encoded_nbytes
from raysim.core.state import ReducedUpdate, WireChunk, WireUpdate
from raysim.core.validation import metrics_problem, samples_problem, wire_format
from raysim.core.wire_chunk import TaskMessages
from raysim.seeds import client_generators


def train_clients(
    ctx: RunContext,
    algorithm,
    payload,
    train_x: np.ndarray,
    train_y: np.ndarray,
    indices: np.ndarray,
    offsets: np.ndarray,
    round_index: int,
    client_ids: Sequence[int],
    personal_payloads: Sequence | None = None,
    attempts: Sequence[int] | None = None,
    hard_exits: bool = False,
) -> list[WireUpdate | WireChunk | ReducedUpdate]:
    """Run local training for `client_ids` one after another; updates in the same order.
    Under the dense codec a batched chunk's leave as one WireChunk (raysim.core.wire_chunk).

    With `personal_payloads` (one per client, from the algorithm's `client_payload`), each
    client receives `(payload, its personal payload)`. An algorithm with a `task_reducer`
    gets its clients' updates folded into one `ReducedUpdate`, which is all the task returns.

    Under `faults:` every client first meets the fault plan at its attempt (`attempts`, one
    per client, default 0; raysim.core.faults), in order and before any client trains: it may
    sleep (straggler) or fail, which ends the whole call (an InjectedClientFailure, or with
    `hard_exits` an exit of the process). Failing before training leaves no client of the task
    half-done, so a retried client never repeats a client-state store write.
    """
    if personal_payloads is not None and len(personal_payloads) != len(client_ids):
        raise ValueError(
            f"{len(personal_payloads)} personal payloads for {len(client_ids)} clients"
        )
    hooks = AlgorithmHooks.of(algorithm)
    make_reducer = hooks.task_reducer
    reducer = make_reducer(ctx) if make_reducer is not None else None
    # Updates leave the task encoded by the run's codec (what crosses the wire).
    codec, layout = wire_format(algorithm, ctx) if reducer is None else (None, None)
    reduced = ReducedUpdate([], [], None, [], 0)
    # Under the dense codec a batched chunk's updates leave as one WireChunk of its rows
    # (raysim.core.wire_chunk), the others one by one.
    messages = TaskMessages(codec, layout) if reducer is None else None
    faults = FaultPlan.from_config(ctx.config)
    if faults is not None:
        for position, client_id in enumerate(client_ids):
            attempt = 0 if attempts is None else int(attempts[position])
            faults.inject(round_index, int(client_id), attempt, hard_exits)
    previous_threads = torch.get_num_threads()
    if previous_threads != ctx.client_threads:
        # Same thread count on every backend: float results can depend on it.
        torch.set_num_threads(ctx.client_threads)
    try:
        # clients.batched: the task's clients trained a chunk at a time (None: one by one).
        batched = None
        if ctx.config.clients.batched:
            batched = batched_update_chunks(
                ctx,
                hooks,
                payload,
                train_x,
                train_y,
                indices,
                offsets,
                round_index,
                client_ids,
                personal_payloads,
            )
        if batched is None:  # each client's generator, their seeds derived together
            generators = client_generators(ctx.seed, round_index, client_ids)

        def one_by_one():
            for position, client_id in enumerate(client_ids):
                rows = indices[offsets[client_id] : offsets[client_id + 1]]
                x = torch.from_numpy(train_x[rows])
                y = torch.from_numpy(train_y[rows].astype(np.int64, copy=False))
                client_payload = (
                    payload if personal_payloads is None else (payload, personal_payloads[position])
                )
                yield [
                    algorithm.client_update(
                        client_payload, x, y, int(client_id), generators[position], ctx
                    )
                ]

        def take(updates: list, position: int) -> None:
            """Fold (or queue) one chunk's updates, the clients from `position` on; the list
            is emptied, so that nothing of the chunk (a GPU's trained rows) stays alive
            while the next chunk trains."""
            for offset, update in enumerate(updates):
                client_id = int(client_ids[position + offset])
                if reducer is None:
                    messages.add(update)
                    continue
                # The reducer checks each update before folding it in (the server never
                # sees them one by one); a refused update is left out, as if the client
                # dropped out.
                problem = (
                    samples_problem(
                        update.num_samples, int(offsets[client_id + 1] - offsets[client_id])
                    )
                    or metrics_problem(update.metrics)
                    # with personal payloads, also what this client was sent (FedAwS: its own
                    # class's row, the only row it may write back)
                    or (
                        reducer.add(update)
                        if personal_payloads is None
                        else reducer.add(update, personal_payloads[position + offset])
                    )
                )
                if problem is not None:
                    reduced.rejected.append((int(update.client_id), problem))
                    continue
                reduced.client_ids.append(update.client_id)
                reduced.num_samples.append(update.num_samples)
                reduced.metrics.append(update.metrics)
                reduced.bytes_up += encoded_nbytes(update.vector)
            updates.clear()

        position = 0
        for updates in batched if batched is not None else one_by_one():
            count = len(updates)
            take(updates, position)
            position += count
        if reducer is None:
            return messages.result()
        if not (reduced.client_ids or reduced.rejected):
            return []
        reduced.message = reducer.result() if reduced.client_ids else None
        return [reduced]
    finally:
        if previous_threads != ctx.client_threads:
            torch.set_num_threads(previous_threads)


def chunk_clients(client_ids: np.ndarray, num_chunks: int) -> list[np.ndarray]:
    """Split ascending ids into `num_chunks` contiguous runs of near-equal length."""
    num_chunks = max(1, min(num_chunks, len(client_ids)))
    return [chunk for chunk in np.array_split(client_ids, num_chunks) if len(chunk)]


def single_class_of_clients(labels: np.ndarray, indices: np.ndarray, offsets: np.ndarray):
    """The one class each client holds: int64 per client, -1 where a client is empty or holds
    several classes (only 1-D integer labels have classes in this sense)."""
    num_clients = len(offsets) - 1
    classes = np.full(num_clients, -1, dtype=np.int64)
    if labels.ndim != 1 or not len(indices):
        return classes
    client_labels = labels[indices].astype(np.int64, copy=False)
    sizes = np.diff(offsets)
    nonempty = np.flatnonzero(sizes)
    first = client_labels[offsets[nonempty]]
    # A client is single-class when its smallest and largest label agree.
    low = np.minimum.reduceat(client_labels, offsets[nonempty])
    high = np.maximum.reduceat(client_labels, offsets[nonempty])
    classes[nonempty] = np.where(low == high, first, -1)
    return classes
