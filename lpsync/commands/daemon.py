"""``lpsync daemon``: serve the control plane on this node."""

from __future__ import annotations

import argparse
import faulthandler
import signal
import sys

from lpsync.daemon.control import config as daemon_config
from lpsync.errors import LpsyncError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "daemon",
        help="run the lpsync daemon of this node",
        description="Serve lpsync's gRPC control plane on a Unix socket (and optionally TCP "
        "with TLS and a token). Settings: flags > LPSYNC_* environment > --config.",
    )
    daemon_config.add_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.daemon.control import logs, server

    try:
        config = daemon_config.from_args(args)
    except LpsyncError as error:
        print(f"lpsync daemon: {error}", file=sys.stderr)
        return 2
    logs.setup(config.log_level)
    # `kill -USR1 <pid>` prints every thread's stack to stderr, and so does a fatal signal
    # (a crash inside a native library): hangs and crashes are diagnosable from the log.
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        return server.serve(config)
    except LpsyncError as error:
        print(f"lpsync daemon: {error}", file=sys.stderr)
        return 1
