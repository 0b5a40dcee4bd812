"""``lpsync cluster up|down``: an emulated cluster of network namespaces with shaped links."""

from __future__ import annotations

import argparse
import json
import sys

from lpsync.cluster import ClusterSpec, down, format_rate, parse_delay, parse_rate, up
from lpsync.cluster.testbed import SUBNET


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "cluster",
        help="build or remove an emulated cluster (network namespaces, needs root)",
        description=f"N network namespaces PREFIX-n0.. on a bridge (namespace PREFIX-sw), node i "
        f"at 198.18.0.(i+1) in {SUBNET} and nowhere else, each with a full-duplex "
        "NIC shaped to RATE by tbf on both ends of its veth.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    u = actions.add_parser("up", help="create the cluster")
    u.add_argument("--nodes", type=int, required=True, help="number of nodes (1..254)")
    u.add_argument("--link", required=True, help="rate of every NIC, each direction: 1gbit, 100mbit")
    u.add_argument("--delay", help="one-way node-to-node delay, e.g. 1ms (needs netem in the kernel)")
    u.add_argument("--prefix", default="lpsync", help="name prefix (default lpsync)")
    u.add_argument("--json", action="store_true", help="print the cluster as JSON")
    d = actions.add_parser("down", help="remove the cluster and stop what runs inside it")
    d.add_argument("--prefix", default="lpsync", help="name prefix (default lpsync)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.action == "down":
        removed = down(args.prefix)
        print(f"removed {len(removed)} namespaces" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    spec = ClusterSpec(
        args.nodes, parse_rate(args.link), parse_delay(args.delay) if args.delay else None, args.prefix
    )
    up(spec)
    if args.json:
        json.dump(spec.describe(), sys.stdout)
        print()
        return 0
    delay = f", {args.delay} one-way" if args.delay else ""
    print(
        f"cluster {spec.prefix!r}: {spec.nodes} nodes, {format_rate(spec.rate_bits)} full duplex"
        f" per node{delay}"
    )
    for node in range(spec.nodes):
        print(f"  node {node}  namespace {spec.namespace(node):<14} address {spec.address(node)}")
    print(f"run a command on node 0:  ip netns exec {spec.namespace(0)} COMMAND")
    print(
        f"remove it:                lpsync cluster down --prefix {spec.prefix}"
        if spec.prefix != "lpsync"
        else "remove it:                lpsync cluster down"
    )
    return 0
