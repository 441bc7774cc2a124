"""A run's plan, computed once before any round: the client split (with each client's
validation rows, where the partitioner places them), the per-client step bound and the run
context every participant receives. Backends call `plan_run` through the `prepare` callback
(raysim.core.backend) once the dataset is loaded where it belongs."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raysim import registry
from raysim.config import Config
from raysim.core import schedule as round_schedule
from raysim.core.algorithm import RunContext
from raysim.core.backend import RuntimeAttachments
from raysim.data.datasets import Dataset
from raysim.data.partition import options_with_defaults, split_dataset
from raysim.data.split import ClientSplit, PartitionResult
from raysim.errors import RaysimError
from raysim.runtime.client_state import store_for
from raysim.seeds import PARTITION, purpose_seed

# The most optimizer steps one client may take in one round (local_epochs x its batches): the
# largest runs raysim reproduces take a few thousand; more would keep round 1 from ending.
MAX_LOCAL_STEPS = 10_000_000


@dataclass(frozen=True)
class RunPlan:
    """What a run computes once from its config and dataset."""

    partition: PartitionResult  # the partitioner's whole answer (training + validation rows)
    split: ClientSplit  # each client's training rows
    ctx: RunContext  # the config, the data's shapes and the per-client validation rows
    # which clients train in each round (and with `devices:`, when): the run's one
    # raysim.core.schedule.RoundSchedule, which the round loop and the replays after a lost
    # server follow
    rounds: Any = None

    @property
    def schedule(self) -> Any:
        """devices.aggregation fedbuff | fedasync: the whole event schedule, computed before
        anything trains (`rounds`' clock, raysim.core.schedule.async_events.AsyncSchedule); it
        rides in the server's data (raysim.core.server.ServerData), not in the context every
        worker gets. None otherwise."""
        return self.rounds.clock if self.ctx.config.devices.asynchronous else None


def plan_run(config: Config, dataset: Dataset) -> RunPlan:
    """The plan of a run in this process (what the local backend brings: a client-state store
    here when the algorithm uses one), for scripts that split a dataset as a run would."""
    return plan_with(config, dataset, RuntimeAttachments(client_state=store_for(config, "local")))


def plan_with(config: Config, dataset: Dataset, attachments: RuntimeAttachments) -> RunPlan:
    """Partition `dataset` for `config` once (read from `partition.cache_dir` when cached),
    check the client step bound, and build the run context, once, with what the backend
    brings (`attachments`: its client-state store, index builder and granted GPUs). Backends
    call it through the assembly's `prepare` (raysim.core.backend)."""
    config = with_granted_gpus(config, attachments)
    partition = partition_for_run(config, dataset)
    split = partition.train
    check_local_steps(config, split)
    ctx = dataclasses.replace(
        run_context(config, dataset, partition),
        client_state=attachments.client_state,
        index_builder=attachments.index_builder,
    )
    # (whether the method can run asynchronously is asked where it is wrapped so, when the
    # server builds it: raysim.core.async_aggregation)
    rounds = round_schedule.build(config, np.diff(split.offsets), ctx)
    return RunPlan(partition, split, ctx, rounds)


def with_granted_gpus(config: Config, attachments: RuntimeAttachments) -> Config:
    """`config` with the GPUs the backend could grant (`attachments.clients_num_gpus` /
    `server_num_gpus`; unchanged when nothing was cut): the run's context carries what runs."""
    clients_gpus, server_gpus = attachments.clients_num_gpus, attachments.server_num_gpus
    if clients_gpus is None and server_gpus is None:
        return config
    clients, server = config.clients, config.server
    if clients_gpus is not None:
        clients = dataclasses.replace(clients, num_gpus=clients_gpus)
    if server_gpus is not None:
        server = dataclasses.replace(server, num_gpus=server_gpus)
    return dataclasses.replace(config, clients=clients, server=server)


def check_local_steps(config: Config, split: ClientSplit) -> None:
    """Refuse a split whose largest client would take more than MAX_LOCAL_STEPS steps a round."""
    largest = int(np.diff(split.offsets).max()) if split.num_clients else 0
    clients = config.clients
    steps = clients.local_epochs * -(-largest // clients.batch_size)
    if steps > MAX_LOCAL_STEPS:
        raise RaysimError(
            f"clients.local_epochs={clients.local_epochs} with clients.batch_size="
            f"{clients.batch_size} gives the largest client ({largest} samples) {steps:,} local "
            f"steps a round, more than {MAX_LOCAL_STEPS:,}; use fewer epochs or larger batches"
        )


def run_context(config: Config, dataset: Dataset, partition: PartitionResult) -> RunContext:
    """The context of a run on `dataset` split as `partition`: shapes, registered plug-ins, and
    each client's validation rows of the test split (and of the validation split, placed on
    the clients by the same partitioner and seed: partition_for_run)."""
    placed = partition.validation is not None
    return RunContext(
        config,
        tuple(dataset.train_x.shape[1:]),
        dataset.num_classes,
        dataset.num_features,
        plugins=registry.snapshot(),  # names registered in this process, for the workers
        multilabel=np.ndim(dataset.train_y) == 2,
        client_validation=partition.validation,
        client_validation_of_val=partition.validation_of_val if placed else None,
    )


def partition_for_run(config: Config, dataset: Dataset) -> PartitionResult:
    """The run's partition (`partition:` section, the run's partition seed), read from the
    parquet cache in `partition.cache_dir` when it has it (and written there when it has not),
    with the clients' rows of the validation split where the clients hold test rows."""
    part = config.partition
    seed = purpose_seed(config.run.seed, PARTITION)

    def place(rows_of: Dataset) -> PartitionResult:  # the partitioner's one call site
        return split_dataset(rows_of, part.name, part.num_clients, seed, part.options)

    def with_validation_of_val(result: PartitionResult) -> PartitionResult:
        # A partitioner that places the test rows only (the built-in multi-label ones place
        # all three in one call): the validation split's rows placed on the clients the same
        # way, by a second call with them as the test set.
        placed = result.validation is None or result.validation_of_val is not None
        if placed or dataset.val_x is None:
            return result
        as_test = dataclasses.replace(dataset, test_x=dataset.val_x, test_y=dataset.val_y)
        return dataclasses.replace(result, validation_of_val=place(as_test).validation)

    if not part.cache_dir:
        return with_validation_of_val(place(dataset))
    from raysim.data.store import load_split, save_split, split_cache_key

    identity = {
        "name": part.name,
        "num_clients": part.num_clients,
        "options": options_with_defaults(part.name, part.options),
    }
    key = split_cache_key(
        data=config.to_dict()["data"],
        partition=identity,
        seed=config.run.seed,
        num_train=len(dataset.train_y),
    )
    path = Path(part.cache_dir) / f"split_{key}.parquet"
    validation_path = path.with_name(f"split_{key}_validation.parquet")
    # Cached splits are input: checked against this dataset and partition.num_clients like a
    # partitioner's result (split_dataset), refused in one line if they do not fit.
    if os.path.lexists(path):
        train, metadata = load_split(
            path, num_clients=part.num_clients, num_rows=len(dataset.train_y)
        )
        if not metadata.get("validation"):
            return PartitionResult(train)
        if os.path.lexists(validation_path):
            validation, _ = load_split(
                validation_path, num_clients=part.num_clients, num_rows=len(dataset.test_y)
            )
            return with_validation_of_val(PartitionResult(train, validation))
    result = place(dataset)
    metadata = {
        "dataset": dataset.name,
        "partition": part.name,
        "validation": result.validation is not None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    if result.validation is not None:  # first: a training file implies its validation
        save_split(validation_path, result.validation, metadata)
    save_split(path, result.train, metadata)
    return with_validation_of_val(result)
