"""``python -m lab.nccl``: allreduce through NCCL (torch.distributed), one process
per GPU, for scripts/gpu_check.sh to set beside lpsync's device path.

NCCL refuses two ranks on one GPU, so this needs at least two GPUs; with fewer, or without
torch built with CUDA, it says why and writes {"skipped": why} (exit 0: a machine with one
GPU is a machine to check, not a failure).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time

from lpsync.transport.ports import free_ports
from lpsync.units import format_size, parse_sizes


def _rank(rank: int, world: int, port: int, sizes: list[int], iters: int, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for nbytes in sizes:
            x = torch.ones(nbytes // 4, dtype=torch.float32, device=f"cuda:{rank}")
            for _ in range(2):  # warm-up: communicators, the first kernels
                dist.all_reduce(x)
            torch.cuda.synchronize()
            times = []
            for _ in range(iters):
                dist.barrier()
                torch.cuda.synchronize()
                start = time.perf_counter()
                dist.all_reduce(x)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            queue.put((rank, nbytes, times))
    finally:
        dist.destroy_process_group()


def skipped() -> str:
    """Why NCCL cannot run here ("" when it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available() or not torch.distributed.is_nccl_available():
        return "torch has no CUDA or no NCCL here"
    if torch.cuda.device_count() < 2:
        return f"NCCL needs a GPU per rank: {torch.cuda.device_count()} visible, 2 or more needed"
    return ""


def measure(sizes: list[int], iters: int) -> dict:
    why = skipped()
    if why:
        return {"skipped": why}
    import torch

    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_rank, args=(r, world, port, sizes, iters, queue)) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, list[list[float]]] = {}
    try:
        for _ in range(world * len(sizes)):
            _, nbytes, times = queue.get(timeout=300)
            got.setdefault(nbytes, []).append(times)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    results = []
    for nbytes in sizes:
        slowest = [max(t) for t in zip(*got[nbytes], strict=True)]  # per iteration, slowest rank
        median = statistics.median(slowest)
        results.append({"size": nbytes, "time_us": median * 1e6, "algbw_gbps": nbytes / median / 1e9})
    return {"world": world, "results": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.nccl", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1MiB:256MiB", help="message sizes (default 1MiB:256MiB)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size (default 10)")
    parser.add_argument("--json", metavar="FILE", help="also write the results there")
    args = parser.parse_args(argv)
    report = measure(parse_sizes(args.sizes), args.iters)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if "skipped" in report:
        print(f"nccl: not measured: {report['skipped']}")
        return 0
    for row in report["results"]:
        print(
            f"nccl allreduce, {report['world']} GPUs, {format_size(row['size'])}: "
            f"{row['time_us']:.0f} us, algbw {row['algbw_gbps']:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
