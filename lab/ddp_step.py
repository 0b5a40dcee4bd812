"""DDP training step time on the torch.distributed backend ``lpsync``, beside gloo (and the
lpsync DDP hook on a gloo group, where lpsync_client.torch offers one).

Set up (a daemon, or the one on --socket; N rank processes, torchrun's environment), run
(per variant: a fresh model wrapped in DDP, warm-up steps, timed steps: forward, backward
with DDP's gradient allreduce, optimizer step), verify (every rank ends with the same
parameters), report (median and p90 step time of the slowest rank, per variant).

    python -m lab.ddp_step --procs 4 --width 2048 --depth 4 --steps 30
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time

from lab.ranks import torchrun_env
from lpsync.daemon import launch
from lpsync.daemon.launch import serving

VARIANTS = ("lpsync", "hook", "gloo", "local")


def _model(width: int, depth: int):
    import torch

    torch.manual_seed(0)
    layers: list = []
    for i in range(depth):
        layers += [torch.nn.Linear(64 if i == 0 else width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _rank(rank: int, procs: int, socket: str, port: int, args: argparse.Namespace, queue) -> None:
    torchrun_env(rank, procs, port, socket, f"ddp-bench-{port}")
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import lpsync_client.torch as lt

    torch.set_num_threads(1)
    dist.init_process_group("lpsync")
    gloo = dist.new_group(backend="gloo")
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(args.batch, 64, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    for variant in args.variants:
        if variant == "hook" and not hasattr(lt, "allreduce_hook"):
            queue.put((variant, rank, None, True))
            continue
        if variant == "local":  # the same step without DDP: the compute alone
            model = _model(args.width, args.depth)
        else:
            model = DDP(_model(args.width, args.depth), process_group=None if variant == "lpsync" else gloo)
        if variant == "hook":
            model.register_comm_hook(lt.hook_state(), lt.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        times = []
        for step in range(args.warmup + args.steps):
            dist.barrier(group=gloo)  # every rank starts the step together
            start = time.perf_counter()
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        first = flat.clone()
        dist.broadcast(first, 0, group=gloo)
        same = variant == "local" or bool(torch.equal(first, flat))  # local ranks differ
        queue.put((variant, rank, times, same))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.ddp_step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--width", type=int, default=2048, help="hidden width of the MLP")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers of the MLP")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated: lpsync (the backend), hook (gloo group + "
        "lpsync DDP hook), gloo, local (no DDP: the compute alone)",
    )
    parser.add_argument("--socket", help="a running daemon's socket (default: start one)")
    parser.add_argument("--port", type=int, default=29611, help="the rendezvous port")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if unknown := set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(unknown)}; pick from {', '.join(VARIANTS)}")
    tmp = tempfile.mkdtemp(prefix="lpsync-ddp-bench-")
    daemon = None
    try:
        socket = args.socket
        if socket is None or not serving(socket):
            socket = socket or os.path.join(tmp, "lpsync.sock")
            try:
                daemon = launch.Daemon(socket, "--log-level", "WARNING")
            except launch.DaemonStartError as error:
                raise SystemExit(f"ddp_step: the daemon did not start: {error}") from None
        results = _launch(args, socket)
    finally:
        if daemon is not None:
            daemon.stop(30)
        shutil.rmtree(tmp, ignore_errors=True)
    print(report(args, results))
    return 0 if all(same for _, same in results.values()) else 1


def _launch(args: argparse.Namespace, socket: str) -> dict[str, tuple[list[float] | None, bool]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.procs, socket, args.port, args, queue))
        for r in range(args.procs)
    ]
    for p in procs:
        p.start()
    got: dict[str, list] = {v: [] for v in args.variants}
    deadline = time.monotonic() + args.timeout
    try:
        while any(len(v) < args.procs for v in got.values()):
            if time.monotonic() > deadline or (not any(p.is_alive() for p in procs) and queue.empty()):
                raise SystemExit("ddp_step: rank processes stopped early")
            try:
                variant, _, times, same = queue.get(timeout=1.0)
            except Exception:
                continue
            got[variant].append((times, same))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    out: dict[str, tuple[list[float] | None, bool]] = {}
    for variant, ranks in got.items():
        if any(times is None for times, _ in ranks):
            out[variant] = (None, True)
            continue
        slowest = [max(step) for step in zip(*[times for times, _ in ranks], strict=True)]
        out[variant] = (slowest, all(same for _, same in ranks))
    return out


def report(args: argparse.Namespace, results: dict[str, tuple[list[float] | None, bool]]) -> str:
    model = _model(args.width, args.depth)
    params = sum(p.numel() for p in model.parameters())
    base = results.get("gloo", (None, True))[0]
    lines = [
        f"DDP step, MLP {args.depth}x{args.width} ({params / 1e6:.1f} M float32 parameters, "
        f"{params * 4 / 2**20:.0f} MiB of gradients), batch {args.batch}, {args.procs} "
        f"processes, {args.steps} timed steps after {args.warmup}",
        "",
        "| variant | median step (ms) | p90 (ms) | vs gloo | ranks agree |",
        "|---|---:|---:|---:|---|",
    ]
    names = {
        "lpsync": "backend `lpsync` (no hook)",
        "hook": "gloo group + lpsync DDP hook",
        "gloo": "gloo",
        "local": "no DDP (compute alone)",
    }
    for variant in args.variants:
        times, same = results[variant]
        if times is None:
            lines.append(f"| {names[variant]} | (lpsync_client.torch has no DDP hook here) | | | |")
            continue
        median = statistics.median(times)
        p90 = sorted(times)[int(0.9 * (len(times) - 1))]
        ratio = f"{median / statistics.median(base):.2f}x" if base else ""
        lines.append(
            f"| {names[variant]} | {median * 1e3:.1f} | {p90 * 1e3:.1f} | {ratio} | "
            f"{'yes' if same else 'NO'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
