"""The checks that read two sections (each section checks its own fields beside them): run
after every section has passed its own checks."""

from __future__ import annotations

from raysim.config.experiment import PartitionConfig
from raysim.config.limits import require
from raysim.config.training import AttackConfig, ClientsConfig


def check_across_sections(
    part: PartitionConfig, clients: ClientsConfig, attack: AttackConfig, source: str
) -> None:
    """`clients.per_round` against `partition.num_clients`, and the attack's honest majority."""
    require(
        source,
        clients.per_round <= part.num_clients,
        "clients.per_round",
        f"<= partition.num_clients ({part.num_clients})",
        clients.per_round,
    )
    if attack.name != "none" and attack.redraw_majority:
        # Rounds with >= half malicious clients are redrawn: some draw must have a majority
        # of honest clients, or the run could never sample a round.
        honest = part.num_clients - int(attack.fraction * part.num_clients)
        require(
            source,
            2 * (clients.per_round - min(honest, clients.per_round)) < clients.per_round,
            "attack.fraction",
            f"small enough that {clients.per_round} sampled clients can have an honest "
            f"majority (attack.redraw_majority is on; {honest} of {part.num_clients} "
            f"clients are honest)",
            attack.fraction,
        )
