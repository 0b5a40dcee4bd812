"""``lpsync chaos``: faults injected on a seeded schedule while trainers check every
collective; exit status 1 when a check fails (lpsync/chaos)."""

from __future__ import annotations

import argparse
import json

_DESCRIPTION = """\
Builds an emulated cluster on this machine (root: network namespaces at 198.18.0.x) with
this install's daemons, one per node, and trainers that run allreduces and broadcasts and
check every result against numpy. A seeded schedule injects one fault at a time: SIGKILL
or SIGSTOP a daemon or a trainer, cut a node's link in one direction or both; holds it,
releases it and waits until every rank succeeds again. Checked: no wrong result delivered
as OK, every failure within its bound, no hang, survivors keep serving, restarted daemons
rejoin, clean exits, nothing left behind (docs/reliability.md, "Chaos"). The same seed
gives the same schedule. Example: sudo lpsync chaos --seconds 60 --seed 1
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="how long faults are injected (default 60)"
    )
    parser.add_argument(
        "--faults",
        type=int,
        default=0,
        help="stop after this many faults, even before --seconds (default 0: no limit)",
    )
    parser.add_argument("--seed", type=int, default=1, help="the schedule's seed (default 1)")
    parser.add_argument("--nodes", type=int, default=4, help="emulated nodes (default 4)")
    parser.add_argument("--per-node", type=int, default=2, help="trainers per node (default 2)")
    parser.add_argument(
        "--transport", default="tcp", choices=("tcp", "ucx"), help="peer transport (default tcp)"
    )
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=2.0, help="the daemons' (default 2; theirs is 5)"
    )
    parser.add_argument("--timeout", type=float, default=8.0, help="each collective's timeout (default 8)")
    parser.add_argument(
        "--rejoin-bound",
        type=float,
        default=45.0,
        help="seconds for all ranks to succeed again after a release (default 45)",
    )
    parser.add_argument(
        "--slack",
        type=float,
        default=2.0,
        help="seconds added to every bound on a loaded machine (default 2)",
    )
    parser.add_argument("--prefix", default="", help="the cluster's namespace prefix (default lpc<pid>)")
    parser.add_argument(
        "--keep",
        default="",
        help="keep the daemons' logs and every fault and report (chaos.jsonl) in this folder",
    )
    parser.add_argument("--json", action="store_true", help="the summary as one JSON object")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "chaos",
        help="inject faults on an emulated cluster while every collective is checked (needs root)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lpsync.chaos.report import table
    from lpsync.chaos.run import run as run_chaos

    summary = run_chaos(args)
    if args.json:
        print(json.dumps(summary))
    else:
        header = (
            f"chaos: {args.nodes} nodes x {args.per_node} ranks, {args.transport}, "
            f"{args.seconds:g} s{f' or {args.faults} faults' if args.faults else ''}, seed {args.seed}, "
            f"heartbeat timeout {args.heartbeat_timeout:g} s, collective timeout {args.timeout:g} s"
        )
        print(table(summary, header))
    return 0 if summary["passed"] else 1
