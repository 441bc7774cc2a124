"""The server's bookkeeping of one round, as two small objects: `RoundFold`, what the round's
accepted updates add up to so far (the aggregate, the loss and norm sums), and `Collusion`,
what a colluding attacker holds until its last malicious client has arrived."""

from __future__ import annotations

import math

import numpy as np

from raysim.core.aggregators import LinearAccumulator
from raysim.core.state import Contribution, RoundInfo


class RoundFold:
    """The accepted updates of one round, folded in client-id order. Linear aggregators keep
    O(model) memory (`accumulator`); the others, and algorithms that observe the round's
    contributions, keep the contributions themselves."""

    def __init__(self, aggregator, keep_contributions: bool) -> None:
        self.aggregator = aggregator
        self.accumulator = LinearAccumulator(aggregator.normalize) if aggregator.linear else None
        self.keep_contributions = keep_contributions or self.accumulator is None
        self.contributions: list[Contribution] = []
        self.reduced = None  # an in-task reducing algorithm's merged messages (merge_reduced)
        self.folded = 0
        self.loss_sum = 0.0
        self.loss_weight = 0.0
        self.norm_sum = 0.0
        self.aggregate_s = 0.0  # time spent folding, over the round's add() calls

    def add_loss(self, loss: float, num_samples: int) -> None:
        """A client's training loss, weighted by its samples (NaN and empty clients skipped)."""
        if not math.isnan(loss) and num_samples:
            self.loss_sum += loss * num_samples
            self.loss_weight += num_samples

    def add_norm(self, norm: float) -> None:
        if not math.isnan(norm):
            self.norm_sum += norm

    def fold(self, contribution: Contribution) -> None:
        self.folded += 1
        if self.accumulator is not None:
            self.accumulator.add(contribution.update, self.aggregator.weight(contribution))
        if self.keep_contributions:
            self.contributions.append(contribution)

    def fold_rows(self, contributions: list[Contribution], rows: np.ndarray) -> None:
        """`fold` of each contribution, in order, whose updates are the rows of `rows` (a
        WireChunk's): the same sums, the arithmetic a block of rows at a time."""
        self.folded += len(contributions)
        if self.accumulator is not None:
            weight = self.aggregator.weight
            self.accumulator.add_rows(rows, [weight(c) for c in contributions])
        if self.keep_contributions:
            self.contributions.extend(contributions)

    def weighs_nothing(self) -> bool:
        """Every folded update says it trained on 0 samples: a weighted mean of nothing."""
        return (
            self.accumulator is not None
            and self.accumulator.normalize
            and self.folded > 0
            and self.accumulator.weight_sum <= 0
        )


class Collusion:
    """A colluding attacker's round: the benign updates of its sampled malicious clients and
    of its pool (which trains but sends nothing), held until every one of them has arrived or
    been dropped; then `ready()` and the attack crafts the malicious clients' updates."""

    def __init__(self, info: RoundInfo) -> None:
        self.info = info
        self.pool = set(info.attacker_pool.tolist())
        self.malicious: list[Contribution] = []  # the sampled malicious clients' own updates
        self.knowledge: list[np.ndarray] = []  # the pool's decoded updates
        self.knowledge_ids: list[int] = []
        self.malicious_rejected = 0  # sampled malicious clients rejected or dropped
        self.pool_dropped = 0

    def ready(self) -> bool:
        return (
            len(self.malicious) + self.malicious_rejected >= self.info.num_malicious
            and len(self.knowledge) + self.pool_dropped >= len(self.pool)
            and bool(self.malicious)
        )

    def learn(self, client_id: int, update: np.ndarray) -> None:
        """The honest update of a pool client (trained, never sent)."""
        self.knowledge.append(update)
        self.knowledge_ids.append(int(client_id))

    def honest_updates(self) -> tuple[list[np.ndarray], int]:
        """What the attacker knows, and where its benign set starts in it: its sampled
        clients' own updates (client-id order), then (`sampled_and_pool`, start 0) its pool's,
        or (`pool`, start = the own updates' count) every member of the pool's draw in id
        order, its sampled members' own updates included. A pool that sent nothing (every
        member dropped or rejected) leaves the own updates as the benign set (start 0)."""
        own = [c.update for c in self.malicious]
        members = self.info.attacker_benign
        if members is None:
            return own + self.knowledge, 0
        known = dict(zip(self.knowledge_ids, self.knowledge, strict=True))
        known.update((c.client_id, c.update) for c in self.malicious)
        benign = [known[c] for c in members.tolist() if c in known]
        if not benign:
            return own, 0
        return own + benign, len(own)

    def clear(self) -> None:
        self.malicious, self.knowledge, self.knowledge_ids = [], [], []
