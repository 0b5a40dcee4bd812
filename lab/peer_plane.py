"""Peer-plane benchmark: schedules over the UCX endpoint, one process per emulated node.

The coordinator builds a Cluster (namespaces, tbf-shaped links), starts one ``node``
process in each namespace with UCX forced onto TCP (so every byte crosses the shaped
links) and the cluster secret in LPSYNC_SECRET, and prints, per (op, algorithm),
the median over reps of the slowest node's time beside the wire limit (bytes / link
rate). The cluster is always torn down. Setup, run and verify are separate steps:
each node checks its result against numpy after the timed reps.

    python -m lab.peer_plane --nodes 4 --link 1gbit --op broadcast \\
        --algorithm lp,be,mst --bytes 64MiB --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from lpsync.algorithms import LinkModel, generate
from lpsync.algorithms.tuner import chunks_for
from lpsync.units import format_size, parse_size

_PORT = 13337
_ALPHA = 100e-6  # a TCP message through a namespace's stack, for LP's chunk count


def node_main(args: argparse.Namespace) -> int:
    from lpsync.engine.executor import Plan
    from lpsync.reduction import Reduction
    from lpsync.transport.addresses import parse_peers
    from lpsync.transport.auth import load_secret
    from lpsync.transport.ucx import UcxEndpoint, UcxOptions
    from lpsync.types import Collective, ReduceOp

    peers = tuple(parse_peers(args.peers))
    p, rank, dtype = len(peers), args.rank, np.dtype(np.float32)
    count = args.bytes // dtype.itemsize
    link = LinkModel.from_bandwidth(_ALPHA, args.rate_bits / 8)
    options = UcxOptions(rank, peers, load_secret(None), tls=args.tls or None, connect_timeout=60)
    rows = []
    with UcxEndpoint.connect(options) as endpoint:
        barrier = Plan(
            generate(Collective.ALLREDUCE, "ring", p, p),
            rank,
            (np.zeros(p, dtype), np.zeros(p, dtype)),
            Reduction(ReduceOp.SUM, dtype, p),
        )
        tag = 0
        for op_name in args.op.split(","):
            op = Collective(op_name)
            for algorithm in args.algorithm.split(","):
                chunks = args.chunks or chunks_for(algorithm, p, args.bytes, link, op=op)
                schedule = generate(op, algorithm, p, count, 0, chunks)
                inp = np.full(schedule.in_elements(rank), rank + 1, dtype)
                out = np.zeros(schedule.out_elements(rank), dtype)
                plan = Plan(schedule, rank, (inp, out), Reduction(ReduceOp.SUM, dtype, p))
                times = []
                cpu_before = _cpu_seconds()
                for _ in range(args.reps):
                    barrier.run(endpoint, time.monotonic() + 60, tag_base=(tag := tag + 1) << 32)
                    start = time.perf_counter()
                    plan.run(endpoint, time.monotonic() + 300, tag_base=(tag := tag + 1) << 32)
                    times.append(time.perf_counter() - start)
                want = {
                    Collective.BROADCAST: 1.0,
                    Collective.ALLREDUCE: p * (p + 1) / 2,
                    Collective.REDUCE: p * (p + 1) / 2 if rank == 0 else None,
                }.get(op)
                wrong = 0 if want is None else int(np.count_nonzero(out != want))
                rows.append(
                    {
                        "op": op_name,
                        "algorithm": algorithm,
                        "chunks": chunks,
                        "times": times,
                        "wrong": wrong,
                        "cpu": (_cpu_seconds() - cpu_before) / args.reps,
                    }
                )
    print(json.dumps({"rank": rank, "rows": rows}), flush=True)
    return 0


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def coordinate(args: argparse.Namespace) -> int:
    from lpsync.cluster import Cluster, parse_rate

    rate_bits = parse_rate(args.link)
    env = {**os.environ, "LPSYNC_SECRET": secrets.token_hex(16)}
    with Cluster(args.nodes, rate_bits, prefix=args.prefix) as cluster:
        peers = ",".join(f"{cluster.address(i)}:{_PORT}" for i in range(args.nodes))
        procs = [
            cluster.run_in(
                i,
                [
                    sys.executable,
                    "-m",
                    "lab.peer_plane",
                    "node",
                    "--rank",
                    str(i),
                    "--peers",
                    peers,
                    "--op",
                    args.op,
                    "--algorithm",
                    args.algorithm,
                    "--bytes",
                    str(args.bytes),
                    "--reps",
                    str(args.reps),
                    "--rate-bits",
                    str(rate_bits),
                    "--chunks",
                    str(args.chunks),
                ],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for i in range(args.nodes)
        ]
        reports = []
        for proc in procs:
            out, _ = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                print(f"node failed with exit code {proc.returncode}", file=sys.stderr)
                return 1
            reports.append(json.loads(out.strip().splitlines()[-1]))
    wire = args.bytes / (rate_bits / 8)
    for index, row in enumerate(reports[0]["rows"]):
        slowest = [max(r["rows"][index]["times"][rep] for r in reports) for rep in range(args.reps)]
        seconds = statistics.median(slowest)
        result: dict[str, Any] = {
            "op": row["op"],
            "algorithm": row["algorithm"],
            "nodes": args.nodes,
            "bytes": args.bytes,
            "chunks": row["chunks"],
            "seconds": seconds,
            "wire_seconds": wire,
            "x_wire": seconds / wire,
            # CPU of all node processes per op (barrier included): against the host's
            # cores x seconds, it says whether the run was CPU-bound.
            "cpu_seconds": sum(r["rows"][index]["cpu"] for r in reports),
            "wrong": sum(r["rows"][index]["wrong"] for r in reports),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{row['op']:<10} {row['algorithm']:<5} nodes={args.nodes} "
                f"{format_size(args.bytes):>7} chunks={row['chunks']:<4} {seconds:8.3f} s  "
                f"wire {wire:.3f} s  x{seconds / wire:5.2f}  cpu {result['cpu_seconds']:.2f} s  "
                f"wrong={result['wrong']}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.peer_plane", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--op", default="broadcast")
    parser.add_argument("--algorithm", default="lp,be,mst")
    parser.add_argument("--bytes", type=parse_size, default=parse_size("16MiB"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefix", default="lpbench")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--chunks", type=int, default=0, help="LP chunk count (default 0: the tuner's k* for the link)"
    )
    parser.add_argument("--json", action="store_true")
    sub = parser.add_subparsers(dest="role")
    node = sub.add_parser("node", help="(internal) one node's process")
    node.add_argument("--rank", type=int, required=True)
    node.add_argument("--peers", required=True)
    node.add_argument("--op", required=True)
    node.add_argument("--algorithm", required=True)
    node.add_argument("--bytes", type=parse_size, required=True)
    node.add_argument("--reps", type=int, required=True)
    node.add_argument("--rate-bits", type=int, required=True, help="link rate, for LP's chunk count only")
    node.add_argument("--chunks", type=int, default=0)
    node.add_argument(
        "--tls", default="tcp", help="UCX_TLS for the peer plane (default tcp; '' lets UCX choose, e.g. RDMA)"
    )
    args = parser.parse_args(argv)
    return node_main(args) if args.role == "node" else coordinate(args)


if __name__ == "__main__":
    sys.exit(main())
