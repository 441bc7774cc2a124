"""The server keeper replays the rounds after a lost server with the round plan it was given
(the same one the round loop follows: with `devices:` the simulated clock's, not the seed's
sample), so a replayed round trains the clients it trained the first time."""

from __future__ import annotations

import numpy as np

from raysim.assembly.recovery import ServerKeeper
from raysim.core.faults import ServerLost
from raysim.core.state import RoundInfo


class _Backend:
    """Loses its server once, at the first call; records the rounds replayed."""

    def __init__(self) -> None:
        self.lost, self.restarted, self.replayed = False, [], []

    def restart(self, state) -> None:
        self.restarted.append(state)

    def run_round(self, info, evaluate, next_info):
        self.replayed.append(info)

    def get_state(self):
        if not self.lost:
            self.lost = True
            raise ServerLost("server actor died")
        return "state"


def test_a_lost_server_is_replayed_with_the_plan_it_was_given(tmp_path):
    def plan(round_index: int) -> RoundInfo:  # not the seed's sample: a clock's own choice
        return RoundInfo(round_index, np.array([round_index, 100 + round_index]))

    backend = _Backend()
    keeper = ServerKeeper(backend, tmp_path, None, plan)  # no checkpoint: from the start
    assert keeper.call(backend.get_state, 3) == "state"
    assert backend.restarted == [None] and keeper.restarts == keeper.restarts_in_round == 1
    assert [info.round_index for info in backend.replayed] == [0, 1, 2]
    assert [info.client_ids.tolist() for info in backend.replayed] == [[0, 100], [1, 101], [2, 102]]
    assert keeper.replayed_in_round == 3
