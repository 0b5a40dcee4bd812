"""``lpsync bench``: the nccl-tests table for a local daemon, optionally beside gloo."""

from __future__ import annotations

import argparse
import sys

from lpsync.errors import LpsyncError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="measure collectives through a daemon (nccl-tests table)",
        description="Starts a daemon (unless --socket names a running one) and N client "
                    "processes, and prints size, count, type, redop, root, time, algbw, busbw "
                    "and #wrong per size. Progress goes to stderr.")
    parser.add_argument("--op", default="allreduce",
                        choices=["allreduce", "broadcast", "reduce", "allgather",
                                 "reduce_scatter"])
    parser.add_argument("--bytes", default="4:256MiB",
                        help="sizes: 64MiB, 4:256MiB (doubling) or a comma list")
    parser.add_argument("--procs", type=int, default=2, help="client processes (ranks)")
    parser.add_argument("--algorithm", help="force lp, ring, mst, be or direct")
    parser.add_argument("--iters", type=int, default=0,
                        help="timed iterations per size (default: by size, 10..1000)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compare", choices=["gloo"], help="also run torch.distributed gloo")
    parser.add_argument("--socket", help="use the daemon on this socket if one is serving")
    parser.add_argument("--trigger", choices=["auto", "grpc", "socket"], default="auto",
                        help="send collectives on the daemon's trigger socket, on the gRPC "
                             "Session stream, or auto (the client's default: the socket if "
                             "offered)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.bench import runner
    from lpsync.units import parse_sizes

    try:
        options = runner.Options(args.op, parse_sizes(args.bytes), args.procs, args.algorithm,
                                 args.iters, args.warmup, args.compare, args.socket,
                                 trigger=args.trigger)
    except LpsyncError as error:
        print(f"lpsync bench: {error}", file=sys.stderr)
        return 2
    if options.procs < 1:
        print("lpsync bench: --procs must be >= 1", file=sys.stderr)
        return 2
    rows = runner.run(options)
    print(runner.report(options, rows, args.json))
    return 0
