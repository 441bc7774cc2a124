"""The sections that say what is simulated: `run:` (rounds, evaluation, checkpoints), `data:`
(the dataset plug-in) and `partition:` (the partitioner plug-in), each with its own checks."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from raysim import registry
from raysim.config.limits import MAX_COUNT, MAX_WAIT_S, finite, is_path, require
from raysim.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "run"
    seed: int = 0
    rounds: int = 30
    eval_every: int = 1  # evaluate the global model every N rounds (and always after the last)
    # Rounds (1-based) evaluated besides those: a table that names rounds reads exactly them.
    eval_at: tuple[int, ...] = ()
    checkpoint_every: int = 10  # write a checkpoint every N rounds (0: only after the last)
    keep_checkpoints: int = 3
    # Ray backend: client tasks still running this many seconds after the round's dispatch are
    # cancelled and their clients dropped for the round (None: wait for every client). In the
    # first round, which starts the workers, it counts from the first update's arrival.
    round_deadline_s: float | None = None
    # Stop the run (exit status 2, saying why) after this many rounds in a row that left the
    # model unchanged (every update dropped, late or rejected): a run that trains nothing
    # must not end as if it had succeeded. 0: never stop.
    max_idle_rounds: int = 5

    def check(self, source: str, resolve: bool = True) -> None:
        require(
            source,
            bool(self.name) and not set(self.name) & {"/", "\\", "\0"},
            "run.name",
            "a non-empty name without '/', '\\' or NUL (it names the output folder)",
            self.name,
        )
        # A newline or a right-to-left override (U+202E) in a folder name forges what a listing
        # or a log line shows: no control (Cc) or formatting (Cf) character.
        require(
            source,
            not any(unicodedata.category(char) in ("Cc", "Cf") for char in self.name),
            "run.name",
            "a name without control or formatting characters (newline, tab, U+202E, ...)",
            self.name,
        )
        rounds = self.rounds
        require(
            source, 1 <= rounds <= MAX_COUNT, "run.rounds", f">= 1 and <= {MAX_COUNT:.0e}", rounds
        )
        require(source, self.eval_every >= 1, "run.eval_every", ">= 1", self.eval_every)
        require(
            source,
            all(1 <= r <= rounds for r in self.eval_at),
            "run.eval_at",
            f"rounds in [1, run.rounds = {rounds}]",
            list(self.eval_at),
        )
        every, keep = self.checkpoint_every, self.keep_checkpoints
        require(source, every >= 0, "run.checkpoint_every", ">= 0", every)
        require(source, keep >= 1, "run.keep_checkpoints", ">= 1", keep)
        require(source, self.seed >= 0, "run.seed", ">= 0", self.seed)
        require(
            source, self.max_idle_rounds >= 0, "run.max_idle_rounds", ">= 0", self.max_idle_rounds
        )
        deadline = self.round_deadline_s
        require(
            source,
            deadline is None or (deadline > 0 and finite(deadline)),
            "run.round_deadline_s",
            "a finite number of seconds > 0, or null",
            deadline,
        )
        require(
            source,
            deadline is None or deadline <= MAX_WAIT_S,
            "run.round_deadline_s",
            f"at most {MAX_WAIT_S:.0f} seconds (1 day), or null to wait for every client",
            deadline,
        )


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    name: str = "digits"
    root: str | None = None
    # Share of the training rows held out as the validation split (drawn from the run seed,
    # before the client split): runs report `val/...` beside the test set's `eval/...`, and
    # sweeps tune on it. 0: no validation split.
    validation_fraction: float = 0.0
    options: Mapping[str, Any] = field(default_factory=dict)

    def check(self, source: str, resolve: bool = True) -> None:
        """The dataset's own options are checked when it is built (it needs its files)."""
        fraction = self.validation_fraction
        require(
            source,
            finite(fraction) and 0.0 <= fraction < 1.0,
            "data.validation_fraction",
            "in [0, 1)",
            fraction,
        )
        require(source, is_path(self.root), "data.root", "a path", self.root)


@dataclass(frozen=True, kw_only=True)
class PartitionConfig:
    """The partitioner `name` (raysim.registry.partitioners) and its options: every other key of
    the `partition:` section, e.g. dirichlet's `alpha` or shards' `shards_per_client`."""

    name: str = "iid"
    num_clients: int = 100
    cache_dir: str | None = None  # cache the split as parquet here (and reuse it)
    options: Mapping[str, Any] = field(default_factory=dict)

    def check(self, source: str, resolve: bool = True) -> None:
        require(source, is_path(self.cache_dir), "partition.cache_dir", "a path", self.cache_dir)
        require(
            source,
            1 <= self.num_clients <= MAX_COUNT,
            "partition.num_clients",
            f">= 1 and <= {MAX_COUNT:.0e}",
            self.num_clients,
        )
        try:  # the partitioner's own checks of its option values (dirichlet's alpha > 0, ...)
            if resolve:
                registry.partitioners.check_option_values(self.name, self.options, "partition")
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None
