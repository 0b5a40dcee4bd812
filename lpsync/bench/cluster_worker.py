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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from lpsync.bench.worker import (
    DTYPE,
    buffer_elements,
    count_wrong,
    element_count,
    fill,
    gloo_call,
    gloo_tensors,
    gloo_verify,
    lpsync_call,
)

ROOT = 0  # of broadcast and reduce


def measure(call: Callable[[], object], barrier: Callable[[], object], warmup: int,
            iters: int) -> list[float]:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _emit(**point: object) -> None:
    print(json.dumps(point), flush=True)


def run_lpsync(args: argparse.Namespace, rank: int, world: int) -> None:
    import lpsync_client

    with lpsync_client.connect(job=args.job, timeout=args.timeout) as client:
        client.barrier()  # waits for the peer mesh; not timed
        for op in args.ops:
            for nbytes in args.sizes:
                count = element_count(op, nbytes, world)
                buf = client.zeros(buffer_elements(op, world, count), DTYPE)
                for algorithm in args.algorithms[op]:
                    forced = None if algorithm == "auto" else algorithm
                    call = lpsync_call(client, op, buf, forced, ROOT)
                    times = measure(call, client.barrier, args.warmup, args.iters)
                    fill(op, buf, rank, world, count)
                    client.barrier()
                    call()
                    wrong = count_wrong(op, buf, rank, world, count, ROOT)
                    _emit(engine="lpsync", op=op, algorithm=algorithm, bytes=nbytes,
                          count=count, rank=rank, times=times, wrong=wrong,
                          ran=_ran(client, op, count) if rank == 0 else "")
                client.release(buf)
                del buf


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
        for mode, times, wrong, per_message in lpsync_steps(client, rank, world, args.model,
                                                            args.iters, args.warmup):
            _emit(engine="lpsync", op="allreduce", algorithm=mode, bytes=4 * total[mode],
                  count=total[mode], rank=rank, times=times, wrong=wrong,
                  ran=summary(per_message))
    if args.compare == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
        try:
            for mode, times, wrong in gloo_steps(rank, world, args.model, args.iters,
                                                 args.warmup):
                _emit(engine="gloo", op="allreduce", algorithm=f"gloo {mode}",
                      bytes=4 * total[mode], count=total[mode], rank=rank, times=times,
                      wrong=wrong, ran="gloo")
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
                count = element_count(op, nbytes, world)
                full, mine = gloo_tensors(op, rank, world, count)
                times = measure(gloo_call(dist, op, full, mine), dist.barrier, args.warmup,
                                args.iters)
                wrong = gloo_verify(dist, op, full, mine, rank, world, count)
                _emit(engine="gloo", op=op, algorithm="gloo", bytes=nbytes, count=count,
                      rank=rank, times=times, wrong=wrong, ran="gloo")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lpsync.bench.cluster_worker",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True,
                        help="JSON: job, ops, algorithms (per op), sizes, warmup, iters, "
                             "timeout, compare")
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
