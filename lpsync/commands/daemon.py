"""``lpsync daemon``: serve the control plane on this node."""

from __future__ import annotations

import argparse
import sys

from lpsync.daemon import config as daemon_config
from lpsync.errors import LpsyncError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "daemon", help="run the lpsync daemon of this node",
        description="Serve lpsync's gRPC control plane on a Unix socket (and optionally TCP "
                    "with TLS and a token). Settings: flags > LPSYNC_* environment > --config.")
    daemon_config.add_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.daemon import logs, server

    try:
        config = daemon_config.from_args(args)
    except LpsyncError as error:
        print(f"lpsync daemon: {error}", file=sys.stderr)
        return 2
    logs.setup(config.log_level)
    try:
        return server.serve(config)
    except LpsyncError as error:
        print(f"lpsync daemon: {error}", file=sys.stderr)
        return 1
