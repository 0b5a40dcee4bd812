"""``lpsync health``: exit 0 when the local daemon's gRPC health service says SERVING.

Made for exec probes (Kubernetes liveness/readiness, compose healthchecks, the Slurm
script's wait): the daemon's control plane is a Unix socket, which TCP and HTTP probes
cannot reach. Health checks need no token (server.TokenInterceptor lets them through).
"""

from __future__ import annotations

import argparse
import os
import sys

from lpsync.daemon import launch
from lpsync_client import DEFAULT_SOCKET


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health", help="check that the daemon on this node serves (exit 0) or not (exit 1)"
    )
    parser.add_argument("--socket", help=f"daemon socket (env LPSYNC_SOCKET; default {DEFAULT_SOCKET})")
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)"
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    socket = args.socket or os.environ.get("LPSYNC_SOCKET") or DEFAULT_SOCKET
    try:
        status = launch.health(socket, args.timeout)
    except grpc.RpcError as error:
        status = f"unreachable ({error.code().name}: {error.details()})"
    if not args.quiet:
        print(f"lpsync daemon at {socket}: {status}", file=sys.stdout if status == "SERVING" else sys.stderr)
    return 0 if status == "SERVING" else 1
