"""``lpsync claims``: the paper's claims, reproduced by the simulator and checked.

Wang et al. (2016) claim that LP's cost is invariant to P, that MST's grows as log P
and that LP broadcast and reduce reach up to twice BE's bandwidth. The claims are
asymptotic in the message size, so they are checked at 1 GiB (alpha = 5 us,
1 Gbit/s links, gamma = 0); at 64 MiB the table shows how much LP's pipeline fill
costs instead, and that the simulated schedules agree with the closed forms.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from lpsync.algorithms import LinkModel
from lpsync.report import write_json_lines, write_table
from lpsync.types import Collective, dtype_of

NODES = [2, 4, 8, 16, 64, 256, 1024]
LARGE, MEDIUM = 1 << 30, 64 << 20


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


def checks(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim at each point: measured value, bound, verdict."""
    at = {(r["op"], r["algorithm"], r["nodes"], r["bytes"]): r for r in rows}
    out: list[dict[str, Any]] = []
    for op in ("broadcast", "reduce"):
        nodes = sorted({r["nodes"] for r in rows if r["op"] == op})
        lp2 = at[(op, "lp", nodes[0], LARGE)]["seconds"]
        lp_top = at[(op, "lp", nodes[-1], LARGE)]["seconds"]
        out.append(
            {
                "op": op,
                "claim": f"LP flat in P: LP(P={nodes[-1]}) / LP(P={nodes[0]})",
                "nodes": nodes[-1],
                "value": lp_top / lp2,
                "bound": "<= 1.10",
                "ok": lp_top / lp2 <= 1.10,
            }
        )
        for p in (n for n in nodes if n >= 4):
            mst = at[(op, "mst", p, LARGE)]["x_lp"]
            be = at[(op, "be", p, LARGE)]["x_lp"]
            log_bound, be_bound = 0.9 * math.log2(p), 0.9 * 2 * (p - 1) / p
            out.append(
                {
                    "op": op,
                    "claim": "MST / LP >= 0.9 log2 P",
                    "nodes": p,
                    "value": mst,
                    "bound": f">= {log_bound:.3f}",
                    "ok": mst >= log_bound,
                }
            )
            out.append(
                {
                    "op": op,
                    "claim": "BE / LP >= 0.9 * 2(P-1)/P",
                    "nodes": p,
                    "value": be,
                    "bound": f">= {be_bound:.3f}",
                    "ok": be >= be_bound,
                }
            )
        fill = at[(op, "lp", nodes[-1], MEDIUM)]["seconds"] / at[(op, "lp", nodes[0], MEDIUM)]["seconds"]
        out.append(
            {
                "op": op,
                "claim": "64MiB: LP pipeline fill, LP(P_max) / LP(P_min)",
                "nodes": nodes[-1],
                "value": fill,
                "bound": "(reported)",
                "ok": True,
            }
        )
    worst = max(abs(r["seconds"] / r["model"] - 1) for r in rows if r["model"] > 0)
    out.append(
        {
            "op": "all",
            "claim": "simulated / closed form - 1, worst case",
            "nodes": "all",
            "value": worst,
            "bound": "<= 0.01",
            "ok": worst <= 0.01,
        }
    )
    return out


def run(args: argparse.Namespace) -> int:
    from lpsync.commands.simulate import sweep
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
