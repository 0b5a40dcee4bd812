"""``lpsync bench --model NAME``: one training step's gradient synchronization of a real
network, replayed through a local daemon (and gloo beside it with --compare gloo).

Two message mixes per model (lpsync.bench.models): every parameter tensor as its own
allreduce (what a naive hook or Horovod without fusion sends) and the tensors fused into
DDP's buckets (25 MiB, the first 1 MiB). A step issues all of its allreduces at once,
in DDP's order, and waits for them; its time is the slowest rank's. Every message lives
in one shared-memory buffer registered once per rank (plan once, run many).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from lpsync.algorithms.tuner import LEARNING_CALLS
from lpsync.bench import models
from lpsync.daemon import launch
from lpsync.daemon.launch import serving
from lpsync.errors import LpsyncError

MODES = ("per-tensor", "ddp-buckets")


@dataclass(frozen=True)
class ModelOptions:
    model: str
    procs: int = 2
    iters: int = 5
    warmup: int = 1
    compare: str | None = None
    socket: str | None = None  # a running daemon; else one is started
    local_nodes: int = 1  # >1: that many daemons on this machine joined over loopback
    timeout: float = 1800.0


@dataclass
class ModeResult:
    mode: str
    messages: list[int]  # element counts, in issue order
    times: dict[str, list[float]] = field(default_factory=dict)  # engine -> per step, slowest rank
    wrong: dict[str, int] = field(default_factory=dict)
    algorithms: dict[str, int] = field(default_factory=dict)  # lpsync: algorithm -> messages
    per_message: list[tuple[int, str]] = field(default_factory=list)  # (elements, algorithm)

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.messages)


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f}{unit}"
    return f"{nbytes}B"


def messages(model: str) -> dict[str, list[int]]:
    counts = models.sizes(model)
    return {"per-tensor": list(reversed(counts)), "ddp-buckets": models.ddp_buckets(counts)}


def _views(flat: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    out, offset = [], 0
    for n in counts:
        out.append(flat[offset : offset + n])
        offset += n
    return out


def lpsync_steps(
    client, rank: int, world: int, plan: dict[str, list[int]], iters: int, warmup: int, nodes: int = 1
) -> Iterator[tuple[str, list[float], int, list[tuple[int, str]]]]:
    """Per mode: (mode, this rank's step times, wrong elements after a verified step,
    rank 0's (elements, algorithm) per message in sequence order). One shared-memory buffer
    holds every message. Across ``nodes`` > 1 the daemons' first LEARNING_CALLS calls of a
    size are node 0's timed trials of candidate schedules (daemon/collectives/learning.py),
    and a size may come once a step: so many steps more are warm-up, and the timed steps
    are what a job runs after them (the op sweeps do the same), not a mix of trials."""
    warmup += LEARNING_CALLS if nodes > 1 else 0
    want = world * (world + 1) / 2
    flat = client.zeros(max(sum(c) for c in plan.values()), "float32")
    for mode, counts in plan.items():
        views = _views(flat, counts)

        def step(views: list[np.ndarray] = views) -> None:
            for future in [client.allreduce_async(v) for v in views]:
                future.result(timeout=2 * client.timeout + 10)

        for _ in range(warmup):
            step()
        times = []
        for _ in range(iters):
            client.barrier()
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        flat[:] = rank + 1
        client.barrier()
        step()
        wrong = sum(int(np.count_nonzero(v != want)) for v in views)
        per_message: list[tuple[int, str]] = []
        if rank == 0:
            recent = client.status(recent=256).recent
            mine = sorted(
                (r for r in recent if r.job == client.job and r.op == "allreduce"), key=lambda r: r.sequence
            )[-len(views) :]
            per_message = [(r.count, r.algorithm) for r in mine]
        yield mode, times, wrong, per_message
    client.release(flat)


def gloo_steps(
    rank: int, world: int, plan: dict[str, list[int]], iters: int, warmup: int
) -> Iterator[tuple[str, list[float], int]]:
    """The same steps through torch.distributed's gloo (the process group is the caller's)."""
    import torch
    import torch.distributed as dist

    want = world * (world + 1) / 2
    flat = torch.zeros(max(sum(c) for c in plan.values()))
    for mode, counts in plan.items():
        views = list(torch.split(flat[: sum(counts)], counts))

        def step(views: list = views) -> None:
            for work in [dist.all_reduce(v, async_op=True) for v in views]:
                work.wait()

        for _ in range(warmup):
            step()
        times = []
        for _ in range(iters):
            dist.barrier()
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        flat.fill_(rank + 1)
        dist.barrier()
        step()
        yield mode, times, sum(int((v != want).sum()) for v in views)


def summary(per_message: list[tuple[int, str]]) -> str:
    """ "lp x3, ring x2": the algorithms the daemon ran, counted per message."""
    return ", ".join(f"{a} x{n}" for a, n in sorted(Counter(a for _, a in per_message).items()))


def worker(
    rank: int,
    world: int,
    sockets: list[str],
    job: str,
    plan: dict[str, list[int]],
    iters: int,
    warmup: int,
    compare: str | None,
    queue,
) -> None:
    import lpsync_client

    per_node = world // len(sockets)  # node-major ranks, as torchrun numbers them
    with lpsync_client.connect(
        sockets[rank // per_node],
        job=job,
        rank=rank,
        world_size=world,
        local_rank=rank % per_node,
        local_world_size=per_node,
        timeout=600,
    ) as client:
        steps = lpsync_steps(client, rank, world, plan, iters, warmup, nodes=len(sockets))
        for mode, times, wrong, per_message in steps:
            queue.put(("lpsync", mode, rank, times, wrong, per_message))
    if compare == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = os.path.join(os.path.dirname(sockets[0]), f"{job}.gloo-store")
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        try:
            for mode, times, wrong in gloo_steps(rank, world, plan, iters, warmup):
                queue.put(("gloo", mode, rank, times, wrong, []))
        finally:
            dist.destroy_process_group()


def run(options: ModelOptions) -> list[ModeResult]:
    plan = messages(options.model)
    results = {mode: ModeResult(mode, counts) for mode, counts in plan.items()}
    tmp = tempfile.mkdtemp(prefix="lpsync-bench-model-")
    daemon = None
    cluster = None
    procs: list = []
    try:
        socket = options.socket
        if options.local_nodes > 1:
            from lpsync.demo.local_cluster import LocalCluster

            cluster = LocalCluster(Path(tmp), options.local_nodes)
            sockets = [node.socket for node in cluster.nodes]
        elif socket is None or not serving(socket):
            socket = socket or os.path.join(tmp, "lpsync.sock")
            daemon = launch.Daemon(socket, "--log-level", "WARNING", start_new_session=True)
        if cluster is None:
            sockets = [cast(str, socket)]  # set above when no cluster was started
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        job = f"bench-model-{os.getpid()}"
        procs = [
            ctx.Process(
                target=worker,
                args=(
                    r,
                    options.procs,
                    sockets,
                    job,
                    plan,
                    options.iters,
                    options.warmup,
                    options.compare,
                    queue,
                ),
            )
            for r in range(options.procs)
        ]
        for p in procs:
            p.start()
        engines = ["lpsync"] + ([options.compare] if options.compare else [])
        expected = len(engines) * len(plan) * options.procs
        got: dict[tuple[str, str], list] = {}
        deadline = time.monotonic() + options.timeout
        received = 0
        while received < expected:
            if time.monotonic() > deadline:
                raise LpsyncError("lpsync bench: the model replay timed out")
            try:
                engine, mode, _, times, wrong, per_message = queue.get(timeout=1.0)
            except Exception:
                if not any(p.is_alive() for p in procs):
                    raise LpsyncError("lpsync bench: rank processes stopped early") from None
                continue
            received += 1
            got.setdefault((engine, mode), []).append((times, wrong))
            r = results[mode]
            if per_message:
                r.per_message = per_message
                r.algorithms = dict(Counter(a for _, a in per_message))
            if len(got[(engine, mode)]) == options.procs:
                ranks = got.pop((engine, mode))
                r.times[engine] = [max(t) for t in zip(*[g[0] for g in ranks], strict=True)]
                r.wrong[engine] = sum(g[1] for g in ranks)
                print(
                    f"[{options.model}] {engine} {mode}: "
                    f"{statistics.median(r.times[engine]) * 1e3:.1f} ms per step",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(5)
        if cluster is not None:
            cluster.stop()
        if daemon is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.stop(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return list(results.values())


def report(options: ModelOptions, results: list[ModeResult], as_json: bool) -> str:
    counts = models.sizes(options.model)
    if as_json:
        return json.dumps(
            {
                "model": options.model,
                "procs": options.procs,
                "nodes": options.local_nodes,
                "tensors": len(counts),
                "parameters": sum(counts),
                "dtype": "float32",
                "results": [
                    {
                        "mode": r.mode,
                        "messages": len(r.messages),
                        "bytes": r.nbytes,
                        "largest": 4 * max(r.messages),
                        "smallest": 4 * min(r.messages),
                        "algorithms": r.algorithms,
                        "wrong": r.wrong,
                        "per_message": [{"bytes": 4 * n, "algorithm": a} for n, a in r.per_message],
                        **{f"{e}_step_seconds": statistics.median(t) for e, t in r.times.items()},
                        **{
                            f"{e}_algbw_gbps": r.nbytes / statistics.median(t) / 1e9
                            for e, t in r.times.items()
                        },
                    }
                    for r in results
                ],
            },
            indent=2,
        )
    engines = list(results[0].times)
    lines = [
        f"# lpsync bench --model {options.model}: {len(counts)} parameter tensors, "
        f"{sum(counts):,} parameters ({_size(4 * sum(counts))} of float32 "
        f"gradients), {options.procs} processes"
        + (f" on {options.local_nodes} daemons (joined over loopback)" if options.local_nodes > 1 else "")
        + f", median of {options.iters} steps",
        f"#{'mode':>12} {'messages':>8} {'sizes':>19}"
        + "".join(f" | {e + ' step':>12} {'algbw':>7} {'#wrong':>6}" for e in engines)
        + (f" | {'speedup':>7}" if len(engines) > 1 else "")
        + " | lpsync algorithms",
        f"#{'':>12} {'':>8} {'':>19}"
        + "".join(f" | {'(ms)':>12} {'(GB/s)':>7} {'':>6}" for _ in engines)
        + (f" | {'':>7}" if len(engines) > 1 else ""),
    ]
    for r in results:
        span = f"{_size(4 * min(r.messages))}..{_size(4 * max(r.messages))}"
        line = f" {r.mode:>12} {len(r.messages):>8} {span:>19}"
        for e in engines:
            t = statistics.median(r.times[e])
            line += f" | {t * 1e3:>12.2f} {r.nbytes / t / 1e9:>7.3f} {r.wrong[e]:>6}"
        if len(engines) > 1:
            ratio = statistics.median(r.times[engines[1]]) / statistics.median(r.times["lpsync"])
            line += f" | {ratio:>6.2f}x"
        line += " | " + summary(r.per_message)
        lines.append(line)
    return "\n".join(lines)
