"""The estimax command: train a family, serve exports, classify images, check and convert them.

The parser is here; each subcommand is its package's:

    estimax doctor [--launch]        devices, kernels, storage (estimax.doctor)
    estimax train --family=NAME ...  a reference program (estimax.programs.families)
    estimax serve ...                the server (estimax.serving.cli)
    estimax predict | export-check | export-savedmodel | export-onnx ...  (estimax.export.cli)
    estimax goodput MODEL_DIR        where a job's time went (estimax.state.goodput)

Bad flags or paths print one line and exit 2; a failed parity check exits 1.
"""

from __future__ import annotations

import argparse
import logging as std_logging
import os
import sys
from collections.abc import Mapping, Sequence

from estimax.export import cli as export_cli
from estimax.export.versions import ExportCheckError
from estimax.serving import cli as serving_cli
from estimax.state import goodput

EXIT_USAGE = 2


def _parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    # Each subcommand's help fits its line of an 80-column terminal (56 characters).
    parser = argparse.ArgumentParser(
        prog="estimax", description=__doc__.split("\n")[0], formatter_class=export_cli.Defaults
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for --help; `run` hands `estimax doctor ...` to estimax.doctor before this parser
    # sees it.
    sub.add_parser("doctor", help="devices, kernels, storage; --launch: a launch dry-run")
    # Likewise `estimax train --family=NAME ...` (its flags are the program's: absl's, not these).
    sub.add_parser("train", help="a program by family: --family=NAME, then its flags")
    serving_cli.add_parser(sub, os.environ if env is None else env)
    export_cli.add_parsers(sub)
    p = sub.add_parser("goodput", help="where a job's time went: buckets, ratio, step times")
    p.add_argument("model_dir", help="the job's model_dir (its goodput/ record)")
    return parser


def _goodput(args: argparse.Namespace) -> int:
    """``estimax goodput MODEL_DIR``: prints the job's goodput table."""
    print(goodput.table(goodput.summarize(args.model_dir), args.model_dir))
    return 0


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Entry point of the ``estimax`` console script (``env``: the environment to read)."""
    args = _parser(env).parse_args(argv)
    std_logging.basicConfig(level=std_logging.WARNING)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    commands = {**serving_cli.COMMANDS, **export_cli.COMMANDS, "goodput": _goodput}
    try:
        return commands[args.command](args)
    except ExportCheckError as e:
        print(f"estimax {args.command}: FAILED: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as e:
        print(f"estimax {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE


def train(argv: Sequence[str]) -> None:
    """``estimax train --family=NAME [flags]``: runs the program of family NAME on its flags.

    The same as the family's own script (``resnet ...``, ``inception_v3 ...``): every family of
    ``estimax.programs.families`` has this entry, so a new family needs no script of its own.
    """
    from estimax.programs import families
    from estimax.programs.cli import UsageError

    rest, name = [], None
    args = iter(argv)
    for arg in args:
        if arg.startswith("--family="):
            name = arg.split("=", 1)[1]
        elif arg == "--family":
            name = next(args, "")
        else:
            rest.append(arg)
    try:
        if not name:
            raise UsageError(
                f"--family=NAME is required: one of {', '.join(sorted(families.FAMILIES))}"
            )
        family = families.get(name)
    except UsageError as e:
        print(f"estimax train: {e}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    # absl reads sys.argv: the program sees its own name and flags, as from its own script.
    sys.argv = [family.name, *rest]
    family.main()


def run() -> None:
    """Console-script entry point of ``estimax``."""
    if sys.argv[1:2] == ["doctor"]:
        from estimax import doctor

        sys.exit(doctor.main(sys.argv[2:]))
    if sys.argv[1:2] == ["train"]:
        train(sys.argv[2:])
        return
    sys.exit(main())
