"""The ``lpsync`` console script: one subcommand per module of lpsync.commands."""

from __future__ import annotations

import argparse
import sys

from lpsync.commands import bench, daemon, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lpsync", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in (daemon, status, bench):
        command.add_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
