"""THE round loop. Every algorithm and both backends go through this one function.

for each round:
    sample clients (seeded by run seed and round)
    backend.run_round: send the payload, train clients, aggregate, update the server,
                       evaluate when due
    log the round (metrics.jsonl, TensorBoard, progress bar)
    checkpoint when due
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from raysim import interrupts, registry
from raysim.config import Config
from raysim.core.algorithm import RunContext
from raysim.core.backend import check_backend
from raysim.core.best_so_far import BestSoFar
from raysim.core.faults import CapacityLost, ServerLost
from raysim.core.sampling import (
    attacker_pool,
    sample_clients,
)
from raysim.core.state import RoundInfo, ServerState
from raysim.data.datasets import Dataset, load_dataset  # noqa: F401 - re-exported
from raysim.data.partition import ClientSplit, split_for_run
from raysim.errors import RaysimError
from raysim.outputs import RunOutputs
from raysim.outputs.checkpoints import (
    check_state,
    checkpoint_metadata,
    checkpoint_paths,
    load_checkpoint,
)
from raysim.outputs.environment import peak_rss_bytes
from raysim.outputs.identity import config_changes, config_fingerprint, written_fingerprint
from raysim.outputs.records import resume_records
from raysim.outputs.run_folder import check_out_dir, lock_out_dir

# Restarts of a lost server in a row (while recovering one round) before the run gives up.
MAX_SERVER_RESTARTS = 3
# The most optimizer steps one client may take in one round (local_epochs x its batches): the
# largest runs raysim reproduces take a few thousand; more would keep round 1 from ending.
MAX_LOCAL_STEPS = 10_000_000


def _test_kill_hook() -> int | None:
    """RAYSIM_TEST_KILL_AFTER_ROUND=r makes the driver SIGKILL itself after round r (tests)."""
    value = os.environ.get("RAYSIM_TEST_KILL_AFTER_ROUND")
    return int(value) if value else None


def check_resume_config(out_dir: str | Path, config: Config) -> None:
    """Refuse to resume `out_dir` with a config that differs from the one its run was written
    with, except in `outputs.RESUMABLE_KEYS` (the round count, the runtime): an edited
    config.yaml would otherwise continue as a silent hybrid of two runs. Compared with the
    config stored in the newest readable checkpoint, else with the fingerprint in
    config.yaml's header (a run stopped before its first checkpoint)."""
    out_dir = Path(out_dir)
    allowed = "a resume may change only run.rounds (--set run.rounds=N) and runtime.*"
    for path in reversed(checkpoint_paths(out_dir / "checkpoints")):
        try:
            written = checkpoint_metadata(path).get("config")
        except RaysimError:
            continue  # damaged: find_resume_point reports it and falls back
        if isinstance(written, dict):
            changes = config_changes(written, config)
            if changes:
                raise RaysimError(
                    f"cannot resume {out_dir}: its config differs from the one checkpoint "
                    f"{path.name} was written with ({'; '.join(changes)}); {allowed}"
                )
            return
        break
    fingerprint = written_fingerprint(out_dir / "config.yaml")
    if fingerprint is not None and fingerprint != config_fingerprint(config):
        raise RaysimError(
            f"cannot resume {out_dir}: {out_dir / 'config.yaml'} was edited after the run "
            f"started (its config_fingerprint {fingerprint} no longer matches); {allowed}"
        )


def find_resume_point(
    out_dir: str | Path, template: ServerState | None = None
) -> tuple[ServerState | None, list[dict[str, Any]]]:
    """The newest usable checkpoint (`newest_usable_checkpoint`) and the metrics records of
    the rounds it covers, checked against it (raysim.outputs.resume_records: every round up to
    it once, whole and in order, else refused). With no usable checkpoint: (None, []), the run
    starts again from round 0, whose state is a function of the seed.
    """
    out_dir = Path(out_dir)
    state = newest_usable_checkpoint(out_dir, template)
    if state is not None:
        return state, resume_records(out_dir / "metrics.jsonl", state.round)
    if not (out_dir / "config.yaml").is_file():
        raise RaysimError(f"cannot resume {out_dir}: it holds no run (no config.yaml)")
    print(
        f"raysim: no usable checkpoint in {out_dir / 'checkpoints'}: starting again from "
        "round 0 (its state comes from the seed)",
        file=sys.stderr,
        flush=True,
    )
    return None, []


def newest_usable_checkpoint(
    out_dir: str | Path, template: ServerState | None = None
) -> ServerState | None:
    """The state of the newest usable checkpoint in `out_dir` (None: none is).

    A checkpoint that cannot be read (e.g. truncated, or renamed: its name and contents
    disagree on the round) or, given the run's initial state `template`, whose arrays are not
    the run's (missing, wrong shape or dtype, non-finite) is reported and the previous one
    used. None: a run stopped before its first checkpoint, or `checkpoint_every: 0`.
    """
    for path in reversed(checkpoint_paths(Path(out_dir) / "checkpoints")):
        try:
            state, _ = load_checkpoint(path)
            problem = None if template is None else check_state(state, template)
            if problem is not None:
                raise RaysimError(f"checkpoint {path} cannot continue this run: {problem}")
        except RaysimError as error:
            print(f"raysim: skipping checkpoint: {error}", file=sys.stderr, flush=True)
            continue
        return state
    return None


def _idle_reason(records: list[dict[str, Any]], limit: int) -> str:
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


@dataclass
class RunResult:
    state: ServerState
    summary: dict[str, Any]
    out_dir: Path


def split_clients(config: Config, dataset: Dataset) -> ClientSplit:
    """The client split (raysim.data.partition.split_for_run; cached per `partition.cache_dir`),
    refused if its largest client would take more than MAX_LOCAL_STEPS steps a round."""
    split = split_for_run(config, dataset).train
    largest = int(np.diff(split.offsets).max()) if split.num_clients else 0
    clients = config.clients
    steps = clients.local_epochs * -(-largest // clients.batch_size)
    if steps > MAX_LOCAL_STEPS:
        raise RaysimError(
            f"clients.local_epochs={clients.local_epochs} with clients.batch_size="
            f"{clients.batch_size} gives the largest client ({largest} samples) {steps:,} local "
            f"steps a round, more than {MAX_LOCAL_STEPS:,}; use fewer epochs or larger batches"
        )
    return split


def run_context(config: Config, dataset: Dataset) -> RunContext:
    ctx = RunContext(
        config,
        tuple(dataset.train_x.shape[1:]),
        dataset.num_classes,
        dataset.num_features,
        plugins=registry.snapshot(),  # names registered in this process, for the workers
        multilabel=np.ndim(dataset.train_y) == 2,
    )
    validation = split_for_run(config, dataset).validation  # each client's test rows, if any
    if validation is not None:
        ctx = dataclasses.replace(ctx, client_validation=validation)
        if dataset.val_x is not None:  # the validation rows placed on clients the same way
            from raysim.core.sampling import PARTITION, purpose_seed
            from raysim.data.partition import split_dataset

            as_test = dataclasses.replace(dataset, test_x=dataset.val_x, test_y=dataset.val_y)
            part = config.partition
            placed = split_dataset(
                as_test,
                part.name,
                part.num_clients,
                purpose_seed(config.run.seed, PARTITION),
                part.options,
            )
            ctx = dataclasses.replace(ctx, client_validation_of_val=placed.validation)
    return ctx


def _start(config: Config, address: str | None):
    """Start the configured backend (raysim.core.backend): it loads the data, splits it with
    `prepare` and starts the server. Joining a cluster (`address`) means the Ray backend."""
    name = "ray" if address and config.runtime.backend == "local" else config.runtime.backend
    backend_class = registry.backends.get(name)
    check_backend(backend_class, name)

    def prepare(dataset: Dataset):
        return split_clients(config, dataset), run_context(config, dataset)

    return backend_class.start(config, address, prepare)


def resume(
    out_dir: str | Path,
    *,
    overrides: Sequence[str] = (),
    address: str | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    trust_plugins: bool = False,
) -> RunResult:
    """Continue a stopped run from its newest usable checkpoint in `out_dir`.

    Every random draw derives from (seed, round, client id) and the checkpoint holds the whole
    server state, so the resumed run ends exactly where an uninterrupted one would.
    `overrides` may set only what a resume may change: `run.rounds=N` (extends the run) and
    `runtime.*`. A folder whose config names plug-ins by import path (`module:attr`) resumes
    only with `trust_plugins=True` (`--trust-plugins`): the folder may be someone else's, and
    resuming imports and runs that code.
    """
    from raysim import config as config_module
    from raysim.plugins import import_paths_in

    if not (Path(out_dir) / "config.yaml").is_file():
        raise RaysimError(f"cannot resume {out_dir}: it holds no run (no config.yaml)")
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key != "run.rounds" and not key.startswith("runtime."):
            raise RaysimError(
                f"--set {override}: a resume may change only run.rounds and runtime.* (the "
                "rest would make a hybrid of two runs); start a new run for other settings"
            )
    # Read unresolved first: nothing the folder names is imported before it is trusted.
    config_path = Path(out_dir) / "config.yaml"
    named = import_paths_in(config_module.load(config_path, overrides, resolve_plugins=False))
    if named and not trust_plugins:
        raise RaysimError(
            f"cannot resume {out_dir}: its config names plug-in code by import path "
            f"({', '.join(named)}), which resuming would import and run; if you trust that "
            "code, resume with --trust-plugins (Python: trust_plugins=True)"
        )
    config = config_module.load(config_path, overrides)
    return run(
        config,
        out_dir,
        address=address,
        progress=progress,
        tensorboard=tensorboard,
        resume_from_checkpoint=True,
    )


def _owning_out_dir(function: Callable[..., RunResult]) -> Callable[..., RunResult]:
    """Run `function(config, out_dir, ...)` holding `out_dir`'s lock (raysim.outputs.OutDirLock)
    from before anything is checked or loaded to the end, however it ends: a second run or
    resume into the folder meanwhile is refused in one line instead of deleting this one's
    files."""

    @functools.wraps(function)
    def owning(config: Config, out_dir: str | Path, *args: Any, **kwargs: Any) -> RunResult:
        with lock_out_dir(out_dir):
            return function(config, out_dir, *args, **kwargs)

    return owning


@interrupts.with_handler  # Ctrl-C never inside the outputs' bookkeeping
@_owning_out_dir
def run(
    config: Config,
    out_dir: str | Path,
    *,
    address: str | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    resume_from_checkpoint: bool = False,
    overwrite: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> RunResult:
    """Run a whole simulation and write its outputs to `out_dir`.

    A new run refuses an `out_dir` that holds another run unless `overwrite` (which deletes
    that run once the new one's data has loaded).

    `on_round(record)` is called with each round's metrics record once it is logged (e.g. a
    Tune trial reports it; raysim/tune.py).
    """
    # Before anything starts: a file in the way, a folder holding another run (without
    # `overwrite`) or a resume with an edited config is one line.
    check_out_dir(out_dir, new_run=not resume_from_checkpoint, overwrite=overwrite)
    if resume_from_checkpoint:
        check_resume_config(out_dir, config)
    restored, history = None, None
    # Data and backend first: bad input fails here, before anything in out_dir is touched.
    backend = _start(config, address)
    interrupts.reclaim_sigterm()  # (ray.init installed its own SIGTERM handler)
    dataset, split = backend.dataset, backend.split
    try:
        if resume_from_checkpoint:  # checkpoints are checked against the run's initial state
            restored, history = find_resume_point(out_dir, template=backend.get_state())
        if restored is not None:
            if restored.round > config.run.rounds:
                raise RaysimError(
                    f"cannot resume {out_dir} for run.rounds={config.run.rounds}: its "
                    f"checkpoint is at round {restored.round} already"
                )
            backend.set_state(restored)
        outputs = RunOutputs(
            out_dir,
            config,
            tensorboard=tensorboard,
            history=history,
            resumed_round=restored.round if restored is not None else 0,
            overwrite=overwrite,
        )
    except BaseException:
        backend.shutdown()
        raise
    print(
        f"raysim: {config.algorithm.name} on {dataset.name} ({len(dataset.train_y)} train "
        f"samples, {split.num_clients} clients, {config.clients.per_round} per round); "
        f"{backend.describe()}",
        flush=True,
    )
    if tensorboard:
        print(f"TensorBoard: tensorboard --logdir {Path(out_dir) / 'tensorboard'}", flush=True)
    # What rebuilding the model needs besides the config (raysim.load_run), in each checkpoint.
    data_shape = {
        "input_shape": list(backend.ctx.input_shape),
        "num_classes": int(backend.ctx.num_classes),
        "num_features": backend.ctx.num_features,
    }
    rounds, seed = config.run.rounds, config.run.seed
    # Malicious clients are the lowest ids (none unless an attack is configured).
    malicious_below = 0
    if config.attack.name != "none":
        malicious_below = int(config.attack.fraction * split.num_clients)
    bar = None
    first_round = restored.round if restored is not None else 0
    if progress:  # a bar on a terminal, a line every 10 s in a log (raysim.progress)
        from raysim.progress import Progress

        bar = Progress(rounds, first_round)
    round_times: list[float] = []
    totals = {"bytes_up": 0, "bytes_down": 0, "clients_done": 0, "clients_failed": 0}
    totals["clients_rejected"] = 0  # updates refused before aggregation (core.validation)
    # client faults (raysim.core.faults): clients dropped after their retries or for being late
    totals.update(clients_dropped=0, clients_late=0, task_retries=0)
    last_eval: dict[str, float] = {}
    last_val: dict[str, float] = {}
    train_loss = float("nan")
    best_eval, best_val = BestSoFar(), BestSoFar()  # the best so far of each metric
    for record in history or []:  # rounds done before a resume count in the totals
        best_eval.add(record.get("round", 0), record.get("eval") or {})
        best_val.add(record.get("round", 0), record.get("val") or {})
        for key in totals:
            totals[key] += record.get(key) or 0
        last_eval = record.get("eval", last_eval)
        last_val = record.get("val", last_val)
        train_loss = record.get("train_loss") or float("nan")
    done_before = totals["clients_done"]
    kill_after = _test_kill_hook()

    def round_info(round_index: int) -> RoundInfo:
        client_ids = sample_clients(
            seed,
            round_index,
            split.num_clients,
            config.clients.per_round,
            malicious_below,
            config.attack.redraw_majority,
        )
        pool = np.zeros(0, dtype=np.int64)
        if malicious_below and np.searchsorted(client_ids, malicious_below):
            pool = attacker_pool(
                seed, round_index, malicious_below, config.attack.pool_size, client_ids
            )
        return RoundInfo(round_index, client_ids, malicious_below, pool)

    def newest_checkpoint(before: int) -> ServerState | None:
        """The newest readable checkpoint of this run up to round `before` (else the state
        this run was resumed from; None: the initial state)."""
        for path in reversed(checkpoint_paths(outputs.checkpoint_dir)):
            try:
                state, _ = load_checkpoint(path)
            except RaysimError as error:
                print(f"raysim: skipping checkpoint: {error}", file=sys.stderr, flush=True)
                continue
            if state.round <= before:
                return state
        return restored

    restarts = {"total": 0, "round": 0, "replayed": 0}

    def recover(rounds_done: int) -> None:
        """The server was lost: restart it from the newest checkpoint and replay the rounds
        after it (not logged again: their records are already in metrics.jsonl), up to
        `rounds_done` rounds. Replayed rounds are computed exactly as the first time."""
        for _ in range(MAX_SERVER_RESTARTS):
            state = newest_checkpoint(rounds_done)
            since = state.round if state is not None else 0
            print(
                f"raysim: the server was lost; restarting it from round {since} and replaying "
                f"{rounds_done - since} round(s)",
                file=sys.stderr,
                flush=True,
            )
            restarts["total"] += 1
            restarts["round"] += 1
            try:
                backend.restart(state)
                for replay in range(since, rounds_done):
                    backend.run_round(round_info(replay), False, None)
            except ServerLost:
                continue
            restarts["replayed"] += rounds_done - since
            return
        raise RaysimError(f"the server was lost {MAX_SERVER_RESTARTS} times in a row; giving up")

    def with_server(call: Callable[[], Any], rounds_done: int) -> Any:
        """`call()`, after restarting the server (and replaying rounds) as often as it is lost."""
        for _ in range(MAX_SERVER_RESTARTS):
            try:
                return call()
            except ServerLost:
                recover(rounds_done)
        return call()

    def _stop_without_capacity(error: CapacityLost, rounds_done: int) -> str:
        """The one line of a run stopped for lack of capacity, after checkpointing its last
        finished round (the server still holds it: a round changes the state only at its
        end; not with a client-state store, which the stopped round's clients may have
        written)."""
        saved = ""
        if rounds_done and backend.ctx.client_state is None:
            state = with_server(backend.get_state, rounds_done)
            if state.round == rounds_done:
                outputs.save_checkpoint(state, data_shape)
                saved = f"; checkpoint of round {rounds_done} written"
        return f"{error}{saved}; continue with: raysim run --resume {out_dir}"

    next_info = None
    idle: list[dict[str, Any]] = []  # records of the latest rounds in a row that trained nothing
    started = time.perf_counter()
    try:
        for round_index in range(first_round, rounds):
            round_started = time.perf_counter()
            info = next_info or round_info(round_index)
            # The next round's clients are known now (sampling depends on seed and round
            # only), so a backend may dispatch them as soon as this round's model exists.
            next_info = round_info(round_index + 1) if round_index + 1 < rounds else None
            last = round_index == rounds - 1
            evaluate = (
                last
                or (round_index + 1) % config.run.eval_every == 0
                or round_index + 1 in config.run.eval_at
            )
            restarts["round"] = restarts["replayed"] = 0
            try:
                stats = with_server(
                    lambda: backend.run_round(info, evaluate, next_info),  # noqa: B023
                    round_index,
                )
            except CapacityLost as error:
                raise RaysimError(_stop_without_capacity(error, round_index)) from None
            round_s = time.perf_counter() - round_started
            round_times.append(round_s)
            for key in totals:
                totals[key] += getattr(stats, key)
            train_loss = stats.train_loss
            record: dict[str, Any] = {
                "round": round_index + 1,
                "wall_s": round_s,
                # since the loop started, at the end of this round's dispatch (differences of
                # consecutive values include logging and checkpointing of the round before)
                "elapsed_s": time.perf_counter() - started,
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
            if restarts["round"]:  # the server died during this round and was restarted
                record["server_restarts"] = restarts["round"]
                record["replayed_rounds"] = restarts["replayed"]
            if stats.eval:  # the test split ("eval", as TensorBoard's eval/...)
                last_eval = stats.eval
                record["eval"] = stats.eval
                best_eval.add(round_index + 1, stats.eval)
            if stats.val:  # the validation split (data.validation_fraction), tuned on
                last_val = stats.val
                record["val"] = stats.val
                best_val.add(round_index + 1, stats.val)
            if not stats.model_updated:
                record["model_kept"] = True  # nothing arrived, or the update was refused
            if stats.rejected:  # one line per rejected update, naming the client
                record["rejected"] = list(stats.rejected)
                for line in stats.rejected:
                    print(f"raysim: {line}", file=sys.stderr, flush=True)
            outputs.log_round(record)
            if on_round is not None:
                on_round(record)
            every = config.run.checkpoint_every
            # SIGTERM: stop here, this round checkpointed (raysim.interrupts)
            stopping = interrupts.stop_requested() and not last
            if last or stopping or (every and (round_index + 1) % every == 0):
                outputs.save_checkpoint(with_server(backend.get_state, round_index + 1), data_shape)
            if stopping:
                raise interrupts.Terminated
            idle = idle + [record] if not stats.model_updated else []
            if config.run.max_idle_rounds and len(idle) >= config.run.max_idle_rounds:
                raise RaysimError(_idle_reason(idle, config.run.max_idle_rounds))
            if kill_after == round_index + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # test hook: a driver killed mid-run
            if bar is not None:
                bar.update({**last_eval, "train_loss": train_loss})
        wall_s = time.perf_counter() - started
        state = with_server(backend.get_state, rounds)
        summary = {
            "final": {**last_eval, "train_loss": train_loss},  # test split
            "final_val": last_val or None,  # validation split (None: none held out)
            # per metric, the best value of any evaluated round and that round (the FRL
            # reference code's printed metric is the best test accuracy so far)
            "best": best_eval.summary(),
            "best_val": best_val.summary(),
            "resumed_from_round": first_round if restored is not None else None,
            "rounds": rounds,
            "wall_s": wall_s,
            # of this process's rounds only: after a resume, wall_s does not cover the
            # rounds before the checkpoint (whose updates clients_done counts)
            "client_updates_per_s": (
                (totals["clients_done"] - done_before) / wall_s if wall_s else 0.0
            ),
            "bytes_up": totals["bytes_up"],
            "bytes_down": totals["bytes_down"],
            "clients_done": totals["clients_done"],
            "clients_failed": totals["clients_failed"],
            "clients_rejected": totals["clients_rejected"],
            "clients_dropped": totals["clients_dropped"],
            "clients_late": totals["clients_late"],
            "task_retries": totals["task_retries"],
            "server_restarts": restarts["total"],
            "median_round_s": statistics.median(round_times) if round_times else None,
            "backend": backend.name,
            "dataset": dataset.name,
            "num_clients": split.num_clients,
            "driver_peak_rss_bytes": peak_rss_bytes(),
            "server_peak_rss_bytes": with_server(backend.server_peak_rss_bytes, rounds),
            # client tasks per Ray node id (the Ray backend; shows multi-node placement)
            "task_nodes": (
                with_server(backend.task_nodes, rounds) if hasattr(backend, "task_nodes") else None
            ),
        }
        summary = outputs.write_summary(summary)  # + the run's environment record
    finally:
        if bar is not None:
            bar.close()
        outputs.close()
        backend.shutdown()
    return RunResult(state=state, summary=summary, out_dir=Path(out_dir))
