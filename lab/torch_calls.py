"""Small torch.distributed calls on the ``lpsync`` backend beside gloo, in one run.

``--procs`` rank processes with torchrun's environment on one daemon (started here), each
with the default group on lpsync and a gloo group over the same ranks, run ``--iters``
synchronous calls of ``--op`` (``dist.all_reduce`` by default) on ``--bytes`` (float32,
each rank's share) on each, in ``--rounds`` rounds that alternate lpsync and gloo (a
noisy machine disturbs both alike), and a third engine, "client": the same op by the
lpsync group's own Client on shared-memory arrays (its armed call with no backend above
it). Prints the median over rounds of the slowest rank's time per call and the mean
rank's CPU per call, lpsync / gloo, and lpsync - client (what the backend adds). What a framework's
small synchronous op costs through the backend: the tensor staged into shared memory,
the collective, the work torch waits for.

    python -m lab.torch_calls --procs 2 --iters 2000 [--bytes 4] [--rounds 5] \
        [--op all_reduce|broadcast|all_gather|reduce_scatter|barrier] [--profile FILE] [--status]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lab.ranks import spawn_ranks, torchrun_env
from lpsync.demo.local_cluster import DemoError, LocalCluster
from lpsync.transport.ports import free_ports

# "client": the same op by the lpsync group's own Client on arrays in its shared memory
# (the armed call with no backend above it): what the backend adds is lpsync - client.
ENGINES = ("lpsync", "gloo", "client")
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")  # torch's *_tensor forms


def _call(op: str, t: Any, procs: int) -> Callable[[Any], object]:
    """One synchronous ``op`` on ``t`` (each rank's share) in a group; its buffers made once."""
    import torch
    import torch.distributed as dist

    if op == "barrier":  # no tensor: --bytes does not apply
        return lambda group: dist.barrier(group=group)
    if op == "broadcast":
        return lambda group: dist.broadcast(t, src=0, group=group)
    if op == "all_gather":
        every = torch.empty(procs * t.numel())
        return lambda group: dist.all_gather_into_tensor(every, t, group=group)
    if op == "reduce_scatter":
        every = torch.ones(procs * t.numel())
        return lambda group: dist.reduce_scatter_tensor(t, every, group=group)
    return lambda group: dist.all_reduce(t, group=group)


def _client_call(op: str, client: Any, numel: int, procs: int) -> Callable[[Any], object]:
    """``op`` by ``client`` itself on shared-memory arrays made once (the group is ignored)."""
    if op == "barrier":
        return lambda group: client.barrier()
    x = client.empty(numel, "float32")
    x[:] = 1
    if op == "broadcast":
        return lambda group: client.broadcast(x, root=0)
    if op == "all_gather":
        every = client.empty(procs * numel, "float32")
        return lambda group: client.allgather(x, out=every)
    if op == "reduce_scatter":
        every = client.empty(procs * numel, "float32")
        every[:] = 1
        return lambda group: client.reduce_scatter(every, out=x)
    return lambda group: client.allreduce(x)


def _profiler(path: str) -> Any:
    """A cProfile.Profile for rank 0's timed lpsync calls when ``path`` is set (its times
    are inflated by the profiler: compare functions, not totals)."""
    if not path:
        return None
    import cProfile

    return cProfile.Profile()


def _group_client(group: Any) -> Any:
    """The lpsync Client of ``group`` (the default group: the ProcessGroupLpsync itself)."""
    return group.client


def _paths(group: Any) -> str:
    """The daemon's word on this job's path (``lpsync status``: native, armed, answered)."""
    client = _group_client(group)
    return "; ".join(
        f"{j.job}: path {j.path!r}, {j.armed_plans} armed, {j.native_answered} answered by the engine "
        f"({j.native_fallbacks} sent back)"
        for j in client.status().jobs
        if j.job == client.job
    )


def _rank(rank: int, procs: int, socket: str, port: int, args: argparse.Namespace, out: mp.Queue) -> None:
    torchrun_env(rank, procs, port, socket, f"torch-calls-{port}")
    try:
        import torch
        import torch.distributed as dist

        import lpsync_client.torch  # noqa: F401 - registers "lpsync"

        torch.set_num_threads(1)
        dist.init_process_group("lpsync")
        groups = {"lpsync": None, "gloo": dist.new_group(backend="gloo"), "client": None}
        numel = max(1, args.bytes // 4)
        torch_call = _call(args.op, torch.ones(numel), procs)
        calls = {
            "lpsync": torch_call,
            "gloo": torch_call,
            "client": _client_call(args.op, _group_client(dist.group.WORLD), numel, procs),
        }
        rounds: dict[str, list[tuple[float, float]]] = {e: [] for e in ENGINES}
        profile = _profiler(args.profile if rank == 0 else "")
        for _ in range(args.rounds):
            for engine in ENGINES:
                group, call = groups[engine], calls[engine]
                for _ in range(args.warmup):
                    call(group)
                dist.barrier(group=groups["gloo"])
                if profile is not None and engine == "lpsync":
                    profile.enable()
                cpu, start = time.process_time(), time.perf_counter()
                for _ in range(args.iters):
                    call(group)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                if profile is not None:
                    profile.disable()
                rounds[engine].append((seconds / args.iters, cpu / args.iters))
        if profile is not None:
            profile.dump_stats(args.profile)
        if args.status and rank == 0:
            print(_paths(dist.group.WORLD), file=sys.stderr)
        dist.destroy_process_group()
        out.put((rank, rounds, ""))
    except Exception as error:  # reported, not lost with the process
        out.put((rank, {}, f"{type(error).__name__}: {error}"))


def measure(args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    """Per engine and round: the slowest rank's seconds per call, the mean rank's CPU."""
    with tempfile.TemporaryDirectory(prefix="lpsync-torch-calls-") as where:
        cluster = LocalCluster(Path(where), 1)
        try:
            (port,) = free_ports(1)
            socket = cluster.nodes[0].socket
            results = spawn_ranks(
                _rank,
                [(r, args.procs, socket, port, args) for r in range(args.procs)],
                300 + args.rounds * args.iters * 0.01,
            )
        finally:
            cluster.stop()
    failed = [f"rank {r}: {error}" for r, _, error in results if error]
    if failed:
        raise DemoError("; ".join(failed))
    per_rank = [rounds for _, rounds, _ in results]
    return {
        engine: [
            (max(r[engine][i][0] for r in per_rank), statistics.mean(r[engine][i][1] for r in per_rank))
            for i in range(args.rounds)
        ]
        for engine in ENGINES
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.torch_calls", description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2, help="rank processes (default 2)")
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per round and engine")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, alternating lpsync and gloo")
    parser.add_argument("--warmup", type=int, default=200, help="untimed calls before each round")
    parser.add_argument(
        "--bytes", type=int, default=4, help="each rank's tensor in bytes, float32 (default 4)"
    )
    parser.add_argument(
        "--profile", default="", help="rank 0's timed lpsync calls under cProfile, into this file"
    )
    parser.add_argument("--status", action="store_true", help="rank 0 prints the daemon's status at the end")
    parser.add_argument("--op", choices=OPS, default="all_reduce", help="the call (default all_reduce)")
    args = parser.parse_args(argv)
    if args.procs < 2 or args.iters < 1 or args.rounds < 1 or args.warmup < 0 or args.bytes < 4:
        parser.error("--procs must be >= 2, --iters and --rounds >= 1, --warmup >= 0, --bytes >= 4")
    try:
        rounds = measure(args)
    except DemoError as error:
        print(f"torch_calls: {error}", file=sys.stderr)
        return 1
    size = "" if args.op == "barrier" else f" of {args.bytes} B a rank"
    print(
        f"# {args.procs} ranks on one daemon, synchronous dist.{args.op}{size}, "
        f"{args.rounds} rounds of {args.iters} calls; medians over rounds"
    )
    print("# engine   time/call (us)  rank CPU/call (us)")
    median = {e: [statistics.median(v[i] for v in rounds[e]) for i in (0, 1)] for e in ENGINES}
    for engine in ENGINES:
        print(f"{engine:8s} {median[engine][0] * 1e6:15.0f} {median[engine][1] * 1e6:19.0f}")
    ratios = [
        statistics.median(a[i] / b[i] for a, b in zip(rounds["lpsync"], rounds["gloo"], strict=True))
        for i in (0, 1)
    ]
    print(f"# lpsync / gloo (median of rounds): time {ratios[0]:.2f}x, CPU {ratios[1]:.2f}x")
    added = [
        statistics.median(a[i] - c[i] for a, c in zip(rounds["lpsync"], rounds["client"], strict=True))
        for i in (0, 1)
    ]
    print(
        f"# lpsync - client (the backend's own share, median of rounds): time {added[0] * 1e6:.0f} us, "
        f"CPU {added[1] * 1e6:.0f} us"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
