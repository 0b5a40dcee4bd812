"""``lpsync simulate``: time schedules under the alpha-beta-gamma model, with a table or JSON.

Every row is an event simulation of the generated schedule (lpsync.algorithms.simulate);
the ``model`` column is the closed form beside it, and ``x_lp`` the time relative to LP
at the same point, which is how the paper's claims read off the output.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lpsync.algorithms import ALGORITHMS, LinkModel
from lpsync.algorithms.cost import DEFAULT_MIN_CHUNK_BYTES
from lpsync.algorithms.sweep import sweep
from lpsync.errors import InvalidArgumentError
from lpsync.report import write_json_lines, write_table
from lpsync.types import dtype_of, parse_collective
from lpsync.units import format_size, parse_ints, parse_size, parse_sizes

COLUMNS = ("op", "algorithm", "nodes", "size", "chunks", "seconds", "model", "algbw", "busbw", "x_lp")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate collectives under the alpha-beta-gamma model",
        description="Event-simulate the schedules of each algorithm on a cluster where every "
        "node has one full-duplex link, and print seconds, algbw and busbw "
        "(nccl-tests' definitions) beside the closed-form model.",
    )
    p.add_argument(
        "--op",
        default="broadcast",
        help="collective(s), comma separated: allreduce, broadcast, reduce, "
        "allgather, reduce_scatter, gather, scatter, alltoall (default broadcast)",
    )
    p.add_argument(
        "--algorithms",
        default="",
        help=f"comma list from {', '.join(ALGORITHMS)} (default: all that offer the op)",
    )
    p.add_argument("--nodes", default="2,4,8", help="participant counts, comma list (default 2,4,8)")
    p.add_argument(
        "--bytes",
        default="64MiB",
        help="buffer sizes: comma list, LOW:HIGH doubles (default 64MiB); for allgather "
        "the gathered output, for reduce_scatter the input",
    )
    p.add_argument("--alpha", type=float, default=5e-6, help="seconds per message (default 5e-6)")
    p.add_argument(
        "--bandwidth",
        type=float,
        default=1.25e9,
        help="bytes/s per link direction (default 1.25e9, 10 Gbit/s)",
    )
    p.add_argument("--gamma", type=float, default=0.0, help="seconds per byte reduced (default 0)")
    p.add_argument(
        "--links",
        choices=("nic", "pair"),
        default="nic",
        help="nic: one full-duplex NIC per node (default); pair: a link per node pair",
    )
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument(
        "--chunks",
        default="auto",
        help="LP chunk count: auto (closed-form k*), search (simulate around k*), or N",
    )
    p.add_argument(
        "--min-chunk", default=format_size(DEFAULT_MIN_CHUNK_BYTES), help="smallest LP chunk (default 64KiB)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--plot", metavar="FILE.png", help="draw time against P and against size")
    p.set_defaults(func=run)


def points(args: argparse.Namespace) -> list[dict[str, Any]]:
    wanted = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for name in wanted:
        if name not in ALGORITHMS:
            raise InvalidArgumentError(f"unknown algorithm {name!r}; expected {', '.join(ALGORITHMS)}")
    nodes = parse_ints(args.nodes, "--nodes")
    if any(p < 1 for p in nodes):
        raise InvalidArgumentError("--nodes must be >= 1")
    link = LinkModel.from_bandwidth(args.alpha, args.bandwidth, args.gamma, shared_nic=args.links == "nic")
    return sweep(
        [parse_collective(o.strip()) for o in args.op.split(",")],
        wanted,
        nodes,
        parse_sizes(args.bytes),
        dtype_of(args.dtype),
        link,
        args.chunks,
        parse_size(args.min_chunk),
        progress=sys.stderr.isatty() and not args.json,
    )


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    rows = points(args)
    if args.json:
        write_json_lines(({k: v for k, v in r.items() if k != "size"} for r in rows), sys.stdout)
    else:
        write_table(rows, COLUMNS, sys.stdout)
        print(
            f"# alpha={args.alpha:g} s, bandwidth={args.bandwidth:g} B/s, gamma={args.gamma:g} "
            f"s/B, links={args.links}; x_lp = seconds / LP seconds; "
            f"{time.monotonic() - started:.1f} s",
            file=sys.stdout,
        )
    if args.plot:
        from lpsync.commands.plot import plot_points

        plot_points(rows, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0
