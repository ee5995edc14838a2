"""``python -m estimax.ops.native build|status``: build the oneDNN kernels, or say which run."""

from __future__ import annotations

import argparse
import sys

from estimax.ops import native


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m estimax.ops.native", description=__doc__)
    parser.add_argument("command", choices=("build", "status"))
    parser.add_argument(
        "--if_possible",
        action="store_true",
        help="build: on failure print why and exit 0 (XLA's kernels are used)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "status":
        print(native.status())
        return 0 if native.available() else 1
    try:
        path = native.build(verbose=args.verbose)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        if args.if_possible:
            print("estimax: continuing with XLA's own CPU convolutions.", file=sys.stderr)
            return 0
        return 1
    print(f"built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
