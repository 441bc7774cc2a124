"""Command line: `raysim run`, `raysim tune`, `raysim compare`, `raysim partition`, `raysim info`.

Errors caused by the user's input (config, data) print one line `raysim: error: ...` and exit
with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import threading
import time
from collections.abc import Sequence

from raysim.config import UNSET_PREFIX
from raysim.errors import RaysimError


def _add_config_arguments(parser: argparse.ArgumentParser, optional: bool = False) -> None:
    parser.add_argument(
        "config", nargs="?" if optional else None, help="experiment YAML file (see configs/)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. clients.lr=0.1; a whole section: model='{name: lenet}'",
    )
    parser.add_argument(
        "--unset",
        dest="overrides",
        action="append",
        type=lambda key: f"{UNSET_PREFIX}{key}",
        metavar="KEY",
        help="remove a key of the config file, e.g. model.hidden (its default applies)",
    )


def _parser() -> argparse.ArgumentParser:
    from raysim._version import __version__

    parser = argparse.ArgumentParser(prog="raysim", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"raysim {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run one simulation, or continue one (--resume)")
    _add_config_arguments(run, optional=True)  # optional with --resume
    run.add_argument("--out", help="output folder (default: runs/NAME-TIMESTAMP)")
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="if --out holds another run, delete it (without this, such a folder is refused)",
    )
    run.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the stopped run in DIR from its newest usable checkpoint "
        "(--set run.rounds=N extends it)",
    )
    run.add_argument(
        "--trust-plugins",
        action="store_true",
        help="with --resume: allow the plug-ins DIR's config names by import path "
        "(module:attr) to be imported and run; a received run folder is someone else's code",
    )
    run.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    tune = commands.add_parser(
        "tune", help="sweep hyperparameters with Ray Tune (the config's `tune:` section)"
    )
    _add_config_arguments(tune, optional=True)  # optional with --resume
    tune.add_argument("--out", help="output folder (default: runs/tune-NAME-TIMESTAMP)")
    tune.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")
    tune.add_argument(
        "--resume",
        metavar="OUT",
        help="continue the stopped sweep in OUT with Tune's restore (finished trials reused)",
    )
    tune.add_argument(
        "--trust-plugins",
        action="store_true",
        help="with --resume: allow the plug-ins OUT's sweep names by import path (module:attr)",
    )

    compare = commands.add_parser(
        "compare",
        help="tune every method with the same budget on validation, re-run the winners on "
        "several seeds, report test mean ± std and ratios (raysim/compare.py)",
    )
    _add_config_arguments(compare)
    compare.add_argument("--out", help="output folder (default: runs/compare-NAME-TIMESTAMP)")
    compare.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")
    compare.add_argument(
        "--report-only",
        action="store_true",
        help="write the report of the sweeps and re-runs already in --out (trains nothing)",
    )
    compare.add_argument(
        "--reuse",
        action="store_true",
        help="read a method from --out instead of training it again when its grid sweep and "
        "re-runs there are, run by run, what this spec gives (e.g. after re-centring one "
        "method's grid); the others are tuned and re-run",
    )

    partition = commands.add_parser("partition", help="show a config's client split")
    _add_config_arguments(partition)
    partition.add_argument("--rows", type=int, default=20, help="clients to list")

    info = commands.add_parser(
        "info", help="the available plug-ins; with KIND and NAME, one plug-in's options"
    )
    info.add_argument("kind", nargs="?", help="e.g. algorithm, model, aggregator, codec")
    info.add_argument("name", nargs="?", help="a plug-in of that kind, e.g. fedaws")
    return parser


def _thread_storage_errors(hook_args) -> None:
    """A writer thread's storage fault (TensorBoard's event writer, on a deleted or full --out)
    is one line, as the main thread's; anything else keeps Python's traceback."""
    error = hook_args.exc_value
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS and error.filename:
        # said when main() ends, unless the main thread met the same path (one line, then)
        _THREAD_STORAGE_ERRORS[os.fsdecode(error.filename)] = error.strerror
        return
    _PYTHON_THREAD_HOOK(hook_args)


_PYTHON_THREAD_HOOK = threading.excepthook
_THREAD_STORAGE_ERRORS: dict[str, str] = {}


def main(argv: Sequence[str] | None = None) -> int:
    threading.excepthook = _thread_storage_errors
    reported: list[str] = []
    try:
        return _main(argv, reported)
    finally:
        for path, reason in _THREAD_STORAGE_ERRORS.items():
            if path not in reported:
                print(f"raysim: error: storage: {path}: {reason}", file=sys.stderr)
        _THREAD_STORAGE_ERRORS.clear()


def _main(argv: Sequence[str] | None, reported: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except RaysimError as error:
        print(f"raysim: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.errno not in STORAGE_ERRNOS or not error.filename:
            raise  # not a storage fault: a bug, with its traceback
        # A full disk, a read-only or deleted --out: one line naming the path (the newest
        # checkpoint is intact: checkpoints are written to a temp file and renamed).
        hint = _resume_hint(getattr(args, "run_dir", None))
        path = os.fsdecode(error.filename)
        reported.append(path)
        print(f"raysim: error: storage: {path}: {error.strerror}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        from raysim.interrupts import Terminated

        # SIGTERM: 143 (128 + 15), as a process ended by it; Ctrl-C: 130 (128 + SIGINT)
        terminated = isinstance(stop, Terminated)
        what = "stopped by SIGTERM" if terminated else "interrupted"
        print(f"raysim: {what}{_resume_hint(getattr(args, 'run_dir', None))}", file=sys.stderr)
        return 143 if terminated else 130


# errno values of storage faults (no space, quota, read-only, permission, a folder gone).
STORAGE_ERRNOS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENOENT,
    errno.EIO,
}


def _resume_hint(run_dir: str | None) -> str:
    """Where a stopped run can continue from: its newest checkpoint and the command."""
    from pathlib import Path

    if not run_dir:
        return ""
    if not os.path.isdir(run_dir):  # deleted under the run: a resume would have nothing
        return f"; {run_dir} does not exist (any more), so there is nothing to resume from"
    from raysim.outputs.checkpoints import checkpoint_paths

    checkpoints = checkpoint_paths(Path(run_dir, "checkpoints"))
    if not checkpoints:
        return (
            f"; no checkpoint was written in {run_dir} yet; continue with: raysim run --resume "
            f"{run_dir} (from round 0)"
        )
    newest = int(checkpoints[-1].stem.removeprefix("round_"))  # numeric order: the newest
    return (
        f"; newest checkpoint: round {newest} in {Path(run_dir, 'checkpoints')}; "
        f"continue with: raysim run --resume {run_dir}"
    )


def _dispatch(args: argparse.Namespace) -> int:
    from raysim import config as config_module

    if args.command == "info":
        from raysim import registry

        if args.kind:
            print(_describe(args.kind, args.name))
            return 0
        for reg in (
            registry.datasets,
            registry.partitioners,
            registry.models,
            registry.algorithms,
            registry.aggregators,
            registry.codecs,
            registry.attacks,
            registry.server_optimizers,
            registry.indexes,
            registry.backends,
        ):
            plural = "indexes" if reg.kind == "index" else reg.kind + "s"
            print(f"{plural:<20} {', '.join(reg.names())}")
        print("any kind may also be named package.module:attr (docs/EXTENDING.md)")
        return 0

    if args.command == "tune":
        return _tune(args)
    if args.command == "run" and args.resume:
        if args.config or args.out or args.overwrite:
            raise RaysimError(
                "--resume DIR continues the run with DIR/config.yaml; give no CONFIG, --out "
                "or --overwrite with it (--set run.rounds=N extends the run)"
            )
        from raysim.assembly import resume

        args.run_dir = args.resume
        result = resume(
            args.resume,
            overrides=args.overrides,
            address=args.address,
            progress=not args.no_progress,
            trust_plugins=args.trust_plugins,
        )
        _print_done(result, args.resume)
        return 0
    if getattr(args, "trust_plugins", False):
        raise RaysimError(
            "--trust-plugins applies to --resume DIR (a new run's plug-ins are checked for "
            "their @raysim.plugin declaration)"
        )
    if args.config is None:
        raise RaysimError("raysim run needs a CONFIG file (or --resume DIR)")
    if args.command == "compare":
        from pathlib import Path

        from raysim import compare
        from raysim.compare_spec import load_comparison

        comparison = load_comparison(args.config, args.overrides)
        stem = Path(args.config).stem
        if args.report_only:
            if not args.out:
                raise RaysimError(
                    "raysim compare --report-only needs --out (the comparison's folder)"
                )
            compare.report_from_folders(comparison, args.out)
            return 0
        if args.reuse and not args.out:
            raise RaysimError("raysim compare --reuse needs --out (the comparison's folder)")
        from raysim.config.paths import job_out_dir

        out = job_out_dir(args.out or f"runs/compare-{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        compare.run_comparison(comparison, out, address=args.address, reuse=args.reuse)
        return 0
    config = config_module.load(args.config, args.overrides)
    if args.command == "partition":
        from raysim.assembly.plan import partition_for_run
        from raysim.data.datasets import load_dataset
        from raysim.data.partition_report import describe_partition

        dataset = load_dataset(config)
        result = partition_for_run(config, dataset)
        print(describe_partition(result, dataset, max_rows=args.rows))
        return 0

    from raysim.assembly import run
    from raysim.config.paths import job_out_dir

    out = job_out_dir(args.out or f"runs/{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    args.run_dir = out
    result = run(
        config, out, address=args.address, progress=not args.no_progress, overwrite=args.overwrite
    )
    _print_done(result, out)
    return 0


def _tune(args: argparse.Namespace) -> int:
    """`raysim tune CONFIG [--out OUT]` or `raysim tune --resume OUT`. A sweep stopped by Ctrl-C
    (130) or SIGTERM (143) writes its finished trials' results and best config first."""
    from raysim import tune

    if args.resume:
        if args.config or args.out or args.overrides:
            raise RaysimError(
                "--resume OUT continues the sweep with OUT's own sweep.yaml; give no CONFIG, "
                "--out or --set with it"
            )
        out = args.resume
        config, spec = tune.load_saved_sweep(out, trust_plugins=args.trust_plugins)
    else:
        if args.trust_plugins:
            raise RaysimError("--trust-plugins applies to --resume OUT")
        if args.config is None:
            raise RaysimError("raysim tune needs a CONFIG file (or --resume OUT)")
        config, spec = tune.load_sweep(args.config, args.overrides)
        from raysim.config.paths import job_out_dir

        out = job_out_dir(
            args.out or f"runs/tune-{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
        tune.save_sweep(out, args.config, args.overrides)
    result = tune.run_sweep(config, spec, out, address=args.address, resume=bool(args.resume))
    if result.interrupted:
        done = sum(row["status"] == "completed" for row in result.rows)
        what = "stopped by SIGTERM" if result.interrupted == "SIGTERM" else "interrupted"
        best = f", best config in {result.out_dir / 'best_config.yaml'}" if result.best else ""
        print(
            f"raysim: {what}; {done} of {result.expected_trials} trials finished, results in "
            f"{result.out_dir / 'tune_results.csv'}{best}; continue with: raysim tune --resume "
            f"{out}",
            file=sys.stderr,
        )
        return 143 if result.interrupted == "SIGTERM" else 130
    return 0 if result.best is not None else 1


KINDS = {
    "dataset": "datasets",
    "partitioner": "partitioners",
    "partition": "partitioners",
    "model": "models",
    "algorithm": "algorithms",
    "aggregator": "aggregators",
    "codec": "codecs",
    "attack": "attacks",
    "optimizer": "server_optimizers",
    "server_optimizer": "server_optimizers",
    "index": "indexes",
    "backend": "backends",
}


def _describe(kind: str, name: str | None) -> str:
    """`raysim info KIND [NAME]`: the plug-ins of a kind with a line each, or one plug-in's
    options with their defaults."""
    import inspect

    from raysim import registry

    key = kind.lower().rstrip("s") if kind.lower() not in KINDS else kind.lower()
    if key not in KINDS:
        from raysim.errors import closest

        raise RaysimError(
            f"unknown kind '{kind}'{closest(kind, list(KINDS))}; kinds: {', '.join(sorted(KINDS))}"
        )
    reg = getattr(registry, KINDS[key])
    names = [name] if name else reg.names()
    lines = []
    for plugin in names:
        factory = reg.get(plugin)
        summary = _summary(factory)
        if not name:
            lines.append(f"{plugin:<22} {summary}")
            continue
        lines.append(f"{reg.kind} '{plugin}': {summary}".rstrip())
        lines.append(f"  defined in {factory.__module__}.{factory.__qualname__}")
        parameters = [
            p
            for p in inspect.signature(factory).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        ]
        if not parameters:
            lines.append("  options: none")
        for parameter in parameters:
            option = (
                parameter.name.removesuffix("_") if parameter.name.endswith("_") else parameter.name
            )
            annotation = parameter.annotation
            type_text = (
                annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
            )
            default = (
                "required"
                if parameter.default is inspect.Parameter.empty
                else repr(parameter.default)
            )
            lines.append(f"  {option:<24} {type_text:<18} default {default}")
    return "\n".join(lines)


def _summary(factory) -> str:
    """The first sentence of the factory's own docstring (not one it inherits), else of its
    module's."""
    import inspect
    import sys as _sys

    own = vars(factory).get("__doc__") if inspect.isclass(factory) else factory.__doc__
    text = own or getattr(_sys.modules.get(factory.__module__), "__doc__", None) or ""
    paragraph = " ".join(inspect.cleandoc(text).split("\n\n")[0].split())
    # the first ". " that ends a sentence: not the one after "et al", "e.g", "i.e", "vs"
    sentence = re.split(r"(?<!\bal)(?<!e\.g)(?<!i\.e)(?<!\bvs)\. ", paragraph)[0].rstrip(".")
    return sentence if len(sentence) <= 110 else sentence[:107] + "..."


def _print_done(result, out: str) -> None:
    final = ", ".join(
        f"{k}={v:.4f}" for k, v in result.summary["final"].items() if isinstance(v, int | float)
    )
    best = ""
    for name, entry in (result.summary.get("best") or {}).items():
        if name != "loss":  # the first quality metric (accuracy, mAP, P@1, ...)
            best = f"; best {name}={entry['value']:.4f} (round {entry['round']})"
            break
    print(
        f"done: {result.summary['rounds']} rounds in {result.summary['wall_s']:.1f} s; "
        f"final {final}{best}; outputs in {out}"
    )


if __name__ == "__main__":
    sys.exit(main())
