"""One benchmark rank: the same sizes through lpsync, then (optionally) through gloo.

Each timed iteration is one blocking collective on a buffer set up once per size; the
per-iteration times go back to the runner, which takes the slowest rank per iteration
(a collective is as slow as its last participant). The verify pass fills the buffer
with known values, runs once more and counts wrong elements.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

DTYPE = "float32"
ROUNDS = 5


def iterations(nbytes: int, forced: int) -> int:
    return forced or int(min(1000, max(10, (1 << 30) // max(nbytes, 1))))


def fill(op: str, buf: np.ndarray, rank: int, world: int, count: int) -> None:
    if op == "allgather":
        buf[:] = -1
        buf[rank * count : (rank + 1) * count] = rank + 1
    else:
        buf[:] = rank + 1


def count_wrong(op: str, buf: np.ndarray, rank: int, world: int, count: int, root: int) -> int:
    if op == "allreduce":
        want: np.ndarray | float = world * (world + 1) / 2
    elif op == "broadcast":
        want = root + 1
    elif op == "reduce":
        want = world * (world + 1) / 2 if rank == root else rank + 1
    elif op == "allgather":
        want = np.repeat(np.arange(1, world + 1, dtype=buf.dtype), count)
    else:  # reduce_scatter: this rank's block holds the sum
        block = buf[rank * count : (rank + 1) * count]
        return int(np.count_nonzero(block != world * (world + 1) / 2))
    return int(np.count_nonzero(buf != want))


def element_count(op: str, nbytes: int, world: int) -> int:
    elements = max(1, nbytes // 4)
    return elements // world if op in ("allgather", "reduce_scatter") else elements


def buffer_elements(op: str, world: int, count: int) -> int:
    return count * world if op in ("allgather", "reduce_scatter") else count


def lpsync_call(
    client, op: str, buf: np.ndarray, algorithm: str | None, root: int = 0
) -> Callable[[], object]:
    """One blocking, in-place collective on ``buf``; ``algorithm`` None: the tuner picks."""
    method = getattr(client, op)
    if op in ("broadcast", "reduce"):
        return lambda: method(buf, root=root, algorithm=algorithm)
    return lambda: method(buf, algorithm=algorithm)


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
    queue,
    trigger: str = "auto",
    memory: str = "host",
    devices: int = 1,
) -> None:
    import lpsync_client

    root = 0
    with lpsync_client.connect(
        socket, job=job, rank=rank, world_size=world, timeout=600, trigger=trigger
    ) as client:
        for nbytes in sizes:
            count = element_count(op, nbytes, world)
            buffer = Buffer(client, memory, buffer_elements(op, world, count), rank % devices)
            buf = buffer.array
            call = lpsync_call(client, op, buf, algorithm, root)
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
                    times.append(time.perf_counter() - t)
            values = buffer.load()
            fill(op, values, rank, world, count)
            buffer.store(values)
            client.barrier()
            call()
            wrong = count_wrong(op, buffer.load(), rank, world, count, root)
            recent = client.status().recent if rank == 0 else []
            mine = [r for r in recent if r.job == job]
            queue.put(
                (
                    "lpsync",
                    rank,
                    nbytes,
                    count,
                    times,
                    wrong,
                    (pings, trigger_pings),
                    mine[-1].algorithm if mine else "",
                )
            )
            buffer.release(client)
            del buf, buffer
    if compare == "gloo":
        _gloo(rank, world, socket, job, op, sizes, iters, warmup, queue)


def _gloo(
    rank: int, world: int, socket: str, job: str, op: str, sizes: list[int], iters: int, warmup: int, queue
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
            full, mine = gloo_tensors(op, rank, world, count)
            call = gloo_call(dist, op, full, mine)
            n = iterations(nbytes, iters)
            for _ in range(warmup):
                call()
            dist.barrier()
            times = []
            for _ in range(n):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
            wrong = gloo_verify(dist, op, full, mine, rank, world, count)
            queue.put(("gloo", rank, nbytes, count, times, wrong, ([], []), "gloo"))
    finally:
        dist.destroy_process_group()


def gloo_tensors(op: str, rank: int, world: int, count: int):
    """(full, mine): the whole buffer and this rank's block, laid out as lpsync's."""
    import torch

    if op in ("allgather", "reduce_scatter"):
        full = torch.zeros(count * world)
        return full, full[rank * count : (rank + 1) * count]
    full = torch.zeros(count)
    return full, full


def gloo_verify(dist, op: str, full, mine, rank: int, world: int, count: int) -> int:
    """Fill known values, run ``op`` once more through gloo, count wrong elements."""
    arr = full.numpy()
    fill(op, arr, rank, world, count)
    call = gloo_call(dist, op, full, mine)  # its staged copies see the new values
    dist.barrier()
    call()
    if op == "reduce_scatter":
        return int(np.count_nonzero(mine.numpy() != world * (world + 1) / 2))
    if op == "reduce" and rank != 0:
        return 0  # gloo leaves partial sums in non-root buffers (documented)
    return count_wrong(op, arr, rank, world, count, 0)


def gloo_call(dist, op: str, full, mine):
    """The torch.distributed call for ``op`` on a size's tensors (same layout as lpsync's)."""
    if op == "allreduce":
        return lambda: dist.all_reduce(full)
    if op == "broadcast":
        return lambda: dist.broadcast(full, 0)
    if op == "reduce":
        return lambda: dist.reduce(full, 0)
    if op == "allgather":
        block = mine.clone()
        return lambda: dist.all_gather_into_tensor(full, block)
    source = full.clone()
    return lambda: dist.reduce_scatter_tensor(mine, source)
