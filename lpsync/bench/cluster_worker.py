"""One rank of ``lpsync bench --cluster``, started inside an emulated node's namespace.

It attaches to its node's daemon as torchrun would set it up (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, LPSYNC_SOCKET; the job from the plan), measures every (op, size,
algorithm) point, verifies it, and prints one JSON line per point on stdout; the
coordinator (cluster.py) takes the slowest rank per iteration. With ``--compare gloo``
it then runs torch.distributed's gloo backend (MASTER_ADDR/MASTER_PORT: node 0) on the
same ops and sizes. Every wait blocks: in the client's socket read, in gloo's, in the
barriers.

Each timed iteration is preceded by a barrier, so it measures one collective on its
own (a pipelined op's ranks finish at different moments; back to back, the next
iteration's start would absorb that skew).

CPU: every rank reads its own process's CPU seconds (all threads), and local rank 0 of
each node its daemon's (its pid from the plan), around the timed loop; then around as many
barriers alone, whose CPU the coordinator subtracts (cpu.py, docs/benchmarks.md). Local
rank 0 also sends its daemon's flight records of the timed iterations (stage times: the
fixed cost of a collective).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lpsync.algorithms.tuner import LEARNING_CALLS
from lpsync.bench.cpu import CpuMeter
from lpsync.bench.worker import (
    DTYPE,
    buffers,
    count_wrong,
    element_count,
    fill,
    gloo_call,
    gloo_tensors,
    gloo_verify,
    lpsync_call,
)

ROOT = 0  # of the rooted ops: broadcast, reduce, gather, scatter


@dataclass
class Measured:
    times: list[float]  # seconds, per timed iteration
    window: tuple[float, float]  # unix times around the timed loop (for flight records)
    # CPU seconds (rank/daemon/machine) and context switches (rank_switches,
    # daemon_switches), over the loop and over barriers alone
    cpu: dict[str, float]


def measure(
    call: Callable[[], object],
    barrier: Callable[[], object],
    warmup: int,
    iters: int,
    meter: CpuMeter | None = None,
) -> Measured:
    """``iters`` timed calls, each after a barrier, and one barrier closing the loop (a
    call's last work on other ranks' behalf may spill into the barrier after it); then the
    same ``iters + 1`` barriers alone, so that the loop's CPU minus theirs is the calls'."""
    meter = meter or CpuMeter()
    for _ in range(warmup):
        call()
    times = []
    c0, w0 = meter.read(), time.time()
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    barrier()
    w1, c1 = time.time(), meter.read()
    for _ in range(iters + 1):
        barrier()
    c2 = meter.read()
    cpu = {
        "rank": c1[0] - c0[0],
        "daemon": c1[1] - c0[1],
        "machine": c1[2] - c0[2],
        "rank_barriers": c2[0] - c1[0],
        "daemon_barriers": c2[1] - c1[1],
        "machine_barriers": c2[2] - c1[2],
        # Context switches (counts, not seconds), over the same spans.
        "rank_switches": c1[3] - c0[3],
        "daemon_switches": c1[4] - c0[4],
        "rank_switches_barriers": c2[3] - c1[3],
        "daemon_switches_barriers": c2[4] - c1[4],
    }
    return Measured(times, (w0, w1), cpu)


def _emit(**point: object) -> None:
    print(json.dumps(point), flush=True)


def _meter(args: argparse.Namespace, rank: int) -> tuple[CpuMeter, int | None]:
    """This rank's meter, with its daemon's CPU on local rank 0 of each node and the
    machine's on rank 0 (the nodes share it); the node."""
    machine = rank == 0
    if os.environ.get("LOCAL_RANK", "0") != "0" or not getattr(args, "daemon_pids", None):
        return CpuMeter(machine=machine), None
    node = rank // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return CpuMeter(args.daemon_pids[node], machine), node


def run_lpsync(args: argparse.Namespace, rank: int, world: int) -> None:
    import lpsync_client

    meter, node = _meter(args, rank)
    with lpsync_client.connect(job=args.job, timeout=args.timeout) as client:
        client.barrier()  # waits for the peer mesh; not timed
        for op in args.ops:
            for nbytes in args.sizes:
                count = element_count(op, nbytes, world, ROOT)
                # The buffer, and alltoall's out
                bufs = [client.zeros(n, DTYPE) for n in buffers(op, world, count, rank, ROOT) if n]
                for algorithm in args.algorithms[op]:
                    forced = None if algorithm == "auto" else algorithm
                    call = lpsync_call(client, op, bufs[0], forced, ROOT, bufs[1] if len(bufs) > 1 else None)
                    # auto: the daemons' first calls of a size are node 0's trials
                    # (lpsync/daemon/collectives/learning.py); time what it keeps, not the trials.
                    warmup = args.warmup + (LEARNING_CALLS if forced is None else 0)
                    got = measure(call, client.barrier, warmup, args.iters[str(nbytes)], meter)
                    records = flight_records(client, op, got.window) if node is not None else []
                    fill(op, bufs, rank, world, count, ROOT)
                    client.barrier()
                    call()
                    wrong = count_wrong(op, bufs, rank, world, count, ROOT)
                    _emit(
                        engine="lpsync",
                        op=op,
                        algorithm=algorithm,
                        bytes=nbytes,
                        count=count,
                        rank=rank,
                        times=got.times,
                        wrong=wrong,
                        cpu=got.cpu,
                        node=node,
                        records=records,
                        ran=_ran(client, op, count) if rank == 0 else "",
                    )
                for buf in bufs:
                    client.release(buf)
                del bufs, buf


def flight_records(client, op: str, window: tuple[float, float]) -> list[dict[str, Any]]:
    """This node's daemon's records of the timed iterations (those of ``op`` that started
    inside ``window``: the warmups started before it, the barriers are another op),
    oldest first: each one's sequence, total and stage times. Every one has finished: the
    loop ends with a barrier after the last."""
    job = client.job
    out = []
    for info in client.status().jobs:
        if info.job != job:
            continue
        for r in info.history:
            if r.op == op and r.code == "OK" and window[0] <= r.started_at <= window[1]:
                out.append(
                    {
                        "sequence": r.sequence,
                        "total": r.total_seconds,
                        "stages": {s.stage: s.seconds for s in r.stages},
                    }
                )
    return sorted(out, key=lambda r: r["sequence"])


def _ran(client, op: str, count: int) -> str:
    """The algorithm the daemon ran for the latest ``op`` of this job (Status: recent).
    Records of the barriers in between are skipped; a record may land just after the
    reply, so the latest one may be an earlier iteration's, which ran the same."""
    job = client.job
    for record in reversed(client.status().recent):
        if record.job == job and record.op == op and record.count == count:
            return record.algorithm
    return ""


def run_model(args: argparse.Namespace, rank: int, world: int) -> None:
    """--model: one point per message mix and engine; its algorithm is the mix ("gloo
    <mix>" for gloo), its bytes the whole step's, ``ran`` the daemon's algorithms."""
    import lpsync_client
    from lpsync.bench.model_step import gloo_steps, lpsync_steps, summary

    total = {mode: sum(counts) for mode, counts in args.model.items()}
    with lpsync_client.connect(job=args.job, timeout=args.timeout) as client:
        client.barrier()  # waits for the peer mesh; not timed
        nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        for mode, times, wrong, per_message in lpsync_steps(
            client, rank, world, args.model, args.steps, args.warmup, nodes
        ):
            _emit(
                engine="lpsync",
                op="allreduce",
                algorithm=mode,
                bytes=4 * total[mode],
                count=total[mode],
                rank=rank,
                times=times,
                wrong=wrong,
                ran=summary(per_message),
            )
    if args.compare == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
        try:
            for mode, times, wrong in gloo_steps(rank, world, args.model, args.steps, args.warmup):
                _emit(
                    engine="gloo",
                    op="allreduce",
                    algorithm=f"gloo {mode}",
                    bytes=4 * total[mode],
                    count=total[mode],
                    rank=rank,
                    times=times,
                    wrong=wrong,
                    ran="gloo",
                )
        finally:
            dist.destroy_process_group()


def run_gloo(args: argparse.Namespace, rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    try:
        for op in args.ops:
            for nbytes in args.sizes:
                count = element_count(op, nbytes, world, ROOT)
                tensors = gloo_tensors(op, rank, world, count, ROOT)
                call = gloo_call(dist, op, *tensors, ROOT)
                iters = args.iters[str(nbytes)]
                got = measure(call, dist.barrier, args.warmup, iters, CpuMeter(machine=rank == 0))
                wrong = gloo_verify(dist, op, tensors, rank, world, count, ROOT)
                _emit(
                    engine="gloo",
                    op=op,
                    algorithm="gloo",
                    bytes=nbytes,
                    count=count,
                    rank=rank,
                    times=got.times,
                    wrong=wrong,
                    cpu=got.cpu,
                    ran="gloo",
                )
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lpsync.bench.cluster_worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--plan",
        required=True,
        help="JSON: job, ops, algorithms (per op), sizes, warmup, iters (per size), steps "
        "(--model), timeout, compare",
    )
    plan = json.loads(parser.parse_args(argv).plan)
    args = argparse.Namespace(**plan)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if getattr(args, "model", None):
        run_model(args, rank, world)
        return 0
    run_lpsync(args, rank, world)
    if args.compare == "gloo":
        run_gloo(args, rank, world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
