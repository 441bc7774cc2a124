"""`run` and `resume`: assemble a run once — check the output folder, start the configured
backend (which loads the data and calls `plan_run`), restore a checkpoint, open the outputs —
then hand it to THE round loop (raysim.core.loop.run_rounds) and write the summary."""

from __future__ import annotations

import functools
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raysim import interrupts, registry
from raysim.assembly.plan import RunPlan, plan_with
from raysim.assembly.recovery import ServerKeeper
from raysim.assembly.resume import check_resume_config, find_resume_point, resume_config
from raysim.config import Config
from raysim.core.backend import RuntimeAttachments, start_checked
from raysim.core.faults import CapacityLost
from raysim.core.loop import run_rounds
from raysim.core.schedule import clients_per_round
from raysim.core.state import ServerState
from raysim.data.datasets import Dataset
from raysim.errors import RaysimError
from raysim.outputs import RunOutputs
from raysim.outputs.run_folder import check_out_dir, lock_out_dir
from raysim.process_memory import peak_rss_bytes


@dataclass
class RunResult:
    state: ServerState
    summary: dict[str, Any]
    out_dir: Path


def start_backend(config: Config, address: str | None):
    """Start the configured backend (raysim.core.backend): it loads the data, plans the run
    with `prepare` (raysim.assembly.plan) and starts the server. Joining a cluster (`address`)
    means the Ray backend."""
    return start_planned(config, address)[0]


def start_planned(config: Config, address: str | None) -> tuple[Any, Dataset, RunPlan]:
    """`start_backend`, with the dataset the backend loaded and the plan it was handed: the
    assembly keeps these rather than reading them back from the backend."""
    name = "ray" if address and config.runtime.backend == "local" else config.runtime.backend
    planned: list[tuple[Dataset, RunPlan]] = []

    def prepare(dataset: Dataset, attachments: RuntimeAttachments | None = None) -> RunPlan:
        # (None: a backend that brings nothing; a method with client state is then refused)
        plan = plan_with(config, dataset, attachments or RuntimeAttachments())
        planned.append((dataset, plan))
        return plan

    backend = start_checked(registry.backends.get(name), name, config, address, prepare)
    if len(planned) != 1:  # (a backend plug-in that planned twice, or not at all)
        backend.shutdown()
        raise RaysimError(
            f"backend '{name}' called prepare {len(planned)} times while starting; a backend "
            "plans its run exactly once (raysim.core.backend)"
        )
    return backend, *planned[0]


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
    server state, so the resumed run ends exactly where an uninterrupted one would. What
    `overrides` may change and when plug-in code is trusted: raysim.assembly.resume."""
    config = resume_config(out_dir, overrides, trust_plugins)
    return run(
        config,
        out_dir,
        address=address,
        progress=progress,
        tensorboard=tensorboard,
        resume_from_checkpoint=True,
    )


def _owning_out_dir(function: Callable[..., RunResult]) -> Callable[..., RunResult]:
    """Run `function(config, out_dir, ...)` holding `out_dir`'s lock
    (raysim.outputs.run_folder.OutDirLock) from before anything is checked or loaded to the
    end, however it ends: a second run or resume into the folder meanwhile is refused in one
    line instead of deleting this one's files."""

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
    backend, dataset, plan = start_planned(config, address)
    interrupts.reclaim_sigterm()  # (ray.init installed its own SIGTERM handler)
    split = plan.split
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
        f"samples, {split.num_clients} clients, {clients_per_round(config)} per round); "
        f"{backend.describe()}",
        flush=True,
    )
    if tensorboard:
        logdir = shlex.quote(str(Path(out_dir) / "tensorboard"))  # a folder may hold spaces
        print(f"TensorBoard: tensorboard --logdir {logdir}", flush=True)
    first_round = restored.round if restored is not None else 0
    try:
        # Which clients train in each round: the devices' clock when the run has one, else the
        # seed's sample, planned once. The loop and the replays after a lost server follow it.
        schedule = plan.rounds
        schedule.resume_at(first_round, history)
        server = ServerKeeper(backend, outputs.checkpoint_dir, restored, schedule.info)
        try:
            state, tally, wall_s = run_rounds(
                config.run,
                backend,
                outputs,
                server,
                schedule=schedule,
                first_round=first_round,
                history=history,
                on_round=on_round,
                progress=progress,
            )
        except CapacityLost as error:
            if error.rounds_done is None:  # not raised by a round
                raise
            message = _stop_without_capacity(error, backend, outputs, server, out_dir)
            raise RaysimError(message) from None
        rounds = config.run.rounds
        summary = tally.summary(
            rounds=rounds,
            resumed_from=first_round if restored is not None else None,
            wall_s=wall_s,
            server_restarts=server.restarts,
        )
        summary.update(
            backend=backend.name,
            dataset=dataset.name,
            num_clients=split.num_clients,
            driver_peak_rss_bytes=peak_rss_bytes(),
            server_peak_rss_bytes=server.call(backend.server_peak_rss_bytes, rounds),
            # client tasks per Ray node id (the Ray backend; shows multi-node placement)
            task_nodes=server.call(backend.task_nodes, rounds),
        )
        # None from a backend with one place to train (local): nothing to report
        placement = server.call(backend.placement, rounds)
        if placement is not None:
            from raysim.runtime.ray_placement import placement_text

            summary["placement"] = placement
            print(placement_text(placement), file=sys.stderr, flush=True)
        summary = outputs.write_summary(summary)  # + the run's environment record
    finally:
        outputs.close()
        backend.shutdown()
    return RunResult(state=state, summary=summary, out_dir=Path(out_dir))


def _stop_without_capacity(
    error: CapacityLost, backend: Any, outputs: RunOutputs, server: ServerKeeper, out_dir: Any
) -> str:
    """The one line of a run stopped for lack of capacity, after checkpointing its last
    finished round (the server still holds it: a round changes the state only at its end;
    not with a client-state store, which the stopped round's clients may have written)."""
    rounds_done = error.rounds_done
    saved = ""
    if rounds_done and backend.ctx.client_state is None:
        state = server.call(backend.get_state, rounds_done)
        if state.round == rounds_done:
            outputs.save_checkpoint(state, backend.ctx.data_shape())
            saved = f"; checkpoint of round {rounds_done} written"
    return f"{error}{saved}; continue with: raysim run --resume {out_dir}"
