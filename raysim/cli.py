"""Command line: `raysim run`, `raysim tune`, `raysim partition`, `raysim info`.

Errors caused by the user's input (config, data) print one line `raysim: error: ...` and exit
with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

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
        help="override a config key, e.g. clients.lr=0.1",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysim", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="run one simulation, or continue one (--resume)")
    _add_config_arguments(run, optional=True)  # optional with --resume
    run.add_argument("--out", help="output folder (default: runs/NAME-TIMESTAMP)")
    run.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the stopped run in DIR from its newest readable checkpoint",
    )
    run.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")
    run.add_argument("--no-progress", action="store_true", help="hide the progress bar")

    tune = commands.add_parser(
        "tune", help="sweep hyperparameters with Ray Tune (the config's `tune:` section)"
    )
    _add_config_arguments(tune)
    tune.add_argument("--out", help="output folder (default: runs/tune-NAME-TIMESTAMP)")
    tune.add_argument("--address", help="join a Ray cluster ('auto' or ray://host:port)")

    partition = commands.add_parser("partition", help="show a config's client split")
    _add_config_arguments(partition)
    partition.add_argument("--rows", type=int, default=20, help="clients to list")

    commands.add_parser("info", help="list the available plug-ins")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except RaysimError as error:
        print(f"raysim: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("raysim: interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from raysim import config as config_module

    if args.command == "info":
        from raysim import registry

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

    if args.command == "run" and args.resume:
        if args.config or args.overrides or args.out:
            raise RaysimError(
                "--resume DIR continues the run with DIR/config.yaml; "
                "give no CONFIG, --set or --out with it"
            )
        from raysim.core.loop import resume

        result = resume(args.resume, address=args.address, progress=not args.no_progress)
        _print_done(result, args.resume)
        return 0
    if args.config is None:
        raise RaysimError("raysim run needs a CONFIG file (or --resume DIR)")
    if args.command == "tune":
        from raysim import tune

        config, spec = tune.load_sweep(args.config, args.overrides)
        out = args.out or f"runs/tune-{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
        result = tune.run_sweep(config, spec, out, address=args.address)
        return 0 if result.best is not None else 1
    config = config_module.load(args.config, args.overrides)
    if args.command == "partition":
        from raysim.core.loop import load_dataset
        from raysim.data.partition import describe_partition, split_for_run

        dataset = load_dataset(config)
        result = split_for_run(config, dataset)
        print(describe_partition(result, dataset, max_rows=args.rows))
        return 0

    from raysim.core.loop import run

    out = args.out or f"runs/{config.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = run(config, out, address=args.address, progress=not args.no_progress)
    _print_done(result, out)
    return 0


def _print_done(result, out: str) -> None:
    final = ", ".join(
        f"{k}={v:.4f}" for k, v in result.summary["final"].items() if isinstance(v, int | float)
    )
    print(
        f"done: {result.summary['rounds']} rounds in {result.summary['wall_s']:.1f} s; "
        f"final {final}; outputs in {out}"
    )


if __name__ == "__main__":
    sys.exit(main())
