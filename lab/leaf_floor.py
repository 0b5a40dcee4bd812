"""The floor under a small cross-node collective in Python: its system calls and
wake-ups alone, beside lpsync's daemons doing the same collective, in one run.

A bare imitation of the agreement tree's messages, with no logic: a root and ``--nodes
- 1`` leaves on loopback TCP, one rank per leaf on a SEQPACKET socket. A rank sends a
4-byte request and blocks for the reply. Its leaf's trigger thread wakes in ``select``,
reads the request and sends a summary to the root; the leaf's reader thread wakes on the
verdict and replies to the rank. The root has one reader thread per leaf, as node 0 has
one per peer; the thread that receives the last summary of a call sends every verdict.
These are the system calls and wake-ups of a leaf (2 per call) and of node 0 (one per
child, and the sends) in lpsync's riding path; what lpsync spends above them is its
Python logic (checks, matching, agreement, flight recorder, metrics). The rank's floor is
one send and one blocking receive of a few bytes; lpsync's rank runs the client's
blocking ``allreduce`` (request built, reply parsed).

Then ``lab.loopback_cpu`` runs the same shape through real daemons (node 0 with
a rank of its own besides), and the ratios are printed.

    python -m lab.leaf_floor --nodes 8 --iters 5000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import select
import socket
import statistics
import struct
import sys
import threading
import time
from dataclasses import dataclass

from lab.loopback_cpu import measure as measure_daemons
from lpsync.bench.cpu import CpuMeter, cpu_seconds
from lpsync.demo.local_cluster import DemoError

_MESSAGE = struct.Struct("<Q")  # a call's sequence number: the summary, the verdict
_WARMUP = 200


@dataclass(frozen=True)
class Floor:
    """One leaf's timed calls, per call: wall seconds, the leaf's and the rank's CPU
    seconds, the leaf's context switches, and the root's CPU seconds over the same calls."""

    seconds: float
    leaf_cpu: float
    rank_cpu: float
    leaf_switches: float
    root_cpu: float


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            raise ConnectionError("the peer closed")
        data += part
    return data


def _root(listener: socket.socket, leaves: int) -> None:
    """Accept every leaf; per call, the thread that reads the last summary sends every
    verdict."""
    conns = [listener.accept()[0] for _ in range(leaves)]
    for conn in conns:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    lock = threading.Lock()
    arrived: dict[int, int] = {}

    def read(conn: socket.socket) -> None:
        try:
            while True:
                (sequence,) = _MESSAGE.unpack(_recv_exactly(conn, _MESSAGE.size))
                with lock:
                    arrived[sequence] = arrived.get(sequence, 0) + 1
                    last = arrived[sequence] == leaves
                    if last:
                        del arrived[sequence]
                if last:
                    verdict = _MESSAGE.pack(sequence)
                    for out in conns:
                        out.sendall(verdict)
        except (ConnectionError, OSError):
            return

    threads = [threading.Thread(target=read, args=(conn,), daemon=True) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _leaf(trigger: socket.socket, port: int) -> None:
    """The trigger thread reads a request and sends the summary; the reader thread
    replies to the rank when the verdict comes."""
    up = socket.create_connection(("127.0.0.1", port))
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def read_verdicts() -> None:
        expected = 0
        try:
            while True:
                expected += 1
                (sequence,) = _MESSAGE.unpack(_recv_exactly(up, _MESSAGE.size))
                trigger.send(b"done" if sequence == expected else b"wrong")
        except (ConnectionError, OSError):
            return

    reader = threading.Thread(target=read_verdicts, daemon=True)
    reader.start()
    sequence = 0
    while True:
        select.select([trigger], [], [])  # the daemon's trigger thread waits on many sockets
        if not trigger.recv(64):
            break
        sequence += 1
        up.sendall(_MESSAGE.pack(sequence))
    up.close()
    reader.join(5)


def _call(trigger: socket.socket) -> None:
    trigger.send(b"call")
    if trigger.recv(64) != b"done":
        raise RuntimeError("a verdict came out of order")


def _rank(trigger: socket.socket, leaf: int, root: int, iters: int, out: mp.Queue) -> None:
    try:
        for _ in range(_WARMUP):
            _call(trigger)
        meter = CpuMeter(leaf)
        before, root_before, start = meter.read(), cpu_seconds(root), time.perf_counter()
        for _ in range(iters):
            _call(trigger)
        seconds, after, root_cpu = time.perf_counter() - start, meter.read(), cpu_seconds(root) - root_before
        mine, theirs, _, _, their_switches = (a - b for a, b in zip(after, before, strict=True))
        out.put(
            Floor(seconds / iters, theirs / iters, mine / iters, their_switches / iters, root_cpu / iters)
        )
    except Exception as error:  # reported, not lost with the process
        out.put(f"{type(error).__name__}: {error}")
    finally:
        trigger.close()


def measure_floor(nodes: int, iters: int) -> list[Floor]:
    """Per leaf, what its rank measured (the root's CPU over the same calls)."""
    ctx = mp.get_context("fork")  # no threads yet: the sockets are inherited
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    root = ctx.Process(target=_root, args=(listener, nodes - 1), daemon=True)
    root.start()
    out: mp.Queue = ctx.Queue()
    processes = []
    for _ in range(nodes - 1):
        rank_end, leaf_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        leaf = ctx.Process(target=_leaf, args=(leaf_end, port), daemon=True)
        leaf.start()
        leaf_end.close()
        rank = ctx.Process(target=_rank, args=(rank_end, leaf.pid, root.pid, iters, out), daemon=True)
        rank.start()
        rank_end.close()
        processes += [leaf, rank]
    listener.close()
    rows = [out.get(timeout=120 + iters * 0.01) for _ in range(nodes - 1)]
    for process in processes:
        process.join(10)
    root.terminate()
    root.join(10)
    failed = [row for row in rows if isinstance(row, str)]
    if failed:
        raise DemoError("; ".join(failed))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.leaf_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=8, help="root and leaves (default 8)")
    parser.add_argument("--iters", type=int, default=5000, help="timed calls (default 5000)")
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.iters < 1:
        parser.error("--nodes must be >= 2, --iters >= 1")
    try:
        rows = measure_floor(args.nodes, args.iters)
    except DemoError as error:
        print(f"leaf_floor: the floor: {error}", file=sys.stderr)
        return 1
    floor_leaf = statistics.median(r.leaf_cpu for r in rows)
    root_cpu = statistics.median(r.root_cpu for r in rows)
    try:
        daemons = measure_daemons(args.nodes, 4, args.iters, "tcp")
    except DemoError as error:
        print(f"leaf_floor: {error}", file=sys.stderr)
        return 1
    lpsync_leaf = statistics.median(r.daemon_cpu for r in daemons[1:])
    floor_time = statistics.median(r.seconds for r in rows)
    floor_switches = statistics.median(r.leaf_switches for r in rows)
    floor_rank = statistics.median(r.rank_cpu for r in rows)
    lpsync_rank = statistics.median(r.rank_cpu for r in daemons[1:])
    lpsync_time = statistics.median(r.seconds for r in daemons)
    lpsync_switches = statistics.median(r.daemon_switches for r in daemons[1:])
    node0 = daemons[0].daemon_cpu
    print(f"# {args.nodes} nodes on loopback (a root and {args.nodes - 1} leaves), {args.iters} calls of 4 B")
    print(
        "#               time/call (us)  leaf CPU/call (us)  root CPU/call (us)  rank CPU/call (us)"
        "  leaf switches/call"
    )
    for name, seconds, leaf, root, rank, switches in (
        ("floor ", floor_time, floor_leaf, root_cpu, floor_rank, floor_switches),
        ("lpsync", lpsync_time, lpsync_leaf, node0, lpsync_rank, lpsync_switches),
    ):
        print(
            f"  {name} {seconds * 1e6:21.0f} {leaf * 1e6:19.0f} {root * 1e6:19.0f} {rank * 1e6:19.0f}"
            f" {switches:19.1f}"
        )
    print(
        f"# lpsync / floor: leaf {lpsync_leaf / floor_leaf:.2f}, root {node0 / root_cpu:.2f}, "
        f"rank {lpsync_rank / floor_rank:.2f}, time {lpsync_time / floor_time:.2f} "
        "(medians over the leaves and their ranks; lpsync's node 0 also serves a rank)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
