"""The server-recovery wrapper: every call the round loop makes on the backend's server goes
through `ServerKeeper.call`, which restarts a lost server (ServerLost) from the run's newest
checkpoint and replays the rounds after it, as the first time, before calling again."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raysim.core.faults import ServerLost
from raysim.core.state import RoundInfo, ServerState
from raysim.errors import RaysimError
from raysim.outputs.checkpoints import checkpoint_paths, load_checkpoint

# Restarts of a lost server in a row (while recovering one round) before the run gives up.
MAX_SERVER_RESTARTS = 3


class ServerKeeper:
    """Calls on `backend`'s server, restarting it as often as it is lost.

    `checkpoint_dir`: where the run's checkpoints are; `restored`: the state the run was
    resumed from (None: a fresh run, whose initial state is a function of the seed); `plan`:
    round index -> RoundInfo, the round loop's own (replayed rounds take the same clients)."""

    def __init__(
        self,
        backend: Any,
        checkpoint_dir: Path,
        restored: ServerState | None,
        plan: Callable[[int], RoundInfo],
    ) -> None:
        self.backend, self.plan = backend, plan
        self.checkpoint_dir, self.restored = checkpoint_dir, restored
        self.restarts = 0  # over the whole run
        self.restarts_in_round = 0  # during the current round
        self.replayed_in_round = 0  # rounds replayed after those restarts

    def new_round(self) -> None:
        self.restarts_in_round = self.replayed_in_round = 0

    def call(self, fn: Callable[[], Any], rounds_done: int) -> Any:
        """`fn()`, after restarting the server (and replaying rounds up to `rounds_done`) as
        often as it is lost."""
        for _ in range(MAX_SERVER_RESTARTS):
            try:
                return fn()
            except ServerLost:
                self._recover(rounds_done)
        return fn()

    def _newest_checkpoint(self, before: int) -> ServerState | None:
        """The newest readable checkpoint of this run up to round `before` (else the state
        this run was resumed from; None: the initial state)."""
        for path in reversed(checkpoint_paths(self.checkpoint_dir)):
            try:
                state, _ = load_checkpoint(path)
            except RaysimError as error:
                print(f"raysim: skipping checkpoint: {error}", file=sys.stderr, flush=True)
                continue
            if state.round <= before:
                return state
        return self.restored

    def _recover(self, rounds_done: int) -> None:
        """The server was lost: restart it from the newest checkpoint and replay the rounds
        after it (not logged again: their records are already in metrics.jsonl), up to
        `rounds_done` rounds. Replayed rounds are computed exactly as the first time."""
        for _ in range(MAX_SERVER_RESTARTS):
            state = self._newest_checkpoint(rounds_done)
            since = state.round if state is not None else 0
            print(
                f"raysim: the server was lost; restarting it from round {since} and replaying "
                f"{rounds_done - since} round(s)",
                file=sys.stderr,
                flush=True,
            )
            self.restarts += 1
            self.restarts_in_round += 1
            try:
                self.backend.restart(state)
                for replay in range(since, rounds_done):
                    self.backend.run_round(self.plan(replay), False, None)
            except ServerLost:
                continue
            self.replayed_in_round += rounds_done - since
            return
        raise RaysimError(f"the server was lost {MAX_SERVER_RESTARTS} times in a row; giving up")
