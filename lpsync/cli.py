"""The ``lpsync`` console script: one subcommand per module in lpsync.commands."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from lpsync import __version__
from lpsync.errors import LpsyncError

# Subcommand modules, each with add_parser(subparsers) and run(args) -> int.
COMMANDS = (
    "daemon",
    "status",
    "health",
    "bench",
    "chaos",
    "simulate",
    "claims",
    "cluster",
    "demo",
    "paper",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lpsync", description="Linear Pipelining collectives: simulator, benchmarks and the node daemon."
    )
    parser.add_argument("--version", action="version", version=f"lpsync {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"lpsync.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # inside the try: a reader that left shows up here, not at exit
        return code
    except BrokenPipeError:
        return _closed_pipe()
    except LpsyncError as error:
        print(f"lpsync {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"lpsync {args.command}: interrupted", file=sys.stderr)
        return 130


def _closed_pipe() -> int:
    """stdout's reader went away (``lpsync status | head``): end quietly, as a tool killed by
    SIGPIPE would (exit 141), with stdout pointed at /dev/null so that the interpreter's
    final flush has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
