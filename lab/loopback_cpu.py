"""CPU per collective of the daemons and the ranks, on this machine alone.

``--nodes`` daemons joined over loopback (the peer plane as on a cluster, no emulated
network), one rank each, run ``--iters`` blocking allreduces of ``--bytes`` back to back;
each rank reads its own CPU clock and its daemon's (every thread, lpsync.bench.cpu)
around the loop, and both processes' context switches (each a sleep and a wake-up).
``--nodes 1`` is the single-node path: what the control plane costs by itself. Quicker
to rerun than ``lpsync bench --cluster`` (no root, no namespaces), for A/B runs of a
change; the emulated network and gloo beside it are ``--cluster``'s.

    python -m lab.loopback_cpu --nodes 3 --iters 3000 [--bytes 4] [--peer-transport tcp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import astuple, dataclass
from pathlib import Path

from lab.ranks import spawn_ranks
from lpsync.bench.cpu import CpuMeter
from lpsync.demo.local_cluster import DemoError, LocalCluster

_WARMUP = 200


@dataclass(frozen=True)
class Calls:
    """One node's timed loop, in total or per call: wall seconds, the daemon's and the
    rank's CPU seconds, and their context switches."""

    seconds: float
    daemon_cpu: float
    rank_cpu: float
    daemon_switches: float
    rank_switches: float

    def per_call(self, iters: int) -> Calls:
        return Calls(*(value / iters for value in astuple(self)))


def _rank(rank: int, nodes: int, socket: str, daemon: int, nbytes: int, iters: int, out: mp.Queue) -> None:
    import lpsync_client

    try:
        with lpsync_client.connect(
            socket, job="loopback-cpu", rank=rank, world_size=nodes, local_rank=0, local_world_size=1
        ) as client:
            x = client.zeros(max(1, nbytes // 4), "float32")
            for _ in range(_WARMUP):
                client.allreduce(x)
            client.barrier()
            meter = CpuMeter(daemon)
            before, start = meter.read(), time.perf_counter()
            for _ in range(iters):
                x[:] = 1
                client.allreduce(x)
            seconds, after = time.perf_counter() - start, meter.read()
            if not (x == nodes).all():
                raise AssertionError(f"rank {rank}: the sum is wrong ({x[:4]})")
            client.barrier()
        mine, theirs, _, my_switches, their_switches = (a - b for a, b in zip(after, before, strict=True))
        calls = Calls(seconds, theirs, mine, their_switches, my_switches)
        out.put((rank, calls.per_call(iters), ""))
    except Exception as error:  # reported, not lost with the process
        out.put((rank, Calls(0.0, 0.0, 0.0, 0, 0), f"{type(error).__name__}: {error}"))


def measure(nodes: int, nbytes: int, iters: int, transport: str) -> list[Calls]:
    """Per node: seconds, the daemon's and the rank's CPU seconds and context switches,
    per call."""
    with tempfile.TemporaryDirectory(prefix="lpsync-cpu-") as where:
        cluster = LocalCluster(Path(where), nodes, ("--peer-transport", transport))
        try:
            each = [(r, nodes, n.socket, n.daemon.pid, nbytes, iters) for r, n in enumerate(cluster.nodes)]
            results = spawn_ranks(_rank, each, 600 + iters * 0.05)
        finally:
            cluster.stop()
    failed = [f"rank {r}: {error}" for r, _, error in results if error]
    if failed:
        raise DemoError("; ".join(failed))
    return [calls for _, calls, _ in results]


def add_point_arguments(parser: argparse.ArgumentParser, nodes: int, iters: int) -> None:
    """The point this bench measures, as its flags (lab.daemon_ab passes them on)."""
    parser.add_argument(
        "--nodes", type=int, default=nodes, help=f"daemons on loopback, one rank each (default {nodes})"
    )
    parser.add_argument("--iters", type=int, default=iters, help=f"timed allreduces (default {iters})")
    parser.add_argument("--bytes", type=int, default=4, help="message size in bytes, float32 (default 4)")
    parser.add_argument("--peer-transport", default="tcp", choices=("tcp", "ucx"), help="default tcp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.loopback_cpu", description=__doc__.split("\n\n")[0])
    add_point_arguments(parser, nodes=3, iters=3000)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.iters < 1 or args.bytes < 4:
        parser.error("--nodes and --iters must be >= 1, --bytes >= 4")
    try:
        rows = measure(args.nodes, args.bytes, args.iters, args.peer_transport)
    except DemoError as error:
        print(f"loopback_cpu: {error}", file=sys.stderr)
        return 1
    print(f"# {args.nodes} daemon(s) on loopback, one rank each, {args.iters} allreduces of {args.bytes} B")
    print(
        "# node  time/call (us)  daemon CPU/call (us)  rank CPU/call (us)  daemon switches/call"
        "  rank switches/call"
    )
    for node, r in enumerate(rows):
        print(
            f"{node:6d} {r.seconds * 1e6:15.0f} {r.daemon_cpu * 1e6:21.0f} {r.rank_cpu * 1e6:19.0f} "
            f"{r.daemon_switches:21.1f} {r.rank_switches:19.1f}"
        )
    daemon, rank = statistics.mean(r.daemon_cpu for r in rows), statistics.mean(r.rank_cpu for r in rows)
    switches = statistics.mean(r.daemon_switches for r in rows)
    print(
        f"# mean per daemon {daemon * 1e6:.0f} us, per rank {rank * 1e6:.0f} us; "
        f"{switches:.1f} context switches per daemon and call"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
