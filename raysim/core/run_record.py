"""What the round loop writes: each round's metrics.jsonl record, and the running tally of a run
(totals, the latest and the best evaluation, the rounds in a row that trained nothing) from
which its summary is made. The keys and their order are metrics.jsonl's and summary.json's."""

from __future__ import annotations

import statistics
from typing import Any

from raysim.core.best_so_far import BestSoFar
from raysim.core.state import RoundInfo, RoundStats

# RoundStats counters summed over the run (and over the rounds before a resume).
TOTALS = (
    "bytes_up",
    "bytes_down",
    "clients_done",
    "clients_failed",
    "clients_rejected",  # updates refused before aggregation (core.validation)
    # client faults (raysim.core.faults): dropped after their retries or for being late
    "clients_dropped",
    "clients_late",
    "task_retries",
)


def round_record(
    round_index: int, info: RoundInfo, stats: RoundStats, wall_s: float, elapsed_s: float
) -> dict[str, Any]:
    """Round `round_index`'s metrics.jsonl record (its round number is round_index + 1)."""
    record: dict[str, Any] = {
        "round": round_index + 1,
        "wall_s": wall_s,
        # since the loop started, at the end of this round's dispatch (differences of
        # consecutive values include logging and checkpointing of the round before)
        "elapsed_s": elapsed_s,
        "clients": info.num_clients,
        "malicious": info.num_malicious,
        "clients_done": stats.clients_done,
        "clients_failed": stats.clients_failed,
        "clients_rejected": stats.clients_rejected,
        "clients_dropped": stats.clients_dropped,
        "clients_late": stats.clients_late,
        "task_retries": stats.task_retries,
        "bytes_up": stats.bytes_up,
        "bytes_down": stats.bytes_down,
        "train_loss": stats.train_loss,
        "update_norm_mean": stats.update_norm_mean,
        "tasks": stats.tasks,
        "time": {
            "clients_s": stats.clients_s,
            "client_compute_s": stats.client_compute_s,
            "aggregate_s": stats.aggregate_s,
            **stats.server_times,
            "evaluate_s": stats.evaluate_s,
        },
    }
    if stats.rounds_in_call > 1:  # (see round_seconds)
        record["rounds_in_call"] = stats.rounds_in_call
    return record


def spread_over_calls(seconds: list[float], rounds_in_call: list[int]) -> list[float]:
    """Rounds' seconds as the driver measured them (`seconds`, one a round, in order), the
    seconds of backend calls that brought back several rounds shared equally by those rounds
    (`rounds_in_call`, one a round: a block of K rounds run ahead is K rounds in a row marked K,
    the first of which waited for them all). Blocks that follow one another are shared as one:
    they run back to back in the server actor while the driver logs, so which block's wait a
    stretch of their time falls in says nothing (one queued behind a checkpoint may be done
    before the driver asks for it, and looks free while the one before it looks slow). A
    block cut short (a stopped run) shares over the rounds there."""
    spread: list[float] = []
    position = 0
    while position < len(seconds):
        end = position + 1
        if int(rounds_in_call[position]) > 1:
            while end < len(seconds) and int(rounds_in_call[end]) > 1:
                end += 1
        group = seconds[position:end]
        spread += [sum(group) / len(group)] * len(group)
        position = end
    return spread


def round_seconds(records: list[dict[str, Any]]) -> list[float]:
    """Each round's seconds from a run's metrics.jsonl records: the differences of
    consecutive `elapsed_s` (each round's logging included), a call's spread over the rounds
    it brought back (`spread_over_calls`)."""
    elapsed = [float(record["elapsed_s"]) for record in records]
    seconds = [b - a for a, b in zip([0.0, *elapsed], elapsed, strict=False)]
    return spread_over_calls(seconds, [record.get("rounds_in_call", 1) for record in records])


def add_outcome(record: dict[str, Any], stats: RoundStats) -> None:
    """The parts of a round's record that only some rounds have: evaluations, a kept model,
    the rejected updates (after the server-restart counts, in metrics.jsonl's order)."""
    if stats.eval:  # the test split ("eval", as TensorBoard's eval/...)
        record["eval"] = stats.eval
    if stats.val:  # the validation split (data.validation_fraction), tuned on
        record["val"] = stats.val
    if not stats.model_updated:
        record["model_kept"] = True  # nothing arrived, or the update was refused
    if stats.rejected:  # one line per rejected update, naming the client
        record["rejected"] = list(stats.rejected)


class RunTally:
    """Totals, the latest and best evaluations and the round times of a run, continued from
    the records of the rounds before a resume (`history`)."""

    def __init__(self, history: list[dict[str, Any]] | None) -> None:
        self.totals = dict.fromkeys(TOTALS, 0)
        self.last_eval: dict[str, float] = {}
        self.last_val: dict[str, float] = {}
        self.train_loss = float("nan")
        self.best_eval, self.best_val = BestSoFar(), BestSoFar()  # the best so far of each metric
        self.round_times: list[float] = []
        self.rounds_in_call: list[int] = []
        for record in history or []:  # rounds done before a resume count in the totals
            self.best_eval.add(record.get("round", 0), record.get("eval") or {})
            self.best_val.add(record.get("round", 0), record.get("val") or {})
            for key in self.totals:
                self.totals[key] += record.get(key) or 0
            self.last_eval = record.get("eval", self.last_eval)
            self.last_val = record.get("val", self.last_val)
            self.train_loss = record.get("train_loss") or float("nan")
        self.done_before = self.totals["clients_done"]
        self.sim: dict[str, Any] | None = None  # simulated time (devices:), set by the loop

    def add(self, record: dict[str, Any], stats: RoundStats) -> None:
        self.round_times.append(record["wall_s"])
        self.rounds_in_call.append(stats.rounds_in_call)
        for key in self.totals:
            self.totals[key] += getattr(stats, key)
        self.train_loss = stats.train_loss
        if stats.eval:
            self.last_eval = stats.eval
            self.best_eval.add(record["round"], stats.eval)
        if stats.val:
            self.last_val = stats.val
            self.best_val.add(record["round"], stats.val)

    def latest(self) -> dict[str, float]:
        """The latest test metrics and training loss (what the progress bar shows)."""
        return {**self.last_eval, "train_loss": self.train_loss}

    def summary(
        self, *, rounds: int, resumed_from: int | None, wall_s: float, server_restarts: int
    ) -> dict[str, Any]:
        """summary.json's first part (the backend's part follows: raysim.core.loop)."""
        totals = self.totals
        return {
            "final": self.latest(),  # test split
            "final_val": self.last_val or None,  # validation split (None: none held out)
            # per metric, the best value of any evaluated round and that round (the FRL
            # reference code's printed metric is the best test accuracy so far)
            "best": self.best_eval.summary(),
            "best_val": self.best_val.summary(),
            "resumed_from_round": resumed_from,
            "rounds": rounds,
            "wall_s": wall_s,
            # of this process's rounds only: after a resume, wall_s does not cover the
            # rounds before the checkpoint (whose updates clients_done counts)
            "client_updates_per_s": (
                (totals["clients_done"] - self.done_before) / wall_s if wall_s else 0.0
            ),
            "bytes_up": totals["bytes_up"],
            "bytes_down": totals["bytes_down"],
            "clients_done": totals["clients_done"],
            "clients_failed": totals["clients_failed"],
            "clients_rejected": totals["clients_rejected"],
            "clients_dropped": totals["clients_dropped"],
            "clients_late": totals["clients_late"],
            "task_retries": totals["task_retries"],
            "server_restarts": server_restarts,
            # (a block of rounds run ahead shares its wait over its rounds: spread_over_calls)
            "median_round_s": (
                statistics.median(spread_over_calls(self.round_times, self.rounds_in_call))
                if self.round_times
                else None
            ),
            # simulated time, participation, time-to-target (raysim.core.schedule.sync_clock)
            **({"sim": self.sim} if self.sim is not None else {}),
        }


def idle_reason(records: list[dict[str, Any]], limit: int) -> str:
    """Why a run stops after `limit` rounds in a row that left the model unchanged."""
    counts = {
        key: sum(record.get(key) or 0 for record in records)
        for key in ("clients", "clients_dropped", "clients_late", "clients_rejected")
    }
    refused = sum("refused" in line for record in records for line in record.get("rejected", []))
    causes = [
        f"{counts[key]} {word}"
        for key, word in (
            ("clients_late", "late (run.round_deadline_s)"),
            ("clients_dropped", "dropped"),
            ("clients_rejected", "rejected"),
        )
        if counts[key]
    ]
    if refused:
        causes.append(f"{refused} server update(s) refused")
    return (
        f"rounds {records[0]['round']}-{records[-1]['round']} left the model unchanged "
        f"({counts['clients']} clients sampled: {', '.join(causes) or 'no update arrived'}); "
        f"stopping after run.max_idle_rounds={limit} such rounds in a row, since the run would "
        "train nothing (metrics.jsonl has the rounds; set run.max_idle_rounds: 0 to never stop)"
    )
