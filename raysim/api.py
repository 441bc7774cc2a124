"""The Python API: run a simulation and read a finished (or stopped) run back.

    import raysim

    result = raysim.run("configs/fedavg_digits.yaml", out="runs/a", overrides=["clients.lr=0.1"])
    print(result.summary["final"])

    record = raysim.load_run("runs/a")
    record.config, record.metrics[-1], record.summary, record.state
    model = record.model()          # the final global model as a torch module

Plug-ins named in a config by import path (`mymodule:MyAlgorithm`) or registered with
`raysim.registry.<kind>.register` before `run` work on every backend (raysim.plugins).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raysim.config import Config
from raysim.errors import RaysimError


def _as_config(config: Config | str | Path | Mapping[str, Any], overrides: Sequence[str]) -> Config:
    from raysim import config as config_module

    if isinstance(config, Config):
        return config_module.from_dict(config.to_dict(), list(overrides)) if overrides else config
    if isinstance(config, str | Path):
        return config_module.load(config, list(overrides))
    if isinstance(config, Mapping):
        return config_module.from_dict(config, list(overrides), source="config dict")
    raise TypeError(
        f"config must be a Config, a YAML path or a mapping, got {type(config).__name__}"
    )


def run(
    config: Config | str | Path | Mapping[str, Any],
    out: str | Path | None = None,
    *,
    overrides: Sequence[str] = (),
    address: str | None = None,
    progress: bool = True,
    tensorboard: bool = True,
    overwrite: bool = False,
    on_round: Callable[[dict[str, Any]], None] | None = None,
):
    """Run one simulation; returns its `RunResult` (final state, summary, output folder).

    `config`: a `Config`, a YAML file or a dict of sections; `overrides`: `section.key=value`
    strings as with `--set`; `out`: the output folder (default runs/NAME-TIMESTAMP);
    `address`: join a Ray cluster; `on_round(record)`: called with each round's record;
    `overwrite`: replace a run already in `out` (else such a folder is refused)."""
    from raysim import assembly

    config = _as_config(config, overrides)
    out = out if out is not None else f"runs/{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return assembly.run(
        config,
        out,
        address=address,
        progress=progress,
        tensorboard=tensorboard,
        overwrite=overwrite,
        on_round=on_round,
    )


@dataclass
class RunRecord:
    """A run folder read back: its config, per-round records, summary and newest state."""

    out_dir: Path
    config: Config
    metrics: list[dict[str, Any]]
    summary: dict[str, Any] | None  # None while the run has not finished
    state: Any  # raysim.core.state.ServerState of the newest readable checkpoint
    data_shape: dict[str, Any] = field(default_factory=dict)

    @property
    def round(self) -> int:
        return self.state.round

    def context(self):
        """The run's RunContext (config and data shapes), to build its model or algorithm."""
        from raysim.core.algorithm import RunContext

        if not self.data_shape:
            raise RaysimError(
                f"{self.out_dir}: its checkpoints predate data shapes in checkpoint metadata; "
                f"rebuild the context from the dataset (raysim.assembly.plan_run)"
            )
        return RunContext(
            self.config,
            tuple(self.data_shape["input_shape"]),
            int(self.data_shape["num_classes"]),
            self.data_shape.get("num_features"),
        )

    def algorithm(self):
        from raysim.core.server import build_algorithm

        return build_algorithm(self.context())

    def model(self):
        """The global model of the newest checkpoint as a torch module (eval mode).

        An algorithm may define `model_of(state, ctx)` (FRL: the supernet with the voted
        masks); otherwise the state's 'params' vector is loaded into the config's model."""
        ctx = self.context()
        algorithm = self.algorithm()
        model_of = getattr(algorithm, "model_of", None)
        if model_of is not None:
            model = model_of(self.state, ctx)
        else:
            if "params" not in self.state.arrays:
                raise RaysimError(
                    f"{self.out_dir}: algorithm '{self.config.algorithm.name}' keeps no 'params' "
                    f"vector and has no model_of(state, ctx); use .state (arrays: "
                    f"{', '.join(sorted(self.state.arrays))})"
                )
            from raysim.models.vector import build_model, set_vector

            model = build_model(ctx)
            set_vector(model, self.state.arrays["params"])
        return model.eval()


def load_run(out_dir: str | Path) -> RunRecord:
    """Read a run folder written by `run` (finished or stopped): config.yaml, metrics.jsonl,
    summary.json (if finished) and the newest readable checkpoint. No plug-in the config names
    is imported or run to read them (`.model()` and `.algorithm()` build the config's own)."""
    from raysim import config as config_module
    from raysim.outputs.checkpoints import checkpoint_paths, load_checkpoint

    out_dir = Path(out_dir)
    if not (out_dir / "config.yaml").is_file():
        raise RaysimError(f"{out_dir} is not a raysim run folder (no config.yaml)")
    # Read with plug-ins unresolved: a run folder may come from anyone, and reading its records
    # must not import, let alone call, what its config names (raysim.plugins).
    config = config_module.load(out_dir / "config.yaml", resolve_plugins=False)
    metrics = []
    if (out_dir / "metrics.jsonl").exists():
        for number, line in enumerate((out_dir / "metrics.jsonl").read_text().splitlines(), 1):
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                raise RaysimError(
                    f"{out_dir / 'metrics.jsonl'}:{number}: not a JSON record"
                ) from None
    summary = None
    if (out_dir / "summary.json").exists():
        summary = json.loads((out_dir / "summary.json").read_text())
    problems = []
    for path in reversed(checkpoint_paths(out_dir / "checkpoints")):
        try:
            state, meta = load_checkpoint(path)
        except RaysimError as error:
            problems.append(str(error))
            continue
        shape = {k: meta[k] for k in ("input_shape", "num_classes", "num_features") if k in meta}
        return RunRecord(out_dir, config, metrics, summary, state, shape)
    detail = f" ({problems[0]})" if problems else ""
    raise RaysimError(f"{out_dir}: no readable checkpoint in {out_dir / 'checkpoints'}{detail}")
