"""``lpsync claims``: the paper's claims, reproduced by the simulator and checked.

Wang et al. (2016) claim that LP's cost is invariant to P, that MST's grows as log P
and that LP broadcast and reduce reach up to twice BE's bandwidth. The claims are
asymptotic in the message size, so they are checked at 1 GiB (alpha = 5 us,
1 Gbit/s links, gamma = 0); at 64 MiB the table shows how much LP's pipeline fill
costs instead, and that the simulated schedules agree with the closed forms.
"""

from __future__ import annotations

import argparse
import sys

from lpsync.algorithms import LinkModel
from lpsync.algorithms.claims import LARGE, MEDIUM, checks
from lpsync.algorithms.sweep import sweep
from lpsync.report import write_json_lines, write_table
from lpsync.types import Collective, dtype_of

NODES = [2, 4, 8, 16, 64, 256, 1024]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "claims",
        help="reproduce and check the LP paper's claims with the simulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nodes", default=",".join(map(str, NODES)), help="participant counts (default 2..1024)")
    p.add_argument("--plot", metavar="FILE.png", help="draw time against P and against size")
    p.add_argument("--json", action="store_true", help="the checks as JSON lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.units import parse_ints

    link = LinkModel.from_bandwidth(5e-6, 1.25e8)
    rows = sweep(
        [Collective.BROADCAST, Collective.REDUCE],
        ["lp", "mst", "be"],
        parse_ints(args.nodes, "--nodes"),
        [1 << 20, MEDIUM, LARGE],
        dtype_of("float32"),
        link,
        progress=sys.stderr.isatty(),
    )
    verdicts = checks(rows)
    if args.json:
        write_json_lines(verdicts, sys.stdout)
    else:
        print("# simulated, alpha=5e-6 s, bandwidth=1.25e8 B/s (1 Gbit/s), gamma=0")
        write_table(
            [r for r in rows if r["bytes"] != 1 << 20],
            ("op", "algorithm", "nodes", "size", "chunks", "seconds", "model", "x_lp"),
            sys.stdout,
        )
        print("\n# the paper's claims")
        write_table(verdicts, ("op", "claim", "nodes", "value", "bound", "ok"), sys.stdout)
    if args.plot:
        from lpsync.commands.plot import plot_points

        plot_points(rows, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    failed = [v for v in verdicts if not v["ok"]]
    return 1 if failed else 0
