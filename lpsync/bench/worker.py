"""One benchmark rank: the same sizes through lpsync, then (optionally) through gloo.

Each timed iteration is one blocking collective on buffers set up once per size; the
per-iteration times go back to the runner as one JSON line per point on stdout
(``python -m lpsync.bench.worker --plan JSON``; ranks.py reads them, as it reads the
cluster's ranks), and the runner takes the slowest rank per iteration. The verify pass fills the buffers
with known values, runs once more and counts wrong elements.

Sizes follow nccl-tests: a size is the whole buffer of P blocks for the blocked ops
(allgather, reduce_scatter, gather, scatter, alltoall) and ``count`` one rank's block.
Every buffer's length comes from the client's rule (lpsync_client.wire.blocks): in place
one buffer holds the larger side, the smaller being this rank's block of it (or nothing);
alltoall, out of place only, gets an input and an output buffer. sendrecv is not a daemon
collective but point-to-point in a ring, as nccl-tests' sendrecv: every rank sends its
buffer to the next rank and receives the previous rank's into its second buffer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from lpsync.algorithms.cost import busbw_factor
from lpsync.algorithms.registry import algorithms_for
from lpsync.types import Collective
from lpsync_client.wire import OUT_OF_PLACE_ONLY, ROOTED_OPS, blocks

if TYPE_CHECKING:
    import torch

DTYPE = "float32"
ROUNDS = 5
REDUCING = frozenset({"allreduce", "reduce", "reduce_scatter"})
TWO_BUFFERS = OUT_OF_PLACE_ONLY | {"sendrecv"}  # an input and an output buffer


def bus_factor(op: str, participants: int) -> float:
    """nccl-tests' bus bandwidth factor (sendrecv: 1, every byte crosses one link)."""
    if op == "sendrecv":
        return 1.0
    return busbw_factor(Collective(op), participants)


def algorithms_of(op: str) -> list[str]:
    """The daemon's algorithms for ``op`` (sendrecv rides broadcasts in two-rank jobs and
    has none of its own)."""
    return [] if op == "sendrecv" else list(algorithms_for(Collective(op)))


def iterations(nbytes: int, forced: int) -> int:
    return forced or int(min(1000, max(10, (1 << 30) // max(nbytes, 1))))


def columns(op: str) -> tuple[str, int]:
    """nccl-tests' redop and root columns for ``op`` (root -1: none)."""
    return ("sum" if op in REDUCING else "none"), (0 if op in ROOTED_OPS else -1)


def element_count(op: str, nbytes: int, world: int, root: int = 0) -> int:
    """``count``: one rank's block of an ``nbytes`` message (the root's largest buffer)."""
    return max(1, max(1, nbytes // 4) // max(blocks(op, world, root, root)))


def buffers(op: str, world: int, count: int, rank: int, root: int = 0) -> tuple[int, int]:
    """Elements of the buffer a collective gets and of its ``out`` (0: in place)."""
    n_in, n_out = blocks(op, world, rank, root)
    if op in TWO_BUFFERS:
        return count * n_in, count * n_out
    return count * max(n_in, n_out), 0


def expected(
    op: str, rank: int, world: int, count: int, root: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The verify pass: what this rank's buffers hold before it (the in-place buffer,
    then alltoall's out) and what they must hold after it (NaN: not checked).

    Reductions: every rank sends rank+1 everywhere and the result is the sum (reduce's
    other ranks keep their input; reduce_scatter's other blocks are scratch). The other
    ops move blocks: block i of rank s's input holds s+1 + i*P; output block b comes from
    rank b where there are several (else from the root), and is the source's block
    ``rank`` where it sends several (else its only one)."""
    n_in, n_out = blocks(op, world, rank, root)
    if op == "sendrecv":  # from the previous rank of the ring
        return [np.full(count, rank + 1.0), np.full(count, -1.0)], [
            np.full(count, rank + 1.0),
            np.full(count, (rank - 1) % world + 1.0),
        ]
    if op in REDUCING:
        sent = np.full(n_in * count, rank + 1.0)
        keeps = op == "reduce" and rank != root
        got = np.full(n_out * count, rank + 1.0 if keeps else world * (world + 1) / 2)
        rest = np.full(n_in * count, np.nan)
    else:

        def value(src: int, block: int) -> float:
            return src + 1.0 + block * world

        def source(b: int) -> tuple[int, int]:
            src = b if n_out > 1 else root
            return src, (rank if blocks(op, world, src, root)[0] > 1 else 0)

        sent = np.repeat([value(rank, i) for i in range(n_in)], count).astype(float)
        got = np.repeat([value(*source(b)) for b in range(n_out)], count).astype(float)
        rest = sent  # in place, the input outside this rank's output stays
    if op in OUT_OF_PLACE_ONLY:
        return [sent, np.full(got.size, -1.0)], [sent, got]
    size = max(sent.size, got.size)
    return [_embed(sent, size, rank * count, None)], [_embed(got, size, rank * count, rest)]


def _embed(part: np.ndarray, size: int, at: int, base: np.ndarray | None) -> np.ndarray:
    """``part`` as a buffer of ``size`` elements: itself, or placed at ``at`` in a copy of
    ``base`` (None: -1, what a receiving side holds before)."""
    if part.size == size:
        return part
    whole = np.full(size, -1.0) if base is None else base.copy()
    whole[at : at + part.size] = part
    return whole


def fill(op: str, bufs: list[np.ndarray], rank: int, world: int, count: int, root: int = 0) -> None:
    """Write the verify pass's inputs into ``bufs`` (the buffer, then any out)."""
    for buf, values in zip(bufs, expected(op, rank, world, count, root)[0], strict=True):
        buf[:] = values


def count_wrong(op: str, bufs: list[np.ndarray], rank: int, world: int, count: int, root: int = 0) -> int:
    """Elements of ``bufs`` that differ from what the verify pass must leave."""
    wrong = 0
    for buf, want in zip(bufs, expected(op, rank, world, count, root)[1], strict=True):
        wrong += int(np.count_nonzero(~np.isnan(want) & (buf != want)))
    return wrong


def lpsync_call(client, op: str, buf, algorithm: str | None, root: int = 0, out=None) -> Callable[[], object]:
    """One blocking collective on ``buf`` (in place, or into ``out``); ``algorithm`` None:
    the tuner picks."""
    if op == "sendrecv":
        world, rank = client.world_size, client.rank

        def ring() -> None:
            sent = client.send_async(buf, (rank + 1) % world)
            client.recv(out, (rank - 1) % world)
            sent.result()

        return ring
    method = getattr(client, op)
    kwargs: dict[str, object] = {"algorithm": algorithm}
    if op in ROOTED_OPS:
        kwargs["root"] = root
    if out is not None:
        kwargs["out"] = out
    return lambda: method(buf, **kwargs)


class Buffer:
    """The benchmark's buffer in one memory kind: ``array`` is what collectives get,
    ``load``/``store`` move numpy values in and out for the verify pass."""

    def __init__(self, client, memory: str, elements: int, device: int) -> None:
        self.memory = memory
        if memory == "host":
            self.array = client.zeros(elements, DTYPE)
        elif memory == "emulated":
            from lpsync_client import emulated

            self.array = emulated.zeros(elements, DTYPE, device)
        else:
            import cupy

            with cupy.cuda.Device(device):
                self.array = cupy.zeros(elements, DTYPE)
        if memory != "host":
            self.registered = client.register(self.array)  # opened by the daemon once

    def load(self) -> np.ndarray:
        if self.memory == "host":
            return self.array
        if self.memory == "emulated":
            return self.array.get()
        import cupy

        return cupy.asnumpy(self.array)

    def store(self, values: np.ndarray) -> None:
        if self.memory == "host":
            return  # load() returned the buffer itself
        if self.memory == "emulated":
            self.array.set(values)
        else:
            self.array.set(values)  # cupy.ndarray.set: host to device

    def sync(self) -> None:
        """Until the collective finished (device memory: a stream-ordered answer comes at
        enqueue, and the buffer's stream waits for the rest; the time counts it all)."""
        if self.memory == "emulated":
            from lpsync_client import emulated

            emulated.current_stream(self.array.device).synchronize()
        elif self.memory != "host":
            import cupy

            with cupy.cuda.Device(self.array.device.id):
                cupy.cuda.get_current_stream().synchronize()

    def release(self, client) -> None:
        client.release(self.array if self.memory == "host" else self.registered)


def run(
    rank: int,
    world: int,
    socket: str,
    job: str,
    op: str,
    sizes: list[int],
    algorithm: str | None,
    iters: int,
    warmup: int,
    compare: str | None,
    put: Callable[[dict[str, Any]], None],
    trigger: str = "auto",
    memory: str = "host",
    devices: int = 1,
    per_node: int = 0,
) -> None:
    """``put`` takes each point's row; ``per_node``: ranks per daemon of several
    (node-major, as torchrun numbers them)."""
    import lpsync_client

    root = 0
    local: dict[str, Any] = {"local_rank": rank % per_node, "local_world_size": per_node} if per_node else {}
    with lpsync_client.connect(
        socket, job=job, rank=rank, world_size=world, timeout=600, trigger=trigger, **local
    ) as client:
        for nbytes in sizes:
            count = element_count(op, nbytes, world, root)
            # The buffer, and alltoall's out
            held = [
                Buffer(client, memory, n, rank % devices) for n in buffers(op, world, count, rank, root) if n
            ]
            out = held[1].array if len(held) > 1 else None
            call = lpsync_call(client, op, held[0].array, algorithm, root, out)
            n = iterations(nbytes, iters)
            for _ in range(warmup):
                call()
            # Pings and collectives alternate in rounds, so both see the same machine
            # (the latency criterion compares their medians).
            pings: list[float] = []  # the gRPC Session stream's round trip, always
            trigger_pings: list[float] = []  # the trigger socket's, with --trigger socket
            times: list[float] = []
            rounds = ROUNDS if n >= 10 * ROUNDS else 1
            for _ in range(rounds):
                client.barrier()
                for _ in range(max(1, min(n, 1000) // rounds)):
                    t = time.perf_counter()
                    client.ping(via="grpc")
                    pings.append(time.perf_counter() - t)
                    if client.trigger == "socket":
                        t = time.perf_counter()
                        client.ping(via="socket")
                        trigger_pings.append(time.perf_counter() - t)
                client.barrier()
                for _ in range(n // rounds):
                    t = time.perf_counter()
                    call()
                    if memory != "host":
                        held[-1].sync()
                    times.append(time.perf_counter() - t)
            values = [b.load() for b in held]
            fill(op, values, rank, world, count, root)
            for b, v in zip(held, values, strict=True):
                b.store(v)
            client.barrier()
            call()
            wrong = count_wrong(op, [b.load() for b in held], rank, world, count, root)
            recent = client.status().recent if rank == 0 else []
            # This size's own collective, not the barrier before it (the job's too).
            mine = [r for r in recent if r.job == job and r.op != "barrier"]
            put(
                {
                    "engine": "lpsync",
                    "bytes": nbytes,
                    "count": count,
                    "times": times,
                    "wrong": wrong,
                    "pings": pings,
                    "trigger_pings": trigger_pings,
                    "algorithm": mine[-1].algorithm if mine else "",
                }
            )
            for b in held:
                b.release(client)
            del call, held, out
    if compare == "gloo":
        _gloo(rank, world, socket, job, op, sizes, iters, warmup, put)


def _gloo(
    rank: int,
    world: int,
    socket: str,
    job: str,
    op: str,
    sizes: list[int],
    iters: int,
    warmup: int,
    put: Callable[[dict[str, Any]], None],
) -> None:
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = os.path.join(os.path.dirname(socket), f"{job}.gloo-store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for nbytes in sizes:
            count = element_count(op, nbytes, world)
            tensors = gloo_tensors(op, rank, world, count)
            call = gloo_call(dist, op, *tensors)
            n = iterations(nbytes, iters)
            for _ in range(warmup):
                call()
            dist.barrier()
            times = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            wrong = gloo_verify(dist, op, tensors, rank, world, count)
            put({"engine": "gloo", "bytes": nbytes, "count": count, "times": times, "wrong": wrong})
    finally:
        dist.destroy_process_group()


def gloo_tensors(
    op: str, rank: int, world: int, count: int, root: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(full, mine, out): the buffer as lpsync's (``buffers``), this rank's block of it
    (or all of it) and alltoall's output (else None)."""
    import torch

    size, out = buffers(op, world, count, rank, root)
    full = torch.zeros(size)
    mine = full[rank * count : (rank + 1) * count] if size > count else full
    return full, mine, (torch.zeros(out) if out else None)


def gloo_verify(dist, op: str, tensors, rank: int, world: int, count: int, root: int = 0) -> int:
    """Fill known values, run ``op`` once more through gloo, count wrong elements."""
    full, mine, out = tensors
    arrays = [t.numpy() for t in (full, out) if t is not None]
    fill(op, arrays, rank, world, count, root)
    call = gloo_call(dist, op, full, mine, out, root)  # its staged copies see the new values
    dist.barrier()
    call()
    if op == "reduce" and rank != root:
        return 0  # gloo leaves partial sums in non-root buffers (documented)
    return count_wrong(op, arrays, rank, world, count, root)


def gloo_call(dist, op: str, full, mine, out=None, root: int = 0):
    """The torch.distributed call for ``op`` on a size's tensors (same layout as lpsync's)."""
    if op == "allreduce":
        return lambda: dist.all_reduce(full)
    if op == "broadcast":
        return lambda: dist.broadcast(full, root)
    if op == "reduce":
        return lambda: dist.reduce(full, root)
    if op == "allgather":
        block = mine.clone()
        return lambda: dist.all_gather_into_tensor(full, block)
    if op == "reduce_scatter":
        source = full.clone()
        return lambda: dist.reduce_scatter_tensor(mine, source)
    if op == "sendrecv":
        world, rank = dist.get_world_size(), dist.get_rank()
        ring = [
            dist.P2POp(dist.isend, full, (rank + 1) % world),
            dist.P2POp(dist.irecv, out, (rank - 1) % world),
        ]
        return lambda: [w.wait() for w in dist.batch_isend_irecv(ring)]
    # The root's list is its buffer's P blocks (views: in place, as lpsync's)
    parts = list(full.chunk(dist.get_world_size())) if dist.get_rank() == root else None
    if op == "gather":
        return lambda: dist.gather(mine, parts, dst=root)
    if op == "scatter":
        return lambda: dist.scatter(mine, parts, src=root)
    return lambda: dist.all_to_all_single(out, full)


def main(argv: list[str] | None = None) -> int:
    """One rank, as runner.py starts it: the plan's fields are ``run``'s arguments."""
    import argparse
    import json

    from lpsync.bench import ranks

    parser = argparse.ArgumentParser(
        prog="python -m lpsync.bench.worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--plan", required=True, help="JSON: run()'s arguments by name, but put")
    plan = json.loads(parser.parse_args(argv).plan)
    run(**plan, put=lambda row: ranks.emit(**row))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
