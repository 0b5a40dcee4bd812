"""How fast every daemon of an emulated cluster exits on SIGTERM, idle and mid-collective.

    sudo python -m lab.exits --nodes 2,5,8,16 --transport tcp,ucx [--json]

For each point: a cluster of N namespaces, one daemon per node, and one trainer per node
running verified allreduces across all nodes. Once every trainer has completed a
collective (the meshes are up), SIGTERM goes to every daemon at once: mid-collective with
the trainers still running, idle after they detached and exited. Each daemon's time to exit, its exit
code, and what it left (shared memory, its sockets) are recorded; afterwards no process
and no namespace may remain. Exit status 1 when any daemon took over ``--bound`` seconds
or left something.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lpsync.chaos.nodes import Exit, Nodes, Trainer, alive
from lpsync.cluster import Cluster, existing

BOUND = 5.0  # the bound: every daemon exits within 5 s of SIGTERM


@dataclass
class Point:
    nodes: int
    transport: str
    busy: bool
    exits: list[Exit]
    leftover: list[str]  # namespaces or processes still there after the teardown

    @property
    def worst(self) -> float:
        return max(e.seconds for e in self.exits)

    def ok(self, bound: float = BOUND) -> bool:
        return not self.leftover and all(e.clean and e.seconds <= bound for e in self.exits)

    def row(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "transport": self.transport,
            "state": "mid-collective" if self.busy else "idle",
            "max_exit_s": round(self.worst, 2),
            "median_exit_s": round(sorted(e.seconds for e in self.exits)[len(self.exits) // 2], 2),
            "unclean": [
                f"node {e.node}: code {e.code}, shm {e.shm}, sockets {e.sockets}"
                for e in self.exits
                if not e.clean
            ],
            "leftover": self.leftover,
        }


def measure(nodes: int, transport: str, busy: bool, prefix: str | None = None) -> Point:
    """One point: build, start, (load,) SIGTERM all, check, tear down."""
    prefix = prefix or f"lpx{os.getpid() % 100000}"
    trainers: list[Trainer] = []
    with (
        tempfile.TemporaryDirectory(prefix="lpsync-exits-") as tmp,
        Cluster(nodes, 1_000_000_000, prefix=prefix) as cluster,
    ):
        net = Nodes(cluster.spec, Path(tmp), transport)
        try:
            net.start_all()
            # Both states start from meshes that are up: one job of every node completed.
            reports: queue.Queue[Any] = queue.Queue()
            trainers = [Trainer(net.socket(n), n, nodes, 1, 30.0, reports) for n in range(nodes)]
            for t in trainers:
                t.epoch(0)
            _wait_all_ok(reports, nodes, time.monotonic() + 120.0)
            if not busy:  # idle: the job has left (its trainers detached and exited)
                for t in trainers:
                    t.close_input()
                # Each finishes its collective and exits; one that had started the next
                # collective waits in it for ranks that already left (until its timeout):
                # killed after a short grace, which ends its session all the same.
                for t in trainers:
                    t.stop(grace=3.0)
            exits = net.stop_all()
        finally:
            for t in trainers:
                t.stop(grace=5.0)
            net.stop_all()
            net.reclaim()
        pids = [d.pid for d in net.daemons if d is not None] + [t.proc.pid for t in trainers]
    leftover = existing(prefix) + [f"pid {p}" for p in pids if alive(p)]
    return Point(nodes, transport, busy, exits, leftover)


def _wait_all_ok(reports: queue.Queue[Any], world: int, deadline: float) -> None:
    done: set[int] = set()
    while len(done) < world:
        report = reports.get(timeout=max(0.1, deadline - time.monotonic()))  # queue.Empty: too slow
        if report["outcome"] == "ok":
            done.add(report["rank"])
        elif report["outcome"] == "wrong":
            raise AssertionError(f"a wrong result delivered as OK: {report}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.exits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="2,5", help="node counts, comma-separated (default 2,5)")
    parser.add_argument("--transport", default="tcp,ucx", help="peer transports (default tcp,ucx)")
    parser.add_argument("--state", default="idle,busy", help="idle, busy or both (default both)")
    parser.add_argument("--bound", type=float, default=BOUND, help=f"seconds allowed (default {BOUND:g})")
    parser.add_argument("--json", action="store_true", help="one JSON object per point")
    args = parser.parse_args(argv)
    failed = False
    if not args.json:
        print(f"{'nodes':>5} {'transport':>9} {'state':>14} {'max s':>6} {'median s':>8}  clean")
    for nodes in (int(n) for n in args.nodes.split(",")):
        for transport in args.transport.split(","):
            for state in args.state.split(","):
                point = measure(nodes, transport, state == "busy")
                row = point.row()
                failed |= not point.ok(args.bound)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    clean = (
                        "yes"
                        if not row["unclean"] and not row["leftover"]
                        else "; ".join(row["unclean"] + row["leftover"])
                    )
                    print(
                        f"{nodes:>5} {transport:>9} {row['state']:>14} {row['max_exit_s']:>6.2f} "
                        f"{row['median_exit_s']:>8.2f}  {clean}",
                        flush=True,
                    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
