"""CPU per chunk of a pipeline over the TCP peer transport, as data flow and not, in one run.

``--ranks`` processes on loopback form a TcpEndpoint mesh and run ``--op``: an LP
broadcast of ``--bytes`` from rank 0 through every other, or a ring allreduce, at each
chunk count of ``--chunks``, as data flow (lpsync.engine.dataflow: each chunk received,
reduced and sent on by the connection's reader) and sequentially (the endpoint without
channels: each chunk waited for by the collective's own thread, then reduced and sent
on), alternating, ``--reps`` calls each after a barrier. Each rank reads its own CPU
clock (every thread) around each call. Prints the median CPU per call of the root (rank
0), the middle ranks and the last rank, and flow on / off, then checks every rank's
buffer against numpy. No emulated network: what a chunk costs in the processes, not on a
shaped link (``lpsync bench --cluster`` is that).

    python -m lab.pass_through --ranks 3 --bytes 64MiB --chunks 186,744 --reps 20
    python -m lab.pass_through --op allreduce --ranks 3 --bytes 64MiB --chunks 8,17
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from contextlib import AbstractContextManager
from typing import Any, cast

import numpy as np

from lpsync.algorithms import generate
from lpsync.transport.ports import free_ports
from lpsync.types import Collective, ReduceOp
from lpsync.units import format_size, parse_size

_SECRET = b"lpsync pass-through bench"


class _Sequential:
    """The endpoint without ``channel``: the executor runs the program in order."""

    def __init__(self, endpoint: Any) -> None:
        self._endpoint = endpoint
        self.rank, self.size = endpoint.rank, endpoint.size

    def send(self, peer: int, tag: int, data: np.ndarray) -> Any:
        return self._endpoint.send(peer, tag, data)

    def recv_into(self, peer: int, tag: int, out: np.ndarray, deadline: float) -> None:
        self._endpoint.recv_into(peer, tag, out, deadline)

    def post_recv(self, peer: int, tag: int, out: np.ndarray) -> Any:
        return self._endpoint.post_recv(peer, tag, out)

    def recv_borrow(
        self, peer: int, tag: int, nbytes: int, deadline: float
    ) -> AbstractContextManager[np.ndarray]:
        return self._endpoint.recv_borrow(peer, tag, nbytes, deadline)

    def abort(self, error: BaseException) -> None:
        self._endpoint.abort(error)


def _rank(rank: int, ports: list[int], args: argparse.Namespace, out: mp.Queue) -> None:
    from lpsync.engine.executor import Plan
    from lpsync.reduction import Reduction
    from lpsync.transport.addresses import PeerAddress
    from lpsync.transport.mesh import MeshOptions
    from lpsync.transport.tcp import TcpEndpoint

    try:
        peers = tuple(PeerAddress("127.0.0.1", port) for port in ports)
        endpoint = TcpEndpoint.connect(MeshOptions(rank, peers, _SECRET, connect_timeout=30.0))
        plain = _Sequential(endpoint)
        p, count = args.ranks, args.bytes // 4
        one = (np.ones(1, np.float32), np.ones(1, np.float32))
        barrier = Plan(
            generate(Collective.ALLREDUCE, "be", p, 1, 0, 1),
            rank,
            one,
            Reduction(ReduceOp.SUM, np.dtype(np.float32), p),
        )
        cpu: dict[tuple[int, bool], list[float]]
        tag, cpu, wrong = 0, {}, 0
        op, algorithm = (
            (Collective.BROADCAST, "lp") if args.op == "broadcast" else (Collective.ALLREDUCE, "ring")
        )
        reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), p)
        for chunks in args.chunks:
            schedule = generate(op, algorithm, p, count, 0, chunks)
            data = np.zeros(count, np.float32)
            plan = Plan(schedule, rank, (data, data), reduction)
            for flow in (True, False) * args.reps:
                data[:], want = _inputs(op, p, rank, count, tag)
                barrier.run(endpoint, time.monotonic() + 60, tag_base=(tag := tag + 1) << 32)
                before = time.process_time()
                plan.run(endpoint if flow else plain, time.monotonic() + 120, tag_base=(tag := tag + 1) << 32)
                cpu.setdefault((chunks, flow), []).append(time.process_time() - before)
                wrong += int(np.count_nonzero(data != want))
        endpoint.close()
        out.put((rank, {k: statistics.median(v) for k, v in cpu.items()}, wrong, None))
    except BaseException as error:  # reported by the parent
        out.put((rank, {}, 0, f"{type(error).__name__}: {error}"))


def _inputs(op: Collective, p: int, rank: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """This rank's input and the result every rank must end with (small whole numbers,
    so that a sum in any order is exact)."""
    if op is Collective.BROADCAST:
        want = np.random.default_rng(seed).random(count, np.float32)
        return (want if rank == 0 else np.zeros(count, np.float32)), want
    parts = [np.random.default_rng((seed, r)).integers(0, 100, count).astype(np.float32) for r in range(p)]
    return parts[rank], cast(np.ndarray, np.sum(parts, axis=0, dtype=np.float32))  # axis=0: an array


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.pass_through",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--op",
        choices=("broadcast", "allreduce"),
        default="broadcast",
        help="an LP broadcast (default) or a ring allreduce",
    )
    parser.add_argument("--ranks", type=int, default=3, help="processes, 3 or more (default 3)")
    parser.add_argument(
        "--bytes", type=parse_size, default=parse_size("64MiB"), help="message size (default 64MiB)"
    )
    parser.add_argument("--chunks", default="186,744", help="chunk counts, comma-separated (default 186,744)")
    parser.add_argument("--reps", type=int, default=20, help="calls per chunk count and mode (default 20)")
    args = parser.parse_args(argv)
    try:
        args.chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        parser.error(f"--chunks takes whole numbers, got {args.chunks!r}")
    if args.ranks < 3 or args.reps < 1 or any(c < 1 for c in args.chunks) or args.bytes < 4:
        parser.error("--ranks must be 3 or more, --reps and every chunk count 1 or more, --bytes 4 or more")
    ports = free_ports(args.ranks)
    queue: mp.Queue = mp.get_context("spawn").Queue()
    procs = [
        mp.get_context("spawn").Process(target=_rank, args=(r, ports, args, queue)) for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    got = {}
    try:
        for _ in procs:
            rank, cpu, wrong, error = queue.get(timeout=600)
            if error is not None:
                print(f"rank {rank} failed: {error}", file=sys.stderr)
                return 1
            got[rank] = (cpu, wrong)
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    last = args.ranks - 1
    what = "LP broadcast" if args.op == "broadcast" else "ring allreduce"
    print(
        f"# {what} of {format_size(args.bytes)} over TCP on loopback, {args.ranks} ranks, "
        f"median CPU ms per call of {args.reps}; middle = mean of ranks 1..{last - 1}; "
        "on/off = data flow on / off (sequential)"
    )
    print(f"#{'chunks':>7} {'flow':>6} | {'root':>8} {'middle':>8} {'last':>8}")
    for chunks in args.chunks:
        for flow in (True, False):
            cpu = [got[r][0][chunks, flow] * 1e3 for r in range(args.ranks)]
            root, middle, tail = cpu[0], statistics.mean(cpu[1:last]), cpu[last]
            mode = "on" if flow else "off"
            print(f" {chunks:>7} {mode:>6} | {root:>8.1f} {middle:>8.1f} {tail:>8.1f}")
        on = [got[r][0][chunks, True] for r in range(args.ranks)]
        off = [got[r][0][chunks, False] for r in range(args.ranks)]
        print(
            f" {chunks:>7} {'on/off':>6} | {on[0] / off[0]:>8.2f} "
            f"{sum(on[1:last]) / sum(off[1:last]):>8.2f} {on[last] / off[last]:>8.2f}"
        )
    wrong = sum(w for _, w in got.values())
    print(f"# wrong elements: {wrong}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
