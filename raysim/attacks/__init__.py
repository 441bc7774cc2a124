"""Malicious client behaviours, composed with any algorithm and aggregator.

Malicious clients are the lowest client ids (`attack.fraction` of all clients). They train
honestly like everyone else (stateless tasks); the server, simulating their collusion, hands
their honest decoded updates of the round to the attack's `craft`, which returns what they send
instead. An attack thus sees what a colluding adversary would: its own clients' benign updates,
the aggregation rule and the round's facts (e.g. how many of its clients were sampled).

    class Attack(Protocol):
        def craft(self, honest: list[np.ndarray], info: RoundInfo, aggregator, algorithm,
                  ctx: RunContext) -> list[np.ndarray]: ...

`honest[:info.num_malicious]` are the sampled malicious clients' own updates (client-id order);
any further entries come from the attacker's pool (`attack.pool_size` more malicious clients
trained only to inform the attack, as FRL's code does with 25). An attack that averages what
benign clients send (frl_reversal, agr_tailored) reads `honest[info.benign_start:]`: all of it
under `attack.benign_set: sampled_and_pool`; under `pool`, the pool's whole draw (its members
sampled this round included), after the own updates. `craft` returns exactly
`info.num_malicious` updates, which are aggregated in place of the sampled ones.

Built in (`attack.name`), each in its own module citing its source:
    frl_reversal    against FRL: all submit the reversed aggregate of their rankings
                    (FRL paper, Algorithm 3)
    agr_tailored    against trimmed_mean / multi_krum: mean - gamma * std, gamma searched
                    against the aggregator (Shejwalkar & Houmansadr, NDSS 2021)
    sign_flip       against SignSGD: negated signs
    naive_scaling   against FedAvg: the honest delta times `scale` (default -10)
"""

from __future__ import annotations


def no_attack() -> None:
    """`attack.name: none`: every client is honest."""
    return None
